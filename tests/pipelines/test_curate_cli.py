"""`groupforge curate|score|filter|label|pair|export` end to end on toy samples, in this process;
pipelines/loop/curate.py's config loading and `curate()` on a hand-made run."""

from __future__ import annotations

import duckdb
import pytest

from pipelines.loop.curate import STAGES, CurationSpec, curate, load_curation_spec
from store.run_store import RunStore
from tests.helpers import REPO, error_line, hand_made_run, make_toy_run, parquet_sql
from tests.helpers import groupforge_in_process as groupforge


@pytest.fixture(scope="module")
def toy_run(toy_dir, tmp_path_factory):
    """Two rounds of toy samples (transformers backend: fast to start)."""
    return make_toy_run(toy_dir, tmp_path_factory.mktemp("curate"), "train", n_prompts=48, group_size=8, max_tokens=6)


def test_curate_defaults_cover_every_sample_then_rerun_is_noop(toy_run):
    proc = groupforge("curate", toy_run)
    assert proc.returncode == 0, proc.stderr
    assert "zero_variance" in proc.stdout or "duplicate" in proc.stdout  # the summary names drop reasons
    glob = lambda t: parquet_sql(toy_run, t)  # noqa: E731
    covered = duckdb.sql(f"""
        WITH ends AS (
            SELECT round, prompt_id, sample_idx FROM {glob('groups')}
            UNION ALL
            SELECT r.round, r.prompt_id, s.sample_idx FROM {glob('rejects')} r
            JOIN {glob('samples')} s ON s.round = r.round AND s.prompt_id = r.prompt_id
              AND (r.sample_idx IS NULL OR r.sample_idx = s.sample_idx))
        SELECT (SELECT count(*) FROM {glob('samples')}) AS samples, count(*) AS ends,
               count(DISTINCT (round, prompt_id, sample_idx)) AS distinct_ends FROM ends""").fetchall()[0]
    assert covered[0] == covered[1] == covered[2] == 2 * 48 * 8
    store = RunStore(toy_run)
    pairs = store.read("pairs")
    assert pairs.num_rows > 0
    chosen, rejected = pairs.column("chosen_reward").to_pylist(), pairs.column("rejected_reward").to_pylist()
    assert all(c > r for c, r in zip(chosen, rejected))

    mtimes = {p: p.stat().st_mtime_ns for p in toy_run.rglob("*.parquet")}
    again = groupforge("curate", toy_run)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in toy_run.rglob("*.parquet")} == mtimes

    out = toy_run.parent / "pref.parquet"
    exported = groupforge("export", toy_run, "--format", "preference", "--out", out)
    assert exported.returncode == 0, exported.stderr
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=str(out), split="train")
    assert ds.num_rows == pairs.num_rows and set(ds.column_names) >= {"prompt", "chosen", "rejected"}


