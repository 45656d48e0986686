"""Runs written without `_commits` (an older groupforge's run folder: its own commit log, or
older manifests; tables another tool wrote) read as their files say and are taken in by the
first writer (store/migrate.py, `groupforge migrate`); kills between a commit's steps
(`commit.files_published`, `commit.tables_written`) as real processes; and what `check_run` names."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from store.faults import FAULT_ENV
from store.run_log import COMMITS, RunLog
from store.run_store import RunStore
from store.schema import SCHEMAS
from store.storage import LocalStorage
from store.verify import RunFolderError, check_run
from tests.helpers import edit_commit_row, groupforge_in_process

REPO = Path(__file__).resolve().parents[2]


def samples(round: int, n_prompts: int = 2, tag: str = "") -> pa.Table:
    rows = [{"run_id": "r", "round": round, "prompt_id": f"p{p}", "sample_idx": i, "group_size": 2,
             "prompt_token_ids": [1, 2], "response": f"{tag}{p}-{i}", "response_token_ids": [4],
             "behavior_logprobs": [-0.5], "finish_reason": "stop", "policy_version": 0, "generator": "test",
             "seed": 7} for p in range(n_prompts) for i in range(2)]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["samples"])


def prompts(n_prompts: int = 2) -> pa.Table:
    ids = range(n_prompts)
    return pa.table({"prompt_id": [f"p{p}" for p in ids], "prompt": [f"{p}+{p}=" for p in ids],
                     "reference": [str(2 * p) for p in ids]})


def rejects(round: int, stage: str) -> pa.Table:
    return pa.Table.from_pylist([{"run_id": "r", "round": round, "prompt_id": "p0", "sample_idx": 1, "stage": stage,
                                  "reason": "too_long", "detail": None}], schema=SCHEMAS["rejects"])


def scores(round: int, n_prompts: int = 2) -> pa.Table:
    return pa.Table.from_pylist([{"run_id": "r", "round": round, "prompt_id": f"p{p}", "sample_idx": i,
                                  "reward": 1.0, "scorer": "{}"} for p in range(n_prompts) for i in range(2)],
                                schema=SCHEMAS["scores"])


def old_run(run: Path) -> dict[str, dict]:
    """A run folder as an older groupforge wrote it: parts named part-<stage>.parquet, one
    manifest per stage and round in RUN/_manifests/ (no commit log). Returns the manifests by name."""
    tables = {"samples/round=0/part-generate.parquet": samples(0),
              "samples/round=1/part-generate.parquet": samples(1, n_prompts=3),
              "prompts/part-generate.parquet": prompts(3),
              "rejects/round=0/part-generate.parquet": rejects(0, "generate"),
              "rejects/round=0/part-filter.parquet": rejects(0, "filter")}
    for rel, table in tables.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, run / rel)
    listed = {("generate", 0): ["prompts/part-generate.parquet", "rejects/round=0/part-generate.parquet",
                                "samples/round=0/part-generate.parquet"],
              ("generate", 1): ["prompts/part-generate.parquet", "samples/round=1/part-generate.parquet"],
              ("filter", 0): ["rejects/round=0/part-filter.parquet"]}
    manifests = {}
    (run / "_manifests").mkdir()
    for (stage, round), outputs in listed.items():
        manifest = {"stage": stage, "round": round, "inputs": {"prompts": "f" * 64}, "config": {},
                    "config_hash": hashlib.sha256(b"{}").hexdigest(), "outputs": outputs,
                    "output_rows": {rel: tables[rel].num_rows for rel in outputs},
                    "output_files": {rel: {"sha256": hashlib.sha256((run / rel).read_bytes()).hexdigest(),
                                           "size": (run / rel).stat().st_size,
                                           "mtime_ns": (run / rel).stat().st_mtime_ns} for rel in outputs},
                    "rows_in": 3, "rows_out": 4, "drops": {}, "created_at": "2024-01-01T00:00:00+00:00"}
        (run / "_manifests" / f"{stage}-round={round}.json").write_text(json.dumps(manifest))
        manifests[f"{stage}-round={round}"] = manifest
    return manifests


def folder_state(run: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under the run folder."""
    return {p.relative_to(run).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


def delta_rows(run: Path, table: str) -> int:
    return DeltaTable(str(run / table)).to_pyarrow_table().num_rows


def delta_matches(run: Path) -> None:
    """Each table's Delta log holds the rows the commit log does."""
    store = RunStore(run)
    for table in SCHEMAS:
        if store.files(table):
            got = DeltaTable(str(run / table)).to_pyarrow_table()
            assert sorted(got.to_pylist(), key=repr) == sorted(store.read(table).to_pylist(), key=repr), table


def kinds(run: Path) -> list[str]:
    return [f"{e.kind}:{e.stage}:{e.round}" if e.kind == "commit" else e.kind
            for e in RunLog(LocalStorage(run)).entries()]


def run_killed(code: str, run: Path, fault: str) -> subprocess.CompletedProcess:
    """`code` (which writes to the run at sys.argv[1]) in a new process, killed at `fault`."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(run)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), FAULT_ENV: fault})
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    return done


# ---- an older groupforge's run folder -------------------------------------------------------


def test_an_old_run_folder_reads_without_writing_and_the_first_commit_takes_it_in(tmp_path):
    run = tmp_path / "run"
    manifests = old_run(run)
    before = folder_state(run)

    store = RunStore(run)
    assert not store.logged
    assert store.files("samples") == ["samples/round=0/part-generate.parquet", "samples/round=1/part-generate.parquet"]
    assert store.read("samples").num_rows == 10 and store.read("prompts").num_rows == 3
    assert sorted(store.read("rejects")["stage"].to_pylist()) == ["filter", "generate"]
    assert store.load_manifest("generate", 0) == manifests["generate-round=0"]
    assert sorted(store.round_manifests(0)) == ["filter", "generate"]
    assert store.round_prompts(1) == ["prompts/part-generate.parquet"]
    assert store.is_up_to_date("generate", 1, {"prompts": "f" * 64}, {})
    rel = "samples/round=1/part-generate.parquet"
    assert store.file_record(rel).sha256 == manifests["generate-round=1"]["output_files"][rel]["sha256"]
    assert store.row_count(rel) == 6
    found = check_run(run)
    assert (found.manifests, found.files, found.orphans) == (3, 5, 0)
    snapshot = RunStore(run).snapshot()
    assert not snapshot.logged and snapshot.read("samples").num_rows == 10
    assert folder_state(run) == before  # reading wrote nothing: no log, no Delta table

    with store.commit("score", 0, {}, {}) as commit:  # the first writer takes the run in
        commit.write("scores", scores(0))
    assert store.logged
    assert kinds(run) == ["open", "commit:filter:0", "commit:generate:0", "commit:generate:1", "commit:score:0"]
    for rel, (size, mtime) in before.items():  # the old files stay as they were, and live
        assert (run / rel).stat().st_size == size and (run / rel).stat().st_mtime_ns == mtime
        if not rel.startswith("_manifests/"):
            assert rel in store.state.files
    later = RunStore(run)
    assert later.logged and later.load_manifest("generate", 0) == manifests["generate-round=0"]
    assert later.read("samples").num_rows == 10 and later.read("scores").num_rows == 4
    assert later.is_up_to_date("generate", 1, {"prompts": "f" * 64}, {})
    delta_matches(run)
    assert (check_run(run).manifests, check_run(run, deep=True).files) == (4, 6)

    # a rerun of an old stage replaces its old part like any other
    with later.commit("filter", 0, {}, {"again": True}) as commit:
        commit.write("rejects", rejects(0, "filter").slice(0, 0))
    assert (run / "rejects/round=0/part-filter.parquet").exists()  # retired: kept for earlier versions
    assert "rejects/round=0/part-filter.parquet" in later.state.retired
    assert later.files("rejects") == ["rejects/round=0/part-generate.parquet"]
    delta_matches(run)


def test_groupforge_migrate_takes_an_old_run_in_once(tmp_path):
    run = tmp_path / "run"
    old_run(run)

    def migrate() -> subprocess.CompletedProcess:
        done = groupforge_in_process("migrate", run)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    first = migrate()
    assert f"{run}: migrated: 3 manifests, 5 files live" in first.stdout
    assert kinds(run) == ["open", "commit:filter:0", "commit:generate:0", "commit:generate:1"]
    assert (run / "samples" / "_delta_log").is_dir()
    delta_matches(run)
    assert check_run(run).files == 5
    after = folder_state(run)
    second = migrate()
    assert f"{run}: already migrated: 3 manifests, 5 files live" in second.stdout
    assert folder_state(run) == after  # nothing written


def test_a_writer_killed_before_taking_an_old_run_in_leaves_it_as_it_was(tmp_path):
    """A job that opened the run (its "open" row written) and died before it took the old
    files in: readers still see the old run, and the next writer takes it in."""
    run = tmp_path / "run"
    manifests = old_run(run)
    RunLog(LocalStorage(run)).open()  # what the killed job left
    store = RunStore(run)
    assert store.read("samples").num_rows == 10 and store.load_manifest("filter", 0) == manifests["filter-round=0"]
    assert check_run(run).files == 5
    with store.lock():
        pass
    assert kinds(run) == ["open", "open", "commit:filter:0", "commit:generate:0", "commit:generate:1"]
    assert RunStore(run).read("samples").num_rows == 10
    delta_matches(run)


def test_hand_written_tables_are_taken_in_by_an_import_entry(tmp_path):
    run = tmp_path / "run"
    written = {"samples/round=0/data.parquet": samples(0), "samples/round=2/more.parquet": samples(2, n_prompts=1),
               "prompts/prompts.parquet": prompts()}
    for rel, table in written.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, run / rel)
    before = folder_state(run)
    store = RunStore(run)
    assert store.rounds("samples") == [0, 2] and store.read("samples").num_rows == 6
    assert store.load_manifest("generate", 0) is None and store.round_prompts(0) is None
    assert folder_state(run) == before

    with store.lock():
        pass
    [opened, entry] = RunLog(LocalStorage(run)).entries()
    assert (opened.kind, entry.kind, entry.stage) == ("open", "import", None)
    assert entry.manifest["outputs"] == sorted(written)
    for rel in written:
        data = (run / rel).read_bytes()
        assert entry.manifest["output_files"][rel] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        assert entry.manifest["output_rows"][rel] == written[rel].num_rows
        assert (run / rel).stat().st_mtime_ns == before[rel][1]
    later = RunStore(run)
    assert later.logged and later.read("samples").num_rows == 6 and later.read("prompts").num_rows == 2
    delta_matches(run)
    found = check_run(run, deep=True)
    assert (found.manifests, found.files, found.orphans) == (0, 3, 0)
    with later.commit("generate", 1, {}, {}) as commit:  # and the run goes on as any other
        commit.write("samples", samples(1))
    assert RunStore(run).read("samples").num_rows == 10 and kinds(run)[-1] == "commit:generate:1"


# ---- kills between a commit's steps ---------------------------------------------------------


KILLED = """
    import sys
    from tests.store.test_migrate import rejects, samples
    from store.run_store import RunStore
    with RunStore(sys.argv[1]).commit("generate", {round}, {{}}, {{"attempt": 2}}) as c:
        c.write("samples", samples({round}, n_prompts=3, tag="killed"))
        c.write("rejects", rejects({round}, "generate"))
"""


def test_a_kill_at_files_published_leaves_files_that_readers_ignore_and_the_next_writer_sweeps(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run)
    with store.commit("generate", 0, {}, {"attempt": 1}) as c:
        c.write("samples", samples(0, tag="first"))
    live = sorted(store.state.files)
    run_killed(KILLED.format(round=1), run, "commit.files_published:1")

    orphans = sorted(str(p.relative_to(run)) for table in SCHEMAS for p in (run / table).rglob("*.parquet")
                     if "_delta_log" not in p.parts and str(p.relative_to(run)) not in live)
    assert [p.split("/")[:2] for p in orphans] == [["rejects", "round=1"], ["samples", "round=1"]]
    assert check_run(run).orphans == 2
    for reader in (RunStore(run), RunStore(run).snapshot()):
        assert reader.rounds("samples") == [0] and reader.read("samples").num_rows == 4
        assert reader.read("rejects").num_rows == 0 and reader.load_manifest("generate", 1) is None
        assert not reader.is_up_to_date("generate", 1, {}, {"attempt": 2})
    assert delta_rows(run, "samples") == 4
    assert kinds(run) == ["open", "commit:generate:0"]  # the killed job wrote nothing to the log

    with RunStore(run).lock():  # the next writer
        pass
    assert not any((run / rel).exists() for rel in orphans)
    assert check_run(run).orphans == 0 and (run / live[0]).exists()
    assert RunStore(run).read("samples").num_rows == 4


def test_a_kill_at_tables_written_is_invisible_to_groupforge_and_restored_away_by_the_next_writer(tmp_path):
    """The commit's tables got their Delta versions; its row in `_commits` (the commit point)
    was not written: groupforge reads the run as before it, a Delta reader of one table sees
    the new version, and the next writer restores the tables to the versions the rows record."""
    run = tmp_path / "run"
    store = RunStore(run)
    with store.commit("generate", 0, {}, {"attempt": 1}) as c:
        c.write("samples", samples(0, tag="first"))
    first = {f"first{p}-{i}" for p in range(2) for i in range(2)}
    run_killed(KILLED.format(round=0), run, "commit.tables_written:1")

    after = RunStore(run)
    assert after.load_manifest("generate", 0)["config"] == {"attempt": 1}
    assert set(after.read("samples")["response"].to_pylist()) == first and after.read("rejects").num_rows == 0
    assert set(DeltaTable(str(run / "samples")).to_pyarrow_table()["response"].to_pylist()) == {
        f"killed{p}-{i}" for p in range(3) for i in range(2)}  # one table ahead of the run
    assert kinds(run) == ["open", "commit:generate:0", "open"]

    with RunStore(run).lock():  # the next writer restores the tables
        pass
    assert set(DeltaTable(str(run / "samples")).to_pyarrow_table()["response"].to_pylist()) == first
    assert delta_rows(run, "rejects") == 0
    delta_matches(run)
    found = check_run(run)
    assert (found.files, found.orphans) == (1, 0)  # the killed commit's files are swept


def test_a_kill_at_logged_leaves_a_whole_commit(tmp_path):
    """Killed after its row: the commit is made; only its staging folder is left, which the
    next commit of the stage and round removes."""
    run = tmp_path / "run"
    with RunStore(run).commit("generate", 0, {}, {"attempt": 1}) as c:
        c.write("samples", samples(0, tag="first"))
    run_killed(KILLED.format(round=0), run, "commit.logged:1")
    after = RunStore(run)
    assert after.load_manifest("generate", 0)["config"] == {"attempt": 2}
    assert set(after.read("samples")["response"].to_pylist()) == {f"killed{p}-{i}" for p in range(3) for i in range(2)}
    assert after.read("rejects").num_rows == 1
    delta_matches(run)
    assert (check_run(run).retired, check_run(run).orphans) == (1, 0)


# ---- what check_run names -------------------------------------------------------------------


@pytest.fixture
def committed(tmp_path) -> Path:
    run = tmp_path / "run"
    store = RunStore(run)
    for round in (0, 1):
        with store.commit("generate", round, {}, {}) as c:
            c.write("samples", samples(round))
    assert check_run(run, deep=True).files == 2
    return run


def test_check_run_names_a_foreign_parquet_file(committed):
    foreign = committed / "samples" / "round=0" / "part-x.parquet"
    pq.write_table(samples(0), foreign)
    with pytest.raises(RunFolderError, match=rf"{foreign}: a Parquet file in the samples table folder that the "
                                             "run's log does not list"):
        check_run(committed)
    assert RunStore(committed).read("samples").num_rows == 8  # readers leave it out


def test_check_run_names_a_truncated_or_changed_live_file(committed):
    rel = RunStore(committed).files("samples", 1)[0]
    data = (committed / rel).read_bytes()
    (committed / rel).write_bytes(data[:-10])
    with pytest.raises(RunFolderError, match=rf"{committed / rel}: {len(data) - 10:,} bytes, but its commit "
                                             rf"recorded {len(data):,}"):
        check_run(committed)
    (committed / rel).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other bytes
    assert check_run(committed).files == 2
    with pytest.raises(RunFolderError, match=rf"{committed / rel}: its sha256 differs"):
        check_run(committed, deep=True)
    (committed / rel).unlink()
    with pytest.raises(RunFolderError, match=rf"{committed / rel}: listed by the run's log but missing"):
        check_run(committed)


def test_check_run_names_an_edited_commit_row(committed):
    def rows_out(row):
        manifest = json.loads(row["manifest"])
        assert (row["kind"], manifest["round"]) == ("commit", 1)
        return {**row, "manifest": json.dumps({**manifest, "rows_out": 1000})}

    held = edit_commit_row(committed, 2, rows_out)  # the `_commits` file that holds row 2
    assert held.parent == committed / COMMITS and held.suffix == ".parquet"
    where = rf"{held}, row 2 \(the manifest of generate round 1\)"
    with pytest.raises(RunFolderError, match=rf"{where}: edited after its commit"):
        check_run(committed)
    edit_commit_row(committed, 2, lambda row: {**row, "manifest": json.dumps({**json.loads(row["manifest"]),
                                                                         "format_version": 99})})
    with pytest.raises(RunFolderError, match=rf"{where}: written by a newer groupforge \(run format 99"):
        check_run(committed)


def test_check_run_names_a_row_whose_manifest_is_not_json(committed):
    path = edit_commit_row(committed, 1, lambda row: {**row, "manifest": '{"stage": "gen'})
    with pytest.raises(RunFolderError, match=rf"{path}: row 1: its manifest is not JSON"):
        check_run(committed)


def test_check_run_names_an_old_manifest_from_a_newer_groupforge(tmp_path):
    run = tmp_path / "run"
    old_run(run)
    path = run / "_manifests" / "generate-round=1.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 99}))
    with pytest.raises(RunFolderError, match=rf"{path}: written by a newer groupforge \(run format 99"):
        check_run(run)
    assert not (run / COMMITS).exists()


def test_a_run_of_groupforge_s_own_commit_log_is_taken_in_with_its_delta_history(tmp_path):
    """tests/data/run-format2: a run written by groupforge's run format 2 (RUN/_log/ beside
    hand-written Delta logs): read as its log says, taken in by `groupforge migrate` (its Delta
    history kept, the old log removed), then written on like any run."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "data" / "run-format2", run)
    store = RunStore(run)
    assert not store.logged
    assert store.read("samples").num_rows == 10 and store.read("prompts").num_rows == 5
    assert store.read("scores").num_rows == 2  # the second score commit replaced the first
    assert sorted(store.read("rejects")["stage"].to_pylist()) == ["filter", "generate"]
    assert store.load_manifest("score", 0)["config"] == {"try": 2}
    versions_before = {t: DeltaTable(str(run / t)).version() for t in ("samples", "scores", "rejects", "prompts")}

    done = groupforge_in_process("migrate", run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{run}: migrated: 4 manifests, 7 files live" in done.stdout
    assert not (run / "_log").exists()
    assert kinds(run) == ["open", "commit:generate:0", "commit:score:0", "commit:filter:0", "commit:generate:1",
                          "import"]
    assert {t: DeltaTable(str(run / t)).version() for t in versions_before} == versions_before  # level already
    delta_matches(run)
    found = check_run(run, deep=True)
    assert (found.manifests, found.files, found.retired, found.orphans) == (4, 7, 1, 0)
    assert DeltaTable(str(run / "scores"), version=0).to_pyarrow_table().num_rows == 4  # its history kept
    later = RunStore(run)
    with later.commit("score", 1, {}, {}) as commit:
        commit.write("scores", scores(1, n_prompts=3))
    assert RunStore(run).read("scores").num_rows == 8
    delta_matches(run)
