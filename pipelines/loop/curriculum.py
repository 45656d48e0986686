"""The pass-rate curriculum (`[prompts] curriculum = true`): each prompt's history in the run,
and the two rules prompt choice (pipelines/loop/prompts.py) takes from it.

A prompt's history as of the end of round n, over the scores tables of rounds <= n:

    rounds_seen     rounds that sampled it
    samples         its scored samples (reward not null); passes: those with reward >= pass_reward
    recent_*        the same two counts over the last `window` rounds that sampled it
    pass_rate       recent_passes / recent_samples (None: no scored sample recently)
    last_round      the last round that sampled it

The rules for round n (`[prompts.choice]` settings):

    rested      pass_rate >= solved and n - last_round <= rest_rounds: the prompt goes after
                every prompt that is not rested (taken only when those run short)
    unsolved    passes == 0 after >= unsolved_visits rounds: weight unsolved_weight < 1
                (least_used counts each of its uses 1 / weight times; informative multiplies
                its draw weight by it)

None is dropped for good: a rest ends after rest_rounds rounds and a weight is > 0.

The state is a `PromptHistory` on the round context's PromptBook, built from the scores
tables of the rounds before the first round asked for (once per process: a resumed run
rebuilds it from the committed tables) and then advanced one round at a time, so a choice
costs the same in round 5 and round 500. It is a pure function of the scores tables, which a
killed and resumed run commits with the same rows, so such a run chooses as an unkilled one.

Each round also commits its rows of the `prompt_stats` table (stage "prompt_stats", one row
per prompt the round sampled, with its counts after the round; `round` is then its last
round), so the history is versioned with the run, mirrored to Delta for other readers, and
its state as of any round r is the newest row per prompt_id among rounds <= r:

    SELECT * FROM prompt_stats WHERE round <= r
    QUALIFY row_number() OVER (PARTITION BY prompt_id ORDER BY round DESC) = 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from curation.stages.runner import input_fingerprints
from store.run_store import RunStore
from store.schema import SCHEMAS

__all__ = ["PromptHistory", "PromptStat", "STAGE", "curriculum_rules", "history_rows", "record_history",
           "round_counts"]

STAGE = "prompt_stats"
"""The stage (and table) name of the history's commits."""


@dataclass(frozen=True)
class PromptStat:
    """One prompt's history as of its last round (the module docstring)."""

    rounds_seen: int
    samples: int
    passes: int
    last_round: int
    recent: tuple[tuple[int, int], ...]
    """(samples, passes) of each of its last `window` rounds, oldest first."""

    @property
    def recent_samples(self) -> int:
        return sum(samples for samples, _ in self.recent)

    @property
    def recent_passes(self) -> int:
        return sum(passes for _, passes in self.recent)

    @property
    def pass_rate(self) -> float | None:
        samples = self.recent_samples
        return self.recent_passes / samples if samples else None

    def after(self, round: int, samples: int, passes: int, window: int) -> PromptStat:
        """This history with one more round that sampled the prompt."""
        return PromptStat(self.rounds_seen + 1, self.samples + samples, self.passes + passes, round,
                          (*self.recent, (samples, passes))[-window:])


_NEVER = PromptStat(0, 0, 0, -1, ())


@dataclass
class PromptHistory:
    """Every sampled prompt's `PromptStat` over the rounds before `counted` (the module docstring)."""

    stats: dict[str, PromptStat] = field(default_factory=dict)
    counted: int = 1
    """The first round not in `stats` yet."""
    settings: tuple[int, float] | None = None
    """(window, pass_reward) the stats were counted with; others count again."""

    def through(self, store: RunStore, round: int, window: int, pass_reward: float) -> dict[str, PromptStat]:
        """The history of the rounds before `round`; counts the rounds not counted yet (all of
        them on the first call, or when asked for an earlier round or other settings)."""
        if self.settings != (window, pass_reward) or round < self.counted:
            self.stats, self.counted, self.settings = {}, 1, (window, pass_reward)
        for r in store.rounds("scores"):
            if self.counted <= r < round:
                for prompt_id, samples, passes in round_counts(store, r, pass_reward):
                    self.stats[prompt_id] = self.stats.get(prompt_id, _NEVER).after(r, samples, passes, window)
        self.counted = max(self.counted, round)
        return self.stats


