"""pipelines/loop/curriculum.py: the per-prompt history (its prompt_stats rows checked against an
independent DuckDB count over the scores tables), the rested and unsolved rules, and prompt
choice under `[prompts] curriculum`. The loop killed and resumed with the curriculum on:
tests/pipelines/test_curriculum_run.py."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from curation.generate.base import prompt_id_of
from pipelines.loop.curriculum import STAGE, PromptHistory, PromptStat, curriculum_rules, record_history
from pipelines.loop.prompts import PromptChoice, choose_prompts, ranked_prompts
from pipelines.loop.run import RoundContext
from pipelines.spec import PipelineSpec
from store.run_store import RunStore
from store.schema import SCHEMAS
from tests.helpers import PROMPT_STATS_SQL, PROMPTS, chosen, prompt_file, sampled


def scored(store: RunStore, round: int, rewards: dict[str, list[float | None]]) -> None:
    """A scores table for `round`: one row per reward of each prompt text."""
    rows = [{"run_id": "cur", "round": round, "prompt_id": prompt_id_of(text, None), "sample_idx": i,
             "reward": reward, "scorer": "{}"}
            for text, values in rewards.items() for i, reward in enumerate(values)]
    with store.commit("score", round, {}, {}) as commit:
        commit.write("scores", pa.Table.from_pylist(rows, schema=SCHEMAS["scores"]))


def round_of(store: RunStore, round: int, rewards: dict[str, list[float | None]]) -> None:
    """Round `round` sampled `rewards`' prompts (samples) and scored them so."""
    sampled(store, round, list(rewards), group_size=max(len(v) for v in rewards.values()))
    scored(store, round, rewards)


def context(run_dir: Path, train: Path, per_round: int, curriculum: bool = True, **choice) -> RoundContext:
    spec = PipelineSpec.model_validate({
        "run": {"name": "cur", "seed": 0}, "model": {"path": "unused"},
        "prompts": {"train": [str(train)], "eval": "unused.parquet", "per_round": per_round,
                    "curriculum": curriculum, "choice": choice}})
    return RoundContext(spec=spec, store=RunStore(run_dir))


def test_prompt_stats_rows_match_an_independent_count_of_the_scores(tmp_path):
    ctx = context(tmp_path / "run", prompt_file(tmp_path / "p.parquet", PROMPTS[:6]), per_round=4, window=2)
    a, b, c, d = PROMPTS[:4]
    history = [
        {a: [1.0, 1.0], b: [0.0, 0.0], c: [1.0, 0.0]},
        {a: [1.0, 1.0], d: [None, 0.0]},          # a null reward is no sample of the rate
        {a: [0.0, 1.0], b: [0.0, 0.0], d: [1.0, 1.0]},
        {a: [1.0, 1.0], b: [0.5, 0.0], c: [None, None]},  # 0.5 < pass_reward: no pass
    ]
    for round, rewards in enumerate(history, start=1):
        round_of(ctx.store, round, rewards)
        record_history(ctx, round)
    record_history(ctx, 4)  # up to date: no second commit
    assert [m["round"] for m in ctx.store.state.manifests.values() if m["stage"] == STAGE] == [1, 2, 3, 4]

    table = ctx.store.read(STAGE)
    scores = ctx.store.read("scores")  # noqa: F841 (read by the SQL)
    expected = duckdb.sql(PROMPT_STATS_SQL).fetchall()
    got = table.select(["prompt_id", "round", "rounds_seen", "samples", "passes", "recent_samples",
                        "recent_passes"]).to_pylist()
    assert [tuple(row.values()) for row in got] == expected
    rates = {(r["prompt_id"], r["round"]): r["pass_rate"] for r in table.to_pylist()}
    pid = {text: prompt_id_of(text, None) for text in (a, b, c, d)}
    assert rates[(pid[a], 3)] == 3 / 4 and rates[(pid[a], 4)] == 3 / 4  # rounds 2-3, then 3-4
    assert rates[(pid[d], 2)] == 0.0 and rates[(pid[d], 3)] == 2 / 3
    assert rates[(pid[c], 4)] == 1 / 2  # round 4's nulls add no sample: round 1's two remain
    assert set(table.column("run_id").to_pylist()) == {"cur"}

    # The history rebuilt from the tables (a resumed run) is the one kept round by round.
    assert PromptHistory().through(ctx.store, 5, 2, 1.0) == ctx.prompts.history.through(ctx.store, 5, 2, 1.0)


def test_no_prompt_stats_without_the_curriculum(tmp_path):
    ctx = context(tmp_path / "run", prompt_file(tmp_path / "p.parquet", PROMPTS[:4]), per_round=2,
                  curriculum=False)
    round_of(ctx.store, 1, {PROMPTS[0]: [1.0, 0.0]})
    record_history(ctx, 1)
    assert ctx.store.files(STAGE) == []


