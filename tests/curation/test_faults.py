"""store/faults.py: GROUPFORGE_FAULT parsing and counting (the kills themselves: tests/faults/);
store/run_files.py's write_atomic removes the temporary files of killed writers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from store import faults
from store.storage import TEMP_PREFIX, write_atomic
from tests.helpers import REPO


def test_a_bad_fault_spec_names_the_points(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "train.step_logged:0")
    with pytest.raises(ValueError, match=r"is not <point>:<count>\[:raise\]; points: generate.chunk_staged"):
        faults.fault_point("train.step_logged")
    monkeypatch.setenv(faults.FAULT_ENV, "no.such_point:1")
    with pytest.raises(ValueError, match="'no.such_point:1'"):
        faults.fault_point("loop.eval")


def test_the_kill_comes_at_the_counted_pass():
    code = ("from store.faults import fault_point\n"
            "for i in range(5):\n    print(i, flush=True)\n    fault_point('loop.eval')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, faults.FAULT_ENV: "loop.reload:1,loop.eval:3"})
    assert done.returncode == -9 and done.stdout.split() == ["0", "1", "2"]


def test_a_raise_fault_raises_once_at_the_counted_pass(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "loop.eval:2:raise")
    monkeypatch.setattr(faults, "_passed", {})
    faults.fault_point("loop.eval")
    with pytest.raises(faults.InjectedFault, match="loop.eval"):
        faults.fault_point("loop.eval")
    faults.fault_point("loop.eval")  # a retry in the same process goes on


def test_write_atomic_removes_temps_of_dead_writers_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f"{TEMP_PREFIX}out.json.{dead}.abc12345"
    live = tmp_path / f"{TEMP_PREFIX}out.json.{os.getpid()}.abc12345"
    other = tmp_path / f"{TEMP_PREFIX}other.json.{dead}.abc12345"
    for path in (stale, live, other):
        path.write_text("partial")
    write_atomic(tmp_path / "out.json", "{}")
    assert not stale.exists() and live.exists() and other.exists()
    assert (tmp_path / "out.json").read_text() == "{}"
