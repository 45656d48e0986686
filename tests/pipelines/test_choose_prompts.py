"""pipelines/loop/prompts.py `choose_prompts` with the default strategy (least_used): which prompts a
round samples, on real prompt files and a real RunStore with small hand-built samples tables (no
model, no engine). The informative strategy: tests/pipelines/test_prompts.py."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from curation.generate.base import prompt_id_of
from pipelines.loop.prompts import choose_prompts, prompt_keys, tiebreak
from store.run_files import load_pipeline_state, round_prompts_rel, save_pipeline_state
from tests.helpers import PROMPTS, by_tiebreak, chosen, context, prompt_file, sampled, sha64, splitmix64


def test_tiebreak_matches_the_reference_and_changes_with_round_and_seed():
    ids = [prompt_id_of(t, None) for t in PROMPTS]
    h = tiebreak(0, 3, prompt_keys(ids))
    assert h.tolist() == [splitmix64(sha64(i) ^ sha64("0:3")) for i in ids]
    assert len(set(h.tolist())) == len(ids)
    assert np.argsort(h).tolist() != np.argsort(tiebreak(0, 4, prompt_keys(ids))).tolist()
    assert np.argsort(h).tolist() != np.argsort(tiebreak(1, 3, prompt_keys(ids))).tolist()


def test_least_used_prompts_first(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=8)
    used_twice, used_once = PROMPTS[:6], PROMPTS[6:16]
    sampled(ctx.store, 1, used_twice + used_once)
    sampled(ctx.store, 2, used_twice)
    # Round 3: the 4 never-used prompts, then 4 of the 10 used once (the seeded order), none used twice.
    assert chosen(choose_prompts(ctx, 3)) == by_tiebreak(PROMPTS[16:], 0, 3) + by_tiebreak(used_once, 0, 3)[:4]


def test_only_earlier_rounds_count_as_used(tmp_path):
    """Samples of this round or a later one (a rerun after a kill) do not change the choice."""
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=5)
    sampled(ctx.store, 1, PROMPTS[:10])
    sampled(ctx.store, 2, PROMPTS[10:])
    assert chosen(choose_prompts(ctx, 1)) == by_tiebreak(PROMPTS, 0, 1)[:5]


def test_tiebreak_is_seeded(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    first = chosen(choose_prompts(context(tmp_path / "a", [train], per_round=5, seed=1), 1))
    again = chosen(choose_prompts(context(tmp_path / "b", [train], per_round=5, seed=1), 1))
    other = chosen(choose_prompts(context(tmp_path / "c", [train], per_round=5, seed=2), 1))
    assert first == again == by_tiebreak(PROMPTS, 1, 1)[:5]
    assert other == by_tiebreak(PROMPTS, 2, 1)[:5] and other != first


def test_prompts_of_a_newly_added_file_first(tmp_path):
    old = prompt_file(tmp_path / "old.parquet", PROMPTS[:10])
    new = prompt_file(tmp_path / "new.parquet", PROMPTS[10:13])
    ctx = context(tmp_path / "run", [old], per_round=4)
    choose_prompts(ctx, 1)
    assert load_pipeline_state(ctx.location.storage)["prompt_files"] == [str(old)]

    ctx = context(tmp_path / "run", [old, new], per_round=4)  # a scheduled refresh adds a file
    round2 = chosen(choose_prompts(ctx, 2))
    # Every prompt is unused (no samples yet): the new file's 3 come first, then the seeded order.
    assert round2 == by_tiebreak(PROMPTS[10:13], 0, 2) + by_tiebreak(PROMPTS[:10], 0, 2)[:1]
    assert load_pipeline_state(ctx.location.storage)["prompt_files"] == sorted([str(old), str(new)])


def test_on_a_new_run_no_file_counts_as_new(tmp_path):
    files = [prompt_file(tmp_path / "a.parquet", PROMPTS[:10]), prompt_file(tmp_path / "b.parquet", PROMPTS[10:])]
    assert chosen(choose_prompts(context(tmp_path / "run", files, per_round=6), 1)) == by_tiebreak(PROMPTS, 0, 1)[:6]


def test_the_choice_is_written_once_and_reused(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    run_dir = tmp_path / "run"
    path = choose_prompts(context(run_dir, [train], per_round=5), 1)
    assert path == run_dir / round_prompts_rel(1) == run_dir / "_rounds" / "round=1" / "prompts.parquet"
    assert sorted(p.name for p in path.parent.iterdir()) == ["prompts.parquet"]  # no temporary file left
    first, written = chosen(path), path.stat().st_mtime_ns
    state = load_pipeline_state(run_dir)
    # A resumed run with another seed and size still samples what the killed one chose.
    assert choose_prompts(context(run_dir, [train], per_round=9, seed=7), 1) == path
    assert chosen(path) == first and path.stat().st_mtime_ns == written
    assert load_pipeline_state(run_dir) == state


def test_per_round_larger_than_the_pool_takes_every_prompt_once(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS[:7])
    ctx = context(tmp_path / "run", [train], per_round=50)
    sampled(ctx.store, 1, PROMPTS[:3])
    assert chosen(choose_prompts(ctx, 2)) == by_tiebreak(PROMPTS[3:7], 0, 2) + by_tiebreak(PROMPTS[:3], 0, 2)


def test_a_prompt_in_two_files_is_chosen_once(tmp_path):
    """The same prompt (same prompt_id) in an old and a new file: kept once, as its first
    occurrence, so it does not count as new."""
    old = prompt_file(tmp_path / "old.parquet", ["a", "b"])
    new = prompt_file(tmp_path / "new.parquet", ["b", "c"])
    save_pipeline_state(tmp_path / "run", {"prompt_files": [str(old)]})
    table = pq.read_table(choose_prompts(context(tmp_path / "run", [old, new], per_round=10), 1))
    assert table.column("prompt").to_pylist() == ["c"] + by_tiebreak(["a", "b"], 0, 1)
    assert table.column("prompt_id").to_pylist() == [prompt_id_of(t, None) for t in table.column("prompt").to_pylist()]
