"""curation/store/fingerprints.py: FileCache keeps a value while its file is unchanged."""

from __future__ import annotations

import os

from curation.store.fingerprints import FileCache


def test_file_cache_recomputes_only_when_the_file_changes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    calls = []
    cache: FileCache[str] = FileCache()

    def read() -> str:
        calls.append(1)
        return path.read_text()

    assert cache.get(path, read) == "one" and cache.get(path, read) == "one"
    assert len(calls) == 1
    path.write_text("two!")
    os.utime(path, ns=(1, 2))  # a new size and mtime_ns
    assert cache.get(path, read) == "two!" and len(calls) == 2


def test_file_cache_drops_the_oldest_past_its_bound(tmp_path):
    cache: FileCache[str] = FileCache(max_entries=2)
    paths = [tmp_path / f"{i}.txt" for i in range(3)]
    for p in paths:
        p.write_text(p.name)
        cache.get(p, p.read_text)
    recomputed = []
    cache.get(paths[0], lambda: recomputed.append(0) or "again")
    cache.get(paths[2], lambda: recomputed.append(2) or "again")
    assert recomputed == [0]  # the first file was dropped, the newest kept
