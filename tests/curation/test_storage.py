"""The storage interface on a local folder and on an S3-compatible server over HTTP (moto):
the same calls, the same answers; `create` lets exactly one of several processes win."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from curation.store.storage import (
    LocalStorage,
    ObjectStorage,
    StorageError,
    is_object_url,
    open_storage,
)
from tests.helpers import REPO


@pytest.fixture
def storage(run_storage):
    return run_storage


def test_write_read_replace_and_missing(storage):
    assert storage.read_if_exists("a/b.json") is None
    with pytest.raises(FileNotFoundError, match="a/b.json"):
        storage.read("a/b.json")
    storage.write("a/b.json", b"one")
    assert storage.read("a/b.json") == b"one" and storage.exists("a/b.json")
    storage.write("a/b.json", b"two")
    assert storage.read("a/b.json") == b"two"
    storage.delete("a/b.json")
    storage.delete("a/b.json")  # no error when gone
    assert not storage.exists("a/b.json")


def test_create_only_when_absent(storage):
    assert storage.create("_log/00000001.json", b"first") is True
    assert storage.create("_log/00000001.json", b"second") is False
    assert storage.read("_log/00000001.json") == b"first"


def test_list_is_recursive_sorted_and_by_folder(storage):
    for rel in ["samples/round=2/p.parquet", "samples/round=10/p.parquet", "scores/round=2/p.parquet",
                "samplesx/q", "top.json"]:
        storage.write(rel, rel.encode())
    assert [e.rel for e in storage.list("samples")] == ["samples/round=10/p.parquet", "samples/round=2/p.parquet"]
    assert [e.rel for e in storage.list("samples/")] == ["samples/round=10/p.parquet", "samples/round=2/p.parquet"]
    everything = storage.list()
    assert [e.rel for e in everything] == sorted(e.rel for e in everything) and len(everything) == 5
    assert {e.rel: e.size for e in everything}["top.json"] == len(b"top.json")
    assert storage.child("samples").read("round=2/p.parquet") == b"samples/round=2/p.parquet"


def test_paths_outside_the_root_are_refused(storage):
    for rel in ["../x", "/abs", "a/../../b", ""]:
        with pytest.raises(ValueError, match="not a path inside"):
            storage.write(rel, b"x")


def test_local_write_leaves_no_temporary_file(tmp_path):
    store = LocalStorage(tmp_path)
    store.write("f.bin", b"x" * 1000)
    assert store.create("g.bin", b"y") and not store.create("g.bin", b"z")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "g.bin"]


RACE = """
import sys
from curation.store.storage import open_storage
store = open_storage(sys.argv[1])
sys.stdin.readline()  # start together
print("won" if store.create("_log/00000007.json", sys.argv[2].encode()) else "lost")
"""


def test_two_processes_creating_one_object_exactly_one_wins(storage):
    procs = [subprocess.Popen([sys.executable, "-c", RACE, storage.url, name], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for name in ("a", "b", "c")]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(outcomes) == ["lost", "lost", "won"], outcomes
    winner = "abc"[outcomes.index("won")]
    assert storage.read("_log/00000007.json") == winner.encode()


def test_urls_and_schemes():
    assert is_object_url("s3://b/x") and is_object_url("gs://b/x") and is_object_url("az://c/x")
    assert not is_object_url("runs/x") and not is_object_url("/abs/runs")
    assert isinstance(open_storage("file:///tmp/x"), LocalStorage)
    with pytest.raises(ValueError, match="unknown storage scheme 'ftp'"):
        open_storage("ftp://host/x")


def test_a_missing_bucket_is_one_clear_error(s3_server):
    store = open_storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run")
    assert isinstance(store, ObjectStorage)
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-\w+/run/x.json: writing failed"):
        store.write("x.json", b"1")
