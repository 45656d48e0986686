"""The installed distribution: its metadata in current form, the extras the README names, and
`groupforge --version`."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUPFORGE = str(Path(sys.executable).parent / "groupforge")


def test_license_is_an_spdx_string_with_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # a string, not the deprecated {text = ...} table
    for name in project["license-files"]:
        assert "Apache License" in (ROOT / name).read_text()
    meta = importlib.metadata.metadata("groupforge")
    assert meta["License-Expression"] == "Apache-2.0"


def test_the_extras_the_readme_names_exist():
    extras = set(importlib.metadata.metadata("groupforge").get_all("Provides-Extra"))
    assert {"cpu", "gpu", "ray", "dev", "bench", "lora", "trackers", "tensorboard", "mlflow", "trackio",
            "wandb", "dagster"} <= extras
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r'-e "\.\[([a-z,-]+)\]"', readme + (ROOT / "Makefile").read_text()))
    for group in named:
        assert set(group.split(",")) <= extras, group


def test_version_flag_prints_the_installed_version():
    proc = subprocess.run([GROUPFORGE, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"groupforge {importlib.metadata.version('groupforge')}"
