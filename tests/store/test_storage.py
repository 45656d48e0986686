"""The storage interface on a local folder and on an S3-compatible server over HTTP (moto):
the same calls, the same answers; `create` lets exactly one of several processes win."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from store.storage import (
    LocalStorage,
    ObjectStorage,
    StorageError,
    check_location,
    is_object_url,
    open_storage,
)
from store.store_errors import RETRY_ENV, BucketNotFoundError, StoreAccessError, retry_config
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
from store.storage import open_storage
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


@pytest.mark.parametrize("location,problem", [
    ("s3://", "no bucket in the URL"),
    ("s3:///runs/x", "no bucket in the URL"),
    ("s3:/bucket/run", "'//' missing after 's3:'"),
    ("S3:bucket/run", "'//' missing after 'S3:'"),
    ("gs//bucket/run", "':' missing after 'gs'"),
    ("az:/container/run", "'//' missing after 'az:'"),
    ("s3://bucket//run", "empty path segment"),
])
def test_a_malformed_location_is_refused_naming_it(location, problem, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        check_location(location)
        open_storage(location)
    assert str(caught.value).startswith(f"{location}: ") and problem in str(caught.value)
    assert not list(tmp_path.iterdir())  # no local folder "s3:" or "gs"


def test_a_run_is_a_folder_inside_a_bucket():
    for location in ("s3://bucket", "gs://bucket/"):
        with pytest.raises(ValueError, match=f"^{location}: names a whole bucket; a run is a folder inside one"):
            check_location(location, run=True)
        assert isinstance(open_storage(location), ObjectStorage)  # a bucket's top level holds prompt files, say


def test_local_paths_that_look_like_urls_when_meant():
    for location in ["./s3:/bucket/run", "runs/s3/x", "s3/x", "/tmp/gs//x", "runs:old/x"]:
        assert isinstance(open_storage(location), LocalStorage), location


def test_a_missing_bucket_is_one_clear_error(s3_server):
    store = open_storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run")
    assert isinstance(store, ObjectStorage)
    for call in (lambda: store.write("x.json", b"1"), lambda: store.list("_log"), lambda: store.read("x.json")):
        with pytest.raises(BucketNotFoundError, match=r"^s3://no-such-bucket-\w+/run: the bucket "
                                                      r"'no-such-bucket-\w+' does not exist at http://127.0.0.1:"):
            call()
    assert issubclass(BucketNotFoundError, ValueError) and issubclass(BucketNotFoundError, StorageError)  # exit 2


def test_no_credentials_is_one_clear_error(s3_server, monkeypatch):
    """Without keys obstore asks the instance-metadata service (here pointed at a closed port):
    the line says no credentials were found, not that the store is unreachable."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(RETRY_ENV, "1")
    with pytest.raises(StoreAccessError, match=r"^s3://bucket/run/_log: listing failed: no credentials found "
                                               r"\(set AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"):
        open_storage("s3://bucket/run").list("_log")


def test_listing_after_a_name(storage):
    for name in ["a", "b", "c", "c.state"]:
        storage.write(f"_log/{name}.json", b"x")
    assert [e.rel for e in storage.list("_log", after="_log/b.json")] == ["_log/c.json", "_log/c.state.json"]
    assert [e.rel for e in storage.list("_log", after="_log/c.state.json")] == []


def test_the_retry_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "2.5")
    assert retry_config()["retry_timeout"].total_seconds() == 2.5
    monkeypatch.delenv(RETRY_ENV)
    assert retry_config()["retry_timeout"].total_seconds() == 20
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(RETRY_ENV, bad)
        with pytest.raises(ValueError, match=f"{RETRY_ENV}={bad}: expected a number of seconds > 0"):
            open_storage("s3://bucket/run")
