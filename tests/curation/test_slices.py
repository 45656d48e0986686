"""A round larger than GROUPFORGE_SLICE_ROWS runs through each stage a slice of groups at a
time (curation/stages/runner.py, "Memory"): the same rows as the whole-round path, one part
file per slice in one commit, counts summed, reruns up to date."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from curation.stages.label import LabelConfig
from curation.stages.runner import CURATION_STAGES, SLICE_ROWS_ENV, run_stage, slice_of, slice_rows
from store.fingerprints import fingerprint_file
from store.layout import part_name
from store.run_store import HeldPart, RunStore
from store.schema import SCHEMAS
from store.verify import check_run

BENCH = Path(__file__).resolve().parents[2] / "bench" / "curation.py"
TABLES = {"scores": "reward", "rejects": "reason", "groups": "advantage", "pairs": "soft_label"}


def bench_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_curation", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def curate(run: Path, cfgs) -> dict[str, dict]:
    """Every stage on round 0; {stage: its manifest}."""
    with RunStore(run).lock():
        for name, cfg in zip(CURATION_STAGES, cfgs):
            run_stage(name, run, 0, cfg)
    return {name: RunStore(run).load_manifest(name, 0) for name in CURATION_STAGES}


def rows(run: Path, table: str) -> list[tuple]:
    """Every row of a table (independent reader: DuckDB over its live Parquet files), sorted."""
    files = [str(run / rel) for rel in RunStore(run).files(table)]
    return sorted(duckdb.sql(f"SELECT * EXCLUDE (detail) FROM read_parquet({files})" if table == "rejects"
                             else f"SELECT * FROM read_parquet({files})").fetchall(), key=repr)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same synthetic round of 3,200 samples (400 groups), curated whole and in slices of 700
    rows (K = 5): (whole, sliced, their manifests, the configs)."""
    mp = pytest.MonkeyPatch()
    bench = bench_module(mp)
    base = tmp_path_factory.mktemp("slices")
    whole, sliced = base / "whole", base / "sliced"
    bench.make_run(whole, 3200, seed=5)
    shutil.copytree(whole, sliced)
    cfgs = bench.configs(drop_duplicates=True)
    manifests_whole = curate(whole, cfgs)
    mp.setenv(SLICE_ROWS_ENV, "700")
    manifests_sliced = curate(sliced, cfgs)
    mp.undo()
    return whole, sliced, manifests_whole, manifests_sliced, cfgs


def test_sliced_stages_write_the_rows_the_whole_round_gives(two_runs):
    whole, sliced, *_ = two_runs
    for table in TABLES:
        got, expected = rows(sliced, table), rows(whole, table)
        assert got == expected, table
        assert len(expected) > 0, table


def test_each_slice_is_a_part_file_of_one_commit_with_summed_counts(two_runs):
    whole, sliced, manifests_whole, manifests_sliced, _ = two_runs
    for name in CURATION_STAGES:
        got, expected = manifests_sliced[name], manifests_whole[name]
        assert got["slices"] == (5 if name != "pair" else 3), name  # pair's input: the kept groups' rows
        assert (got["rows_in"], got["rows_out"], got["drops"]) == (expected["rows_in"], expected["rows_out"],
                                                                  expected["drops"]), name
        parts = {Path(rel).name for rel in got["outputs"]}
        assert all(part.startswith(f"part-{name}-s") for part in parts), parts
    assert manifests_sliced["label"]["rows_in_kept_groups"] == manifests_whole["label"]["rows_in_kept_groups"]
    score = manifests_sliced["score"]
    assert score["scorer"] == manifests_whole["score"]["scorer"]
    assert score["reward_columns"]["exact_match"]["computed"] == 3200
    # every group lands whole in one slice: no prompt_id in two groups parts
    files = [str(sliced / rel) for rel in manifests_sliced["label"]["outputs"]]
    split = duckdb.sql(f"SELECT prompt_id FROM read_parquet({files}, filename = true) GROUP BY prompt_id "
                       "HAVING count(DISTINCT filename) > 1").fetchall()
    assert split == []


def test_a_sliced_round_reruns_up_to_date_and_back_to_whole(two_runs, monkeypatch, tmp_path):
    _, sliced, _, _, cfgs = two_runs
    run = tmp_path / "run"
    shutil.copytree(sliced, run)
    monkeypatch.setenv(SLICE_ROWS_ENV, "700")
    with RunStore(run).lock():
        assert all(run_stage(name, run, 0, cfg).skipped for name, cfg in zip(CURATION_STAGES, cfgs))
    expected = rows(sliced, "groups")
    monkeypatch.delenv(SLICE_ROWS_ENV)
    with RunStore(run).lock():
        report = run_stage("label", run, 0, cfgs[2], force=True)
    assert not report.skipped
    [part] = RunStore(run).files("groups", 0)  # the slices retired: out of the live files
    assert part_name(part) == "label" and len(list((run / "groups" / "round=0").iterdir())) > 1
    assert rows(run, "groups") == expected


