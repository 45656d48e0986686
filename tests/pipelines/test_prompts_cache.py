"""pipelines/loop/prompts.py keeps what it learnt from earlier rounds between calls (each round
folder's prompt ids, the times used in pool order) and sorts only the first `per_round`
prompts. These tests change real samples files between calls and check that the choice is
the one a fresh process makes (the caches emptied), and that `first_in_order` is
`np.lexsort`'s order."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipelines.loop.prompts as prompts
from curation.generate.base import prompt_id_of
from curation.schema import SCHEMAS
from pipelines.loop.prompts import choose_prompts, first_in_order, ranked_prompts, times_used
from tests.helpers import PROMPTS, by_tiebreak, chosen, context, prompt_file, sampled


def fresh_ranking(ctx, round: int) -> list[str]:
    """The ranking a new process computes: every cache of the module emptied first."""
    prompts._FOLDERS.clear()
    prompts._USED.clear()
    prompts._POOLS.clear()
    return ranked_prompts(ctx, round).column("prompt").to_pylist()


def age(run_dir) -> None:
    """Date every file and folder of the run 10 s back: older than the module's racy window, so
    the next listing of each round folder is trusted and reused (the cached path is tested)."""
    for path in [run_dir, *run_dir.rglob("*")]:
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**10))


def reused(ctx, round: int) -> bool:
    """Whether ranking `round` again serves every earlier round folder from the cache."""
    before = dict(prompts._FOLDERS)
    ranked_prompts(ctx, round)
    return all(prompts._FOLDERS[key] is folder for key, folder in before.items())


def samples_part(texts: list[str], round: int) -> pa.Table:
    rows = [{"run_id": "choose", "round": round, "prompt_id": prompt_id_of(text, None), "sample_idx": 0,
             "group_size": 1, "prompt_token_ids": [1], "response": "r", "response_token_ids": [3],
             "behavior_logprobs": [-0.5], "finish_reason": "stop", "policy_version": 0, "generator": "test",
             "seed": 0} for text in texts]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["samples"])


def test_a_samples_part_rewritten_in_place_is_read_again(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=8)
    sampled(ctx.store, 1, PROMPTS[:10])
    age(ctx.run_dir)
    before = ranked_prompts(ctx, 3).column("prompt").to_pylist()
    assert reused(ctx, 3)
    assert times_used(ctx.store, 3) == {prompt_id_of(t, None): 1 for t in PROMPTS[:10]}
    part = ctx.store.files("samples", 1)[0]
    stat = os.stat(part)
    pq.write_table(samples_part(PROMPTS[10:], 1), part)  # same path, other prompts, same folder
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # even within one clock tick
    after = ranked_prompts(ctx, 3).column("prompt").to_pylist()
    assert after == fresh_ranking(ctx, 3) != before
    assert after[:10] == by_tiebreak(PROMPTS[:10], 0, 3)  # now the first 10 are the unused ones
    assert times_used(ctx.store, 3) == {prompt_id_of(t, None): 1 for t in PROMPTS[10:]}


def test_parts_added_to_and_removed_from_an_earlier_round_count(tmp_path):
    """A refill part committed to round 1 after a choice that read round 1, then removed."""
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=8)
    sampled(ctx.store, 1, PROMPTS[:6])
    sampled(ctx.store, 2, PROMPTS[:3])
    age(ctx.run_dir)
    first = ranked_prompts(ctx, 3).column("prompt").to_pylist()
    assert reused(ctx, 3)
    with ctx.store.commit("refill-1", 1, {}, {}) as commit:
        commit.write("samples", samples_part(PROMPTS[6:12], 1), part="refill-1")
    added = ranked_prompts(ctx, 3).column("prompt").to_pylist()
    assert added == fresh_ranking(ctx, 3) != first
    assert set(added[:8]) == set(PROMPTS[12:])
    age(ctx.run_dir)
    (ctx.store.partition_dir("samples", 1) / "part-refill-1.parquet").unlink()
    assert ranked_prompts(ctx, 3).column("prompt").to_pylist() == fresh_ranking(ctx, 3) == first


def test_rounds_asked_in_any_order_and_a_removed_round(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=8)
    for round, texts in ((1, PROMPTS[:8]), (2, PROMPTS[4:12]), (3, PROMPTS[:2])):
        sampled(ctx.store, round, texts)
    age(ctx.run_dir)
    orders = {}
    for round in (4, 2, 3, 1, 4, 2):
        got = ranked_prompts(ctx, round).column("prompt").to_pylist()
        assert got == fresh_ranking(ctx, round)
        orders.setdefault(round, got)
        assert got == orders[round] and reused(ctx, round)
    for part in ctx.store.files("samples", 2):
        part.unlink()
    ctx.store.partition_dir("samples", 2).rmdir()
    assert ranked_prompts(ctx, 4).column("prompt").to_pylist() == fresh_ranking(ctx, 4) != orders[4]


def test_a_resumed_run_in_a_new_process_chooses_the_same(tmp_path):
    """Rounds 1..6 chosen and sampled by one process; a second process (caches emptied) that
    resumes at round 4, after rounds 4..6 were removed, chooses rounds 4..6 the same."""
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=7)
    first = {}
    for round in range(1, 7):
        first[round] = chosen(choose_prompts(ctx, round))
        sampled(ctx.store, round, first[round])
        age(ctx.run_dir)
    for round in (4, 5, 6):
        for part in ctx.store.files("samples", round):
            part.unlink()
        ctx.store.partition_dir("samples", round).rmdir()
        (ctx.run_dir / "_rounds" / f"round={round}" / "prompts.parquet").unlink()
    fresh_ranking(ctx, 1)  # empties the caches: a new process
    for round in (4, 5, 6):
        assert chosen(choose_prompts(ctx, round)) == first[round]
        sampled(ctx.store, round, first[round])


@pytest.mark.parametrize("seed", range(20))
def test_first_in_order_is_lexsort_order(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 300))
    keys = [rng.integers(0, 3, size), rng.integers(0, 2, size).astype(bool),
            rng.integers(0, 4, size).astype(np.float64), rng.integers(0, 50, size).astype(np.uint64)]
    keys = keys[: int(rng.integers(1, 5))]
    full = np.lexsort(keys[::-1])
    for count in (0, 1, 2, size // 3, size - 1, size, size + 5):
        assert first_in_order(keys, count).tolist() == full[:count].tolist()
