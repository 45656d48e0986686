"""`groupforge curate|score|filter|label|pair|export` end to end on toy samples, in a subprocess."""

from __future__ import annotations

import duckdb
import pytest

from curation.store import RunStore
from tests.conftest import make_toy_run
from tests.pipelines.test_cli import error_line, groupforge


@pytest.fixture(scope="module")
def toy_run(toy_dir, tmp_path_factory):
    """Two rounds of toy samples (transformers backend: fast to start)."""
    return make_toy_run(toy_dir, tmp_path_factory.mktemp("curate"), "train", n_prompts=48, group_size=8, max_tokens=6)


def test_curate_defaults_cover_every_sample_then_rerun_is_noop(toy_run):
    proc = groupforge("curate", toy_run)
    assert proc.returncode == 0, proc.stderr
    assert "zero_variance" in proc.stdout or "duplicate" in proc.stdout  # the summary names drop reasons
    glob = lambda t: f"read_parquet('{toy_run}/{t}/**/*.parquet', union_by_name=true)"  # noqa: E731
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
    assert all(c > r for c, r in zip(pairs.column("chosen_reward").to_pylist(), pairs.column("rejected_reward").to_pylist()))

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


def test_readme_curation_config_is_valid(tmp_path):
    """The TOML example in README.md is a config the stages accept."""
    from pipelines.curate import load_curation_spec
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "readme.toml"
    path.write_text(block)
    spec = load_curation_spec(path)
    assert [r.name for r in spec.score.rewards] == ["exact_match", "overlong_penalty"]
    assert spec.filter.drop_duplicates and spec.pair.min_margin == 0.5
