"""The round loop's background commits (pipelines/loop/steps.py `Publisher`, curation/stages/
runner.py `prepare_stage`): on a fresh round each curation stage hands its tables to the next
in memory and its commit is made by a background thread. The commits must be the ones
run_stage makes (run_stage afterwards finds every stage up to date, the deep run check
passes), the rows the same as committing stage by stage, a round with anything else in its
folders must take the stage-by-stage path, and a failed commit must fail the round."""

from __future__ import annotations

import shutil
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipelines.loop.steps as round_steps
from curation.generate.base import _load_prompts, load_prompts, remember_prompts
from curation.stages.runner import SLICE_ROWS_ENV, fresh_round, input_fingerprints, run_stage, stage_module
from curation.store.fingerprints import FileCache, file_stat, fingerprint_file
from curation.store.run_store import RunStore
from curation.store.runlog import MetricsLog
from curation.store.verify import check_run
from pipelines.loop.run import run_pipeline
from pipelines.loop.steps import Publisher
from pipelines.spec import load_spec
from tests.helpers import OPTIONS_SPEC  # 16 prompts x 4 a round, hf, grpo
from training.data import load_training_data

STAGES = ("score", "filter", "label")


@pytest.fixture(scope="module")
def loop_run(toy_dir, tmp_path_factory):
    """A 3-round loop run on the toy: (its folder, its spec, the stages the loop curated in
    memory, the same run with background_commits = false)."""
    base = tmp_path_factory.mktemp("background")
    spec_path = base / "spec.toml"
    spec_path.write_text(OPTIONS_SPEC.format(toy=toy_dir, rounds=3, checkpoint_every=2, eval_every=3, refill=""))
    prepared = []
    original = round_steps.prepare_stage

    def counting(*args, **kwargs):
        prepared.append(args[0])
        return original(*args, **kwargs)

    round_steps.prepare_stage = counting
    try:
        run_pipeline(load_spec(spec_path), base / "run", log=lambda message: None)
    finally:
        round_steps.prepare_stage = original
    spec = load_spec(spec_path)
    stage_by_stage = spec.model_copy(update={"run": spec.run.model_copy(update={"background_commits": False})})
    run_pipeline(stage_by_stage, base / "stage-by-stage", log=lambda message: None)
    return base / "run", spec, prepared, base / "stage-by-stage"


def test_background_commits_are_the_commits_run_stage_makes(loop_run):
    run, spec, prepared, _ = loop_run
    assert prepared == list(STAGES) * 3  # every round's curation went through the background path
    assert check_run(run, deep=True).pending == 0  # every file hashes to what its manifest says
    store = RunStore(run)
    with store.lock():
        for round in (1, 2, 3):
            for stage in STAGES:
                module = stage_module(stage)
                manifest = store.load_manifest(stage, round)
                own = (stage,) if set(module.READS) & set(module.WRITES) else ()
                assert manifest["inputs"] == input_fingerprints(store, module.READS, round, exclude_parts=own)
                assert run_stage(stage, run, round, getattr(spec, stage)).skipped, (stage, round)


def test_background_commits_hold_the_rows_of_stage_by_stage_commits(loop_run, tmp_path):
    """Round 2 curated again stage by stage (run_stage, force) from the same samples: the same rows."""
    run, spec, _, _ = loop_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    with RunStore(copy).lock():
        for stage in STAGES:
            run_stage(stage, copy, 2, getattr(spec, stage), force=True)
    for table in ("scores", "rejects", "groups"):
        for path in sorted((run / table / "round=2").glob("*.parquet")):
            got = pq.read_table(path).to_pylist()
            again = pq.read_table(copy / path.relative_to(run)).to_pylist()
            assert len(got) == len(again) > 0, path
            for a, b in zip(got, again):
                assert a.keys() == b.keys()
                for key in a:
                    assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-12) if isinstance(a[key], float) \
                        else a[key] == b[key], (path, key)


def _rows(path):
    return pq.read_table(path).to_pylist()


def _same(a, b, where):
    assert len(a) == len(b), where
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), where
        for key in x:
            if isinstance(x[key], float):
                assert x[key] == pytest.approx(y[key], rel=1e-12, abs=1e-12), (where, key)
            else:
                assert x[key] == y[key], (where, key)


def test_the_run_is_the_run_of_stage_by_stage_commits(loop_run):
    """Prompt choices, samples, curation tables, step records and round numbers are those of the
    same spec with background_commits = false (every stage committed before the next one reads it)."""
    run, _, _, stage_by_stage = loop_run
    files = sorted(path.relative_to(run) for table in ("samples", "scores", "rejects", "groups", "prompts")
                   for path in (run / table).rglob("*.parquet"))
    assert files and files == sorted(path.relative_to(stage_by_stage) for table in
                                     ("samples", "scores", "rejects", "groups", "prompts")
                                     for path in (stage_by_stage / table).rglob("*.parquet"))
    for rel in files:
        _same(_rows(run / rel), _rows(stage_by_stage / rel), rel)
    for round in (1, 2, 3):  # the prompt choice the commit thread made ahead (2, 3) is the one made in the round
        rel = f"_rounds/round={round}/prompts.parquet"
        assert _rows(run / rel) == _rows(stage_by_stage / rel), rel
    steps = [{k: v for k, v in step.items() if k not in ("seconds", "tokens_per_s")}
             for step in MetricsLog(run).steps()]
    again = [{k: v for k, v in step.items() if k not in ("seconds", "tokens_per_s")}
             for step in MetricsLog(stage_by_stage).steps()]
    assert len(steps) == 6
    _same(steps, again, "step records")
    keys = ("round", "samples", "groups", "kept_groups", "reward_mean", "policy_version", "eval_accuracy")
    ours, theirs = ([{k: r[k] for k in keys} for r in MetricsLog(folder).read()[0]] for folder in (run, stage_by_stage))
    assert len(ours) == 4 and ours == theirs  # rounds 0-3


