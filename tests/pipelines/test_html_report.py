"""The browsable report (pipelines/reports/html_page.py + report_page.html) of a real toy run, opened
in a real headless Chromium (the Debian package `make` installs): no console errors, the
accuracy curve drawn, and paging to round 2 shows that round's rows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, groupforge_in_process, parquet_sql

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """Two rounds of 48 prompts x 8 (two pages a round), then `groupforge report`."""
    run = tmp_path_factory.mktemp("html") / "run"
    spec = REPO / "pipelines" / "specs" / "toy-grpo.toml"
    args = ["run", spec, "--run-dir", run, "--set", "run.rounds=2", "--set", "prompts.per_round=48",
            "--set", "run.steps_per_round=1", "--set", "prompts.eval_limit=32", "--set", "eval.every=1"]
    done = groupforge_in_process(*args)
    assert done.returncode == 0, done.stderr
    again = groupforge_in_process("report", run)
    assert again.returncode == 0, again.stderr
    return run / "report"


def data(path: Path) -> dict:
    text = path.read_text()
    assert text.startswith("groupforge.load(") and text.endswith(");\n")
    return json.loads(text[len("groupforge.load("):-3])


def test_the_pages_hold_the_tables_rows(report):
    run = data(report / "data" / "run.js")
    assert [r["round"] for r in run["rounds"]] == [0, 1, 2]
    assert run["pages"]["2"] == {"pages": 2, "groups": 48, "shown": 48}
    page = data(report / "data" / "round-2-1.js")
    assert page["round"] == 2 and len(page["groups"]) == 8  # 48 groups: 40 on page 0, 8 on page 1
    import duckdb

    count = duckdb.sql(f"SELECT count(*) FROM {parquet_sql(report.parent, 'samples', [2])}").fetchall()[0][0]
    shown = sum(len(g["responses"]) for p in (0, 1) for g in data(report / "data" / f"round-2-{p}.js")["groups"])
    assert shown == count == 48 * 8
    statuses = {r["status"] for p in (0, 1) for g in data(report / "data" / f"round-2-{p}.js")["groups"]
                for r in g["responses"]}
    assert "kept" in statuses and any(s.startswith("rejected: zero_variance") for s in statuses)


def browse(index: Path, fragment: str) -> tuple[str, str]:
    """(the DOM after the page's scripts ran, Chromium's log) for index.html#fragment."""
    assert CHROMIUM, "no chromium on PATH: `make install` installs the Debian package (as root)"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=10000", "--dump-dom", f"{index.as_uri()}#{fragment}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def test_chromium_shows_the_curve_and_pages_to_round_2(report):
    dom, log = browse(report / "index.html", "round=2&page=1")
    console = [line for line in log.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if re.search(r"Uncaught|Error|error", line)], console
    assert re.search(r'<path id="accuracy-line" d="M[\d.]+,[\d.]+ L', dom)  # three evals: a line
    assert re.search(r'<p id="error"[^>]*hidden', dom)  # every data file loaded
    assert 'data-round="2"' in dom and "page 2 of 2, 48 groups" in dom
    assert dom.count('class="group"') == 8
    first = data(report / "data" / "round-2-1.js")["groups"][0]["prompt"]
    assert first in dom
    dom0, _ = browse(report / "index.html", "")  # no fragment: the first round, page 1
    assert 'data-round="1"' in dom0 and dom0.count('class="group"') == 40