def round_counts(store: RunStore, round: int, pass_reward: float) -> list[tuple[str, int, int]]:
    """(prompt_id, scored samples, passes) of each prompt the round's scores hold, by prompt_id."""
    scores = store.read_columns("scores", ["prompt_id", "reward"], round)
    reward = scores.column("reward")
    table = pa.table({"prompt_id": scores.column("prompt_id"),
                      "scored": pc.is_valid(reward).cast(pa.int64()),
                      "passed": pc.fill_null(pc.greater_equal(reward, pass_reward), False).cast(pa.int64())})
    sums = table.group_by("prompt_id").aggregate([("scored", "sum"), ("passed", "sum")]).sort_by("prompt_id")
    return list(zip(sums.column("prompt_id").to_pylist(), sums.column("scored_sum").to_pylist(),
                    sums.column("passed_sum").to_pylist()))


def history_rows(stats: dict[str, PromptStat], round: int, run_id: str) -> pa.Table:
    """The `prompt_stats` rows of `round`: each prompt whose last round it is, by prompt_id."""
    ids = sorted(prompt_id for prompt_id, stat in stats.items() if stat.last_round == round)
    picked = [stats[prompt_id] for prompt_id in ids]
    return pa.Table.from_pydict({
        "run_id": [run_id] * len(ids), "round": [round] * len(ids), "prompt_id": ids,
        "rounds_seen": [s.rounds_seen for s in picked], "samples": [s.samples for s in picked],
        "passes": [s.passes for s in picked], "recent_samples": [s.recent_samples for s in picked],
        "recent_passes": [s.recent_passes for s in picked], "pass_rate": [s.pass_rate for s in picked],
    }, schema=SCHEMAS["prompt_stats"])


def record_history(ctx, round: int) -> None:
    """Commit round `round`'s rows of the `prompt_stats` table (the module docstring), once its
    scores are final; skipped when the curriculum is off or the commit is up to date with the
    round's scores. `ctx`: the round loop's RoundContext."""
    spec = ctx.spec
    if not spec.prompts.curriculum:
        return
    choice = spec.prompts.choice
    store = ctx.store
    inputs = input_fingerprints(store, ("scores",), round)
    config = {"window": choice.window, "pass_reward": choice.pass_reward}
    if store.is_up_to_date(STAGE, round, inputs, config):
        return
    stats = ctx.prompts.history.through(store, round + 1, choice.window, choice.pass_reward)
    rows = history_rows(stats, round, spec.run.name)
    with store.commit(STAGE, round, inputs, config) as commit:
        commit.write(STAGE, rows)
        commit.record(rows_in=sum(store.row_count(rel) for rel in store.files("scores", round)),
                      rows_out=rows.num_rows)


def curriculum_rules(stats: dict[str, PromptStat], ids: list[str], round: int, choice,
                     rest_rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """(rested, weight) of each prompt of `ids` (the pool, in its order) for `round`: rested 1
    or 0, weight unsolved_weight or 1.0 (the module docstring). `choice`: the PromptChoice."""
    rested = np.zeros(len(ids), dtype=np.int64)
    weight = np.ones(len(ids), dtype=np.float64)
    for at, prompt_id in enumerate(ids):
        stat = stats.get(prompt_id)
        if stat is None:
            continue
        rate = stat.pass_rate
        if rate is not None and rate >= choice.solved and round - stat.last_round <= rest_rounds:
            rested[at] = 1
        if stat.passes == 0 and stat.rounds_seen >= choice.unsolved_visits:
            weight[at] = choice.unsolved_weight
    return rested, weight


def default_rest_rounds(pool_size: int, per_round: int) -> int:
    """Rounds a solved prompt rests when `rest_rounds` is unset: the rounds the pool takes to
    go round twice (least_used would come back to it after one)."""
    return 2 * max(1, math.ceil(pool_size / per_round))