def _held_samples(store: RunStore, round: int) -> dict:
    return {path.relative_to(store.root).as_posix(): ({"sha256": fingerprint_file(path), **file_stat(path)},
                                                      pq.read_table(path)) for path in store.files("samples", round)}


def test_only_a_round_with_nothing_but_the_held_samples_is_curated_in_the_background(loop_run, tmp_path, monkeypatch):
    run, _, _, _ = loop_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    store = RunStore(copy)
    assert not fresh_round(store, 3, STAGES, _held_samples(store, 3))  # curated already: run_stage decides
    for stage in STAGES:  # round 3 as the loop finds it after generate: the samples alone
        store.manifest_path(stage, 3).unlink()
    for table in ("scores", "rejects", "groups"):
        shutil.rmtree(copy / table / "round=3", ignore_errors=True)
    held = _held_samples(store, 3)
    assert fresh_round(store, 3, STAGES, held)
    assert not fresh_round(store, 3, STAGES, {})  # samples nobody handed over
    monkeypatch.setenv(SLICE_ROWS_ENV, "10")
    assert not fresh_round(store, 3, STAGES, held)  # a round taken in slices
    monkeypatch.delenv(SLICE_ROWS_ENV)
    foreign = copy / "scores" / "round=3" / "part-mine.parquet"
    foreign.parent.mkdir(parents=True)
    shutil.copy(run / "scores" / "round=3" / "part-score.parquet", foreign)
    assert not fresh_round(store, 3, STAGES, held)  # a part file of another writer
    foreign.unlink()
    store.pending_path("filter", 3).write_text('{"outputs": []}')
    assert not fresh_round(store, 3, STAGES, held)  # a filter commit killed while publishing


def test_a_failed_commit_fails_at_settle_and_the_later_ones_are_not_made():
    publisher = Publisher()
    made: list[str] = []
    gate = threading.Event()

    def first():
        gate.wait(5)
        raise OSError("No space left on device: scores/round=1")

    publisher.submit(first)
    publisher.submit(lambda: made.append("second") or {})
    gate.set()
    with pytest.raises(OSError, match="No space left"):
        publisher.settle()
    assert made == []  # its inputs were never published: not made
    publisher.submit(lambda: made.append("next round") or {"x": ({}, None)})
    assert publisher.settle() == {"x": ({}, None)}
    assert made == ["next round"]
    publisher.close()


def test_the_trainer_reads_a_round_whose_commits_are_in_flight(loop_run, tmp_path):
    """Round 3 as the trainer meets it in the loop: its samples and groups parts not written yet,
    held in memory (mtime_ns None; the samples part with the sampling its manifest will record):
    the same rows, fingerprint and sampling as from the committed files."""
    run, spec, _, _ = loop_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    store = RunStore(copy)
    held = {}
    for stage, table in (("generate", "samples"), ("label", "groups")):
        manifest = store.load_manifest(stage, 3)
        rel = next(rel for rel in manifest["outputs"] if rel.startswith(f"{table}/"))
        entry = {"sha256": manifest["output_files"][rel]["sha256"], "size": manifest["output_files"][rel]["size"],
                 "mtime_ns": None}
        if table == "samples":
            entry["sampling"] = manifest["config"]["sampling"]
        held[rel] = (entry, pq.read_table(copy / rel))
        (copy / rel).unlink()
        store.manifest_path(stage, 3).unlink()
    expected = load_training_data(run, "grpo", [2, 3], max_staleness=0)
    got = load_training_data(copy, "grpo", [2, 3], max_staleness=0, held=held)
    assert got.table.equals(expected.table)
    assert got.fingerprint == expected.fingerprint
    assert (got.rounds, got.temperature, got.top_k, got.top_p) == \
        (expected.rounds, expected.temperature, expected.top_k, expected.top_p) == ([3], 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="no groups table for round"):
        load_training_data(copy, "grpo", [2, 3])


def test_a_file_written_by_this_process_is_not_read_back(toy_dir, tmp_path):
    """FileCache.put keeps a value for a file as this process wrote it; a rewrite reads it
    again. remember_prompts gives what reading the file back gives."""
    path = tmp_path / "choice.parquet"
    pool = load_prompts(toy_dir / "train.parquet")
    chosen = pool.take(pa.array([4, 1, 9]))
    pq.write_table(chosen, path)
    remember_prompts(path, chosen)
    assert load_prompts(path).equals(_load_prompts(path), check_metadata=True)
    cache: FileCache[str] = FileCache()
    cache.put(path, file_stat(path), "kept")
    assert cache.get(path, lambda: "read") == "kept"
    pq.write_table(chosen.slice(0, 2), path)
    assert cache.get(path, lambda: "read") == "read"
