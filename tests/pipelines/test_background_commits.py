"""The round loop's background commits (pipelines/round_steps.py `Publisher`, curation/stages/
runner.py `prepare_stage`): on a fresh round each curation stage hands its tables to the next
in memory and its commit is made by a background thread. The commits must be the ones
run_stage makes (run_stage afterwards finds every stage up to date, the deep run check
passes), the rows the same as committing stage by stage, a round with anything else in its
folders must take the stage-by-stage path, and a failed commit must fail the round."""

from __future__ import annotations

import shutil
import threading

import pyarrow.parquet as pq
import pytest

import pipelines.round_steps as round_steps
from curation.fingerprints import file_stat, fingerprint_file
from curation.stages.runner import SLICE_ROWS_ENV, fresh_round, input_fingerprints, run_stage, stage_module
from curation.store import RunStore
from curation.verify import check_run
from pipelines.round_steps import Publisher
from pipelines.run import run_pipeline
from pipelines.spec import load_spec

SPEC = """
[run]
name = "background"
rounds = 3
steps_per_round = 2
seed = 11
checkpoint_every = 2

[model]
path = "{toy}/model"

[prompts]
train = ["{toy}/train.parquet"]
eval = "{toy}/eval.parquet"
per_round = 16
eval_limit = 32

[generator]
backend = "hf"
group_size = 4
max_tokens = 6

[filter]
drop_duplicates = false

[train]
objective = "grpo"
batch_size = 32
token_budget = 256
lr = 1e-4

[eval]
every = 3
"""

STAGES = ("score", "filter", "label")


@pytest.fixture(scope="module")
def loop_run(toy_dir, tmp_path_factory):
    """A 3-round loop run on the toy: (its folder, its spec, how many stage commits the loop
    left to the background thread)."""
    base = tmp_path_factory.mktemp("background")
    spec_path = base / "spec.toml"
    spec_path.write_text(SPEC.format(toy=toy_dir))
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
    return base / "run", load_spec(spec_path), prepared


def test_background_commits_are_the_commits_run_stage_makes(loop_run):
    run, spec, prepared = loop_run
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
    run, spec, _ = loop_run
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


def _held_samples(store: RunStore, round: int) -> dict:
    return {path.relative_to(store.root).as_posix(): ({"sha256": fingerprint_file(path), **file_stat(path)},
                                                      pq.read_table(path)) for path in store.files("samples", round)}


def test_only_a_round_with_nothing_but_the_held_samples_is_curated_in_the_background(loop_run, tmp_path, monkeypatch):
    run, _, _ = loop_run
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