def test_the_filter_stage_sliced_ignores_its_own_slices(two_runs, monkeypatch, tmp_path):
    """filter reads rejects but not its own parts: with its slices in place, a forced rerun
    gives the same rejects (none counted twice)."""
    _, sliced, _, manifests, cfgs = two_runs
    run = tmp_path / "run"
    shutil.copytree(sliced, run)
    monkeypatch.setenv(SLICE_ROWS_ENV, "700")
    with RunStore(run).lock():
        report = run_stage("filter", run, 0, cfgs[1], force=True)
    assert report.drops == manifests["filter"]["drops"]
    assert rows(run, "rejects") == rows(sliced, "rejects")


def test_label_batch_estimator_reads_the_round_whole(two_runs, monkeypatch, tmp_path):
    _, sliced, *_ = two_runs
    run = tmp_path / "run"
    shutil.copytree(sliced, run)
    monkeypatch.setenv(SLICE_ROWS_ENV, "700")
    with RunStore(run).lock():
        run_stage("label", run, 0, LabelConfig(estimator="batch"))
    manifest = RunStore(run).load_manifest("label", 0)
    assert "slices" not in manifest
    assert [part_name(rel) for rel in manifest["outputs"]] == ["label"]
    assert manifest["outputs"] == RunStore(run).files("groups", 0)


def test_slice_rows_setting_and_the_slice_of_an_id(monkeypatch):
    monkeypatch.setenv(SLICE_ROWS_ENV, "12x")
    with pytest.raises(ValueError, match="GROUPFORGE_SLICE_ROWS='12x'"):
        slice_rows()
    monkeypatch.setenv(SLICE_ROWS_ENV, "5")
    assert slice_rows() == 5
    import pyarrow as pa

    ids = pa.array([f"p{i % 50}" for i in range(200)])
    slices = slice_of(ids, 3)
    assert set(slices.tolist()) == {0, 1, 2}  # 50 ids spread over the 3 slices
    assert (slices[:50] == slices[50:100]).all()  # equal ids, same slice


KILLED_CURATE = """
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.curation.test_slices import bench_module, curate
import pytest
curate(Path({run!r}), bench_module(pytest.MonkeyPatch()).configs(drop_duplicates=True))
"""


UNCURATED = ("_log", "_delta_log", "scores", "rejects", "groups", "pairs")
"""Left out of a copy of a curated run: the run as bench.make_run wrote it (round 0's samples
and prompts, no commit log)."""


@pytest.mark.parametrize("point", ["stage.before_commit:1", "commit.files_published:2"])
def test_a_sliced_round_killed_mid_commit_resumes_to_the_same_rows(two_runs, tmp_path, point):
    """SIGKILL with score's slice parts written and its commit not begun, or with filter's
    slice parts written and no log entry; the rerun gives the whole-round rows and leaves no file of the
    killed commit."""
    whole, *_ = two_runs
    run = tmp_path / "run"  # round 0 as bench.make_run writes it (no commit log)
    shutil.copytree(whole, run, ignore=shutil.ignore_patterns(*UNCURATED))
    script = KILLED_CURATE.format(root=str(Path(__file__).resolve().parents[2]), run=str(run))
    env = {**os.environ, SLICE_ROWS_ENV: "700", "GROUPFORGE_FAULT": point}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert check_run(run).orphans == 5  # the killed stage's slice parts (score's, filter's), listed by no entry
    env.pop("GROUPFORGE_FAULT")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for table in TABLES:
        assert rows(run, table) == rows(whole, table), table
    assert check_run(run).orphans == 0
    store = RunStore(run)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*.parquet")
                  if "_delta_log" not in p.parts and "_commits" not in p.parts) == \
        sorted(rel for table in SCHEMAS for rel in store.files(table))


def test_stages_fed_held_tables_slice_the_round_as_from_the_files(two_runs, monkeypatch, tmp_path):
    """The round loop hands each stage the tables the one before committed (`held`); the slice
    count then comes from those tables' rows, not the files' footers: the same slices, rows and counts."""
    whole, _, _, manifests_sliced, cfgs = two_runs
    run = tmp_path / "held"
    shutil.copytree(whole, run, ignore=shutil.ignore_patterns(*UNCURATED))
    monkeypatch.setenv(SLICE_ROWS_ENV, "700")
    store = RunStore(run, hold=True)
    store.held.update({rel: HeldPart(fingerprint_file(run / rel), pq.read_table(run / rel))
                       for rel in store.files("samples", 0)})
    assert store.held
    with store.lock():
        for name, cfg in zip(CURATION_STAGES, cfgs):
            run_stage(name, store, 0, cfg)
    for name in CURATION_STAGES:
        manifest = RunStore(run).load_manifest(name, 0)
        assert manifest["slices"] == manifests_sliced[name]["slices"], name
        assert manifest["rows_out"] == manifests_sliced[name]["rows_out"], name
    for table in TABLES:
        assert rows(run, table) == rows(whole, table), table
