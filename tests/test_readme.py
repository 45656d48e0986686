"""README's Python example runs as written, using only `import groupforge`, and
`import groupforge` itself stays light."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tests.helpers import logged_files

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- readme-example -->"


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    assert MARKER in text, f"README.md has no {MARKER} block"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block, f"no ```python block after {MARKER}"
    return block[1]


def test_example_imports_only_groupforge():
    imports = re.findall(r"^(?:from (\S+) import|import (\S+))", readme_example(), re.M)
    modules = {a or b for a, b in imports}
    assert "groupforge" in modules
    # polars only prepares the input file; nothing reaches into store/curation/training/pipelines
    assert not {m for m in modules if m.split(".")[0] in {"store", "curation", "training", "pipelines"}}


def test_readme_example_runs(toy_dir: Path, tmp_path: Path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "toy").symlink_to(toy_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", readme_example()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "my-run"
    assert (run / "checkpoints" / "step-2" / "model.safetensors").is_file()
    # round 2 was sampled by the trained weights: policy_version 2, and 64 prompts x 8
    [part] = logged_files(run, "samples", [2])
    samples = pq.read_table(part)
    assert samples.num_rows == 64 * 8
    assert set(samples.column("policy_version").to_pylist()) == {2}
    n_groups = int(done.stdout.strip().splitlines()[-1].split()[0])  # the example's own line comes last
    assert 0 < n_groups <= 64 * 8


def test_front_door_is_light_and_complete():
    code = ("import sys, groupforge; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'; "
            "names = [n for n in groupforge.__all__ if n != '__version__']; "
            "[getattr(groupforge, n) for n in names]; print(groupforge.__version__, len(names))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    version, count = done.stdout.split()
    assert version[0].isdigit() and int(count) == 12


def test_all_lists_every_export():
    """Every name of __all__ resolves to the object of the module that owns it, and the front
    door offers no name __all__ does not list."""
    import importlib

    import groupforge

    for name in groupforge.__all__[1:]:
        value = getattr(groupforge, name)
        assert getattr(importlib.import_module(value.__module__), name) is value, name
    owners = ("store", "curation", "training", "pipelines")
    offered = {name for name in dir(groupforge) if not name.startswith("_")
               and str(getattr(getattr(groupforge, name), "__module__", "")).split(".")[0] in owners}
    assert offered == set(groupforge.__all__[1:])
