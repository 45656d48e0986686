"""store/location.py: a run's storage and its work folder on this machine. For a local
run both are one folder and upload/fetch do nothing; for a run on S3 (moto over HTTP) a folder
uploaded by one machine is fetched whole by another, its `last` file written last."""

from __future__ import annotations

import pytest

from store.location import CACHE_ENV, RunLocation, local_folder, node_cache
from store.storage import open_storage


def test_a_local_run_is_its_own_work_folder(tmp_path):
    location = RunLocation.of(tmp_path / "run")
    assert location.work == tmp_path / "run" and location.is_local
    (location.work / "report").mkdir(parents=True)
    (location.work / "report" / "a.txt").write_text("a")
    location.upload("report")  # nothing to copy
    assert location.fetch("report") == tmp_path / "run" / "report"
    location.remove("report")
    assert not (tmp_path / "run" / "report").exists()


def test_an_object_store_run_works_in_the_node_cache(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-a"))
    url = f"s3://{s3_server.bucket()}/runs/x"
    a = RunLocation.of(url)
    assert not a.is_local and a.work == node_cache(url) and a.work.is_relative_to(tmp_path / "node-a")
    assert a.name == "x" and a.key == url
    folder = a.work / "checkpoints" / "step-2"
    (folder / "optimizer").mkdir(parents=True)
    for name, text in [("config.json", "{}"), ("trainer_state.json", '{"step": 2}'), ("z.bin", "zz"),
                       ("optimizer/state.safetensors", "opt")]:
        (folder / name).write_text(text)
    order = []
    storage = a.storage
    upload = type(storage).upload
    monkeypatch.setattr(type(storage), "upload", lambda self, rel, path: (order.append(rel), upload(self, rel, path)))
    a.upload("checkpoints/step-2", last="trainer_state.json")
    assert order[-1] == "checkpoints/step-2/trainer_state.json" and len(order) == 4

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-b"))  # another machine: an empty cache
    b = RunLocation.of(url)
    assert b.work != a.work and not b.work.exists()
    got = b.fetch("checkpoints/step-2", last="trainer_state.json")
    assert got == b.work / "checkpoints" / "step-2"
    assert sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()) == \
        ["config.json", "optimizer/state.safetensors", "trainer_state.json", "z.bin"]
    assert (got / "z.bin").read_text() == "zz"
    (got / "z.bin").write_text("z")  # a local copy of another size is fetched again
    b.fetch("checkpoints/step-2")
    assert (got / "z.bin").read_text() == "zz"
    with pytest.raises(FileNotFoundError, match=r"s3://.*/runs/x/nothing: no such file or folder"):
        b.fetch("nothing")
    b.remove("checkpoints/step-2")
    assert not got.exists() and open_storage(url).list("checkpoints/") == []


def test_a_model_on_s3_is_read_from_this_machines_copy(s3_server, toy_dir, tmp_path, monkeypatch):
    """local_folder: a local path as it is; a URL as a copy in node_cache(url, "models") named
    like the model (the engines' fingerprints show that name), fetched once per machine."""
    assert local_folder(toy_dir / "model") == toy_dir / "model"
    bucket = s3_server.bucket()
    for path in (toy_dir / "model").iterdir():
        s3_server.client().upload_file(str(path), bucket, f"models/toy/{path.name}")
    url = f"s3://{bucket}/models/toy"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-a"))
    copy = local_folder(url)
    assert copy == node_cache(url, "models") and copy.name == "toy" and copy.is_relative_to(tmp_path / "node-a")
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in (toy_dir / "model").iterdir())
    assert (copy / "model.safetensors").read_bytes() == (toy_dir / "model" / "model.safetensors").read_bytes()
    stamp = (copy / "model.safetensors").stat().st_mtime_ns
    assert local_folder(url) == copy and (copy / "model.safetensors").stat().st_mtime_ns == stamp  # kept
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-b"))  # another machine fetches its own
    assert local_folder(url).is_relative_to(tmp_path / "node-b")
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/models/none"):
        local_folder(f"s3://{bucket}/models/none")