def test_curate_bad_config_and_missing_round(toy_run, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[label]\nestimator_typo = 'grpo'\n")
    proc = groupforge("curate", toy_run, "--config", bad)
    assert proc.returncode == 2
    line = error_line(proc)
    assert "estimator_typo" in line and str(bad) in line
    proc = groupforge("score", toy_run, "--round", 7)
    assert proc.returncode == 2 and "no samples in round 7" in error_line(proc)
    typo = tmp_path / "typo.toml"
    typo.write_text("[filte]\ndrop_duplicates = false\n")
    proc = groupforge("curate", toy_run, "--config", typo)
    assert proc.returncode == 2 and "unknown section 'filte'" in error_line(proc) and str(typo) in error_line(proc)


def test_readme_curation_config_is_valid(tmp_path):
    """The TOML example in docs/guide-data.md is a config the stages accept."""
    readme = (REPO / "docs" / "guide-data.md").read_text()
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "readme.toml"
    path.write_text(block)
    spec = load_curation_spec(path)
    assert [r.name for r in spec.score.rewards] == ["exact_match", "overlong_penalty"]
    assert spec.filter.drop_duplicates and spec.pair.min_margin == 0.5


# ---- the config and curate() without a subprocess ---------------------------------------------


def test_unknown_sections_are_errors_naming_the_section_and_the_file(tmp_path):
    typo = tmp_path / "typo.toml"
    typo.write_text("[filter]\nmin_group_size = 3\n\n[filte]\ndrop_duplicates = false\n")
    with pytest.raises(ValueError, match="unknown section 'filte'; did you mean 'filter'") as error:
        load_curation_spec(typo)
    assert str(typo) in str(error.value)
    other = tmp_path / "other.toml"
    other.write_text("[xyz]\n")
    with pytest.raises(ValueError, match="unknown section 'xyz'; known sections: env, eval, export, filter"):
        load_curation_spec(other)
    # a whole pipeline spec is a curation config; [export] is a curation section
    spec = load_curation_spec(REPO / "pipelines" / "specs" / "toy-grpo.toml")
    assert isinstance(spec, CurationSpec)
    export = tmp_path / "export.toml"
    export.write_text("[export]\nformat = 'sft'\n")
    assert load_curation_spec(export).export.format == "sft"


def test_curate_runs_every_stage_of_every_round_once(tmp_path):
    run = hand_made_run(tmp_path / "run", rounds=(0, 1))
    reports = curate(run)
    assert [(r.stage, r.round, r.skipped) for r in reports] == [
        (stage, round, False) for round in (0, 1) for stage in ("score", "filter", "label", "pair")]
    by_stage = {r.stage: r for r in reports if r.round == 0}
    assert (by_stage["score"].rows_in, by_stage["score"].rows_out) == (12, 12)
    # duplicates first: p0 keeps one "4" (then too small), p1 drops its second "4", p2 its second and third "5"
    assert by_stage["filter"].drops == {"duplicate": 6, "group_too_small": 1}
    assert (by_stage["label"].rows_out, by_stage["pair"].rows_out) == (5, 2)
    assert (run / ".lock").exists()  # curate takes the run's writer lock
    assert all(r.skipped for r in curate(run, rounds=[0, 1]))

    config = tmp_path / "curation.toml"
    config.write_text("[filter]\ndrop_duplicates = false\n")
    again = curate(run, config, rounds=1)
    assert [(r.stage, r.skipped) for r in again] == [("score", True), ("filter", False), ("label", False),
                                                    ("pair", False)]
    assert again[1].drops == {"zero_variance": 4}  # p0: all right
    spec = CurationSpec.model_validate({"filter": {"drop_duplicates": False}, "pair": {"strategy": "all_pairs"}})
    assert [r.skipped for r in curate(run, spec, rounds=[1])] == [True, True, True, False]  # only pair changed
    assert all(not r.skipped for r in curate(run, spec, rounds=[1], force=True))
    with pytest.raises(ValueError, match="no samples in round 5"):
        curate(run, rounds=[5])


def test_curate_inspect_and_export_a_run_on_s3(s3_server, tmp_path):
    """The data commands take an object-store URL as they take a folder: curate writes the
    tables to the bucket, inspect reads them back, export writes the dataset locally."""
    from tests.helpers import groupforge_in_process

    url = f"s3://{s3_server.bucket()}/runs/hand-made"
    hand_made_run(url)
    done = groupforge_in_process("curate", url)
    assert done.returncode == 0, done.stderr
    local = hand_made_run(tmp_path / "local")
    assert groupforge_in_process("curate", local).returncode == 0
    for table in ("groups", "rejects", "pairs"):  # the same rows as the same job on a local folder
        assert RunStore(url).read(table).to_pylist() == RunStore(local).read(table).to_pylist(), table
    shown = groupforge_in_process("inspect", url)
    assert shown.returncode == 0 and "groups" in shown.stdout, shown.stderr
    exported = groupforge_in_process("export", url, "--out", tmp_path / "pairs")
    assert exported.returncode == 0, exported.stderr
    assert list((tmp_path / "pairs").glob("*.parquet")) and not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_every_table_reads_at_every_version_with_one_commit_per_stage_and_round(where, s3_server, tmp_path):
    """A curated run's tables are plain Delta tables: no `_log/`; each table's history holds one
    commit per (stage, round), with the stage, round and commit number; Polars, deltalake and
    DuckDB (through pyarrow) read every version of every table alike, locally and on S3."""
    import polars as pl
    from deltalake import DeltaTable

    from store.run_log import COMMITS, delta_location
    from tests.helpers import groupforge_in_process

    run = f"s3://{s3_server.bucket()}/runs/versions" if where == "s3" else tmp_path / "run"
    hand_made_run(run, rounds=(0, 1))
    done = groupforge_in_process("curate", run)
    assert done.returncode == 0, done.stderr
    storage = RunStore(run).storage
    assert not storage.list("_log") and storage.list(COMMITS)
    seen = {}
    for table in ("samples", "rejects", "prompts", "scores", "groups", "pairs"):
        uri, options = delta_location(storage, table)
        newest = DeltaTable(uri, storage_options=options)
        commits = [h["groupforge"] for h in newest.history() if "groupforge" in h]
        keys = [(c["stage"], c["round"]) for c in commits]
        assert len(keys) == len(set(keys)) and all(isinstance(c["seq"], int) for c in commits), (table, commits)
        seen[table] = set(keys)
        for version in range(newest.version() + 1):
            delta = DeltaTable(uri, version=version, storage_options=options)
            count = delta.to_pyarrow_table().num_rows
            polars = pl.scan_delta(uri, version=version, storage_options=options).select(pl.len()).collect().item()
            dataset = delta.to_pyarrow_dataset()  # noqa: F841 (DuckDB reads the Python variable)
            ddb = duckdb.sql("SELECT count(*) FROM dataset").fetchall()[0][0]
            assert count == polars == ddb, (table, version, count, polars, ddb)
    rows = [r for r in RunStore(run).log.entries() if r.kind == "commit"]
    for row in rows:  # each commit is a version of each table it wrote the round's files of
        for table in {rel.split("/", 1)[0] for rel in row.manifest["outputs"] if f"/round={row.round}/" in rel}:
            assert (row.stage, row.round) in seen[table], (row.stage, row.round, table)
    assert {(r.stage, r.round) for r in rows} == {(s, r) for s in ("generate", *STAGES) for r in (0, 1)}
    assert len({r.writer for r in rows if r.stage != "generate"}) == 1  # one curate job, one writer