def test_rested_and_unsolved_rules():
    choice = PromptChoice(solved=0.9, unsolved_visits=2, unsolved_weight=0.25)
    stats = {
        "solved": PromptStat(rounds_seen=3, samples=12, passes=11, last_round=5, recent=((4, 4), (4, 4))),
        "nearly": PromptStat(rounds_seen=2, samples=8, passes=7, last_round=5, recent=((4, 3), (4, 4))),
        "never": PromptStat(rounds_seen=2, samples=8, passes=0, last_round=4, recent=((4, 0), (4, 0))),
        "once": PromptStat(rounds_seen=1, samples=4, passes=0, last_round=4, recent=((4, 0),)),
        "unscored": PromptStat(rounds_seen=1, samples=0, passes=0, last_round=5, recent=((0, 0),)),
    }
    ids = ["solved", "nearly", "never", "once", "unscored", "unseen"]
    rested, weight = curriculum_rules(stats, ids, round=6, choice=choice, rest_rounds=3)
    assert rested.tolist() == [1, 0, 0, 0, 0, 0]          # 7/8 < 0.9; no pass rate, no rest
    assert weight.tolist() == [1.0, 1.0, 0.25, 1.0, 1.0, 1.0]  # unsolved after 2 rounds, not after 1
    assert curriculum_rules(stats, ids, 8, choice, 3)[0].tolist() == [1, 0, 0, 0, 0, 0]  # 8 - 5 <= 3
    assert curriculum_rules(stats, ids, 9, choice, 3)[0].tolist() == [0] * 6  # the rest is over


@pytest.mark.parametrize("strategy", ["least_used", "informative"])
def test_solved_prompts_rest_then_come_back_and_unsolved_ones_come_later(tmp_path, strategy):
    texts = PROMPTS[:8]
    train = prompt_file(tmp_path / "p.parquet", texts)
    ctx = context(tmp_path / "run", train, per_round=4, strategy=strategy, rest_rounds=2, window=2)
    solved, never, mixed = texts[:2], texts[2:4], texts[4:]
    round_of(ctx.store, 1, {**{t: [1.0, 1.0] for t in solved}, **{t: [0.0, 0.0] for t in never}})
    round_of(ctx.store, 2, {t: [1.0, 0.0] for t in mixed})
    round_of(ctx.store, 3, {t: [0.0, 0.0] for t in never})

    # Round 4: every prompt was used once but `never` (twice, no pass: weight 0.25, so it counts
    # as 8 uses), and the solved ones' rest is over (last round 1, rest_rounds 2: rounds 2 and 3).
    order = ranked_prompts(ctx, 4).column("prompt").to_pylist()
    if strategy == "least_used":
        assert set(order[:6]) == set(solved) | set(mixed) and set(order[6:]) == set(never)
    assert chosen(choose_prompts(ctx, 4)) == order[:4]

    # Round 3 (rounds 1-2 count): the solved ones rest, the others come first.
    order3 = ranked_prompts(ctx, 3).column("prompt").to_pylist()
    assert set(order3[-2:]) == set(solved)

    # A rested prompt is still taken when the pool runs short: per_round = the pool.
    wide = context(tmp_path / "run", train, per_round=7, strategy=strategy, rest_rounds=2, window=2)
    taken = chosen(choose_prompts(wide, 3))
    assert set(taken[:6]) == set(texts[2:]) and taken[6] in solved


def test_unsolved_prompts_are_revisited_less_often_under_least_used(tmp_path):
    texts = PROMPTS[:8]
    ctx = context(tmp_path / "run", prompt_file(tmp_path / "p.parquet", texts), per_round=2,
                  unsolved_visits=1, unsolved_weight=0.5)
    never = texts[0]
    visits = {text: 0 for text in texts}
    for round in range(1, 17):
        picked = chosen(choose_prompts(ctx, round))
        round_of(ctx.store, round, {t: ([0.0, 0.0] if t == never else [1.0, 0.0]) for t in picked})
        for text in picked:
            visits[text] += 1
    # 32 visits: `never` counts each use twice, so least_used evens 2 x its visits with the
    # others' (30 over 7 prompts: 4 or 5 each)
    assert visits[never] == 2 and sorted(v for t, v in visits.items() if t != never) == [4] * 5 + [5] * 2


def test_choice_without_the_curriculum_is_the_plain_strategy(tmp_path):
    texts = PROMPTS[:8]
    train = prompt_file(tmp_path / "p.parquet", texts)
    on = context(tmp_path / "on", train, per_round=4, rest_rounds=5)
    off = context(tmp_path / "off", train, per_round=4, curriculum=False)
    for ctx in (on, off):
        round_of(ctx.store, 1, {t: [1.0, 1.0] for t in texts[:4]})
    # Off: least used first (texts[4:]), then the solved ones in the seeded order; on: the same
    # first four, and the solved ones rest in either case here, so the orders agree.
    assert ranked_prompts(off, 2).column("prompt").to_pylist()[:4] == \
        ranked_prompts(on, 2).column("prompt").to_pylist()[:4]
    assert off.prompts.history.stats == {}  # off: no history is counted
