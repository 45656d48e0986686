"""Which prompts a round samples: `choose_prompts(ctx, round)`, written once per round.

The pool is every prompt of the spec's train files (a prompt in two files counts once, as
its first occurrence), ordered by the strategy of `PromptChoice`; the first `per_round` are
the round's prompts. Prompts of files new to the run come early (a scheduled refresh that
adds a file trains on it next); h is a seeded 64-bit hash of the prompt for the round,

    h = splitmix64(s(prompt_id) XOR s(f"{seed}:{round}")),  s(x) = sha256(x)'s first 8 bytes
                                                            (big-endian), splitmix64 the
                                                            finaliser of Steele et al. 2014

(ties, at odds ~n^2 / 2^65, go to the earlier prompt of the pool):

    least_used    (default) sort by (times used, not from a new file, h): times used = the
                  earlier rounds whose samples hold the prompt
    informative   sort by (not from a new file, -ln(u) / weight, h), u in (0, 1) from h: a
                  weighted draw without replacement (Efraimidis-Spirakis), weight 1 for
                  prompts worth training on and `floor` for saturated ones; a pure function of
                  (seed, round, the earlier rounds' scores)

With `[prompts] curriculum = true` (pipelines/loop/curriculum.py) both strategies put rested
prompts (solved: recent pass rate >= `solved`, within `rest_rounds` rounds of their last
round) after all others, and weigh unsolved ones (no pass after `unsolved_visits` rounds)
`unsolved_weight`: least_used sorts by (rested, times used / weight, not new, h),
informative by (rested, not new, -ln(u) / (weight x unsolved weight), h).

A prompt is saturated when every reward of its samples in the last `window` rounds it was
sampled in (the scores tables of earlier rounds) is the same: recent pass rate p = 0 or 1
for a 0/1 reward, a group that filter drops as zero_variance and that costs sampling but
teaches nothing. Prompts never sampled count as worth training on. A saturated prompt is
drawn less, never dropped: its weight stays `floor` > 0, and a round that samples it again
refreshes its pass rate.

Only rounds before `round` count (a rerun after a kill, with this round's samples already
on disk, chooses the same); the choice is written to RUN/_rounds/round=<n>/prompts.parquet
once and reused on resume. The train files are what the spec's `[prompts] train` entries
(files, folders, globs, object URLs: curation/generate/prompt_files.py) name when the run
starts (`RoundContext.prompt_files`), so a refresh run picks up partitions added since; they
are recorded in RUN/pipeline.json (`prompt_files`); on a new run no file counts as new.

The loop's state for this is a `PromptBook` on its RoundContext: the pool (the train files,
read once per run) and the times each prompt was used, counted from the samples of the
rounds before the first choice once, then one new round at a time, so a choice costs the
same in round 5 and round 500. The loop writes each round's samples before the next choice
and never rewrites an earlier round's; a book is for one run and one set of train files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from curation.generate.base import load_prompts
from pipelines.loop.curriculum import PromptHistory, curriculum_rules, default_rest_rounds
from store.location import RunLocation
from store.run_files import load_pipeline_state, round_prompts_rel, save_pipeline_state
from store.run_store import RunStore
from store.storage import write_atomic

__all__ = ["PromptBook", "PromptChoice", "choose_prompts", "pass_rates", "prompt_keys", "ranked_prompts", "tiebreak"]


class PromptChoice(BaseModel):
    """How a round picks its `per_round` prompts from the pool."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["least_used", "informative"] = Field(
        "least_used", description="least_used: fewest earlier rounds first, then a seeded order. informative: a "
                                  "seeded weighted draw that favours prompts whose recent pass rate is between 0 "
                                  "and 1 (saturated prompts weigh `floor`; unseen prompts count as informative).")
    window: int = Field(
        2, ge=1, description="informative: a prompt's recent pass rate is over its samples in the last `window` "
                             "rounds it was sampled in.")
    floor: float = Field(
        0.1, gt=0, le=1, description="informative: weight of a saturated prompt (all recent rewards equal: pass "
                                     "rate 0 or 1) against 1 for the others; > 0, so none is dropped for good.")
    solved: float = Field(
        0.9, gt=0, le=1, description="[prompts] curriculum: a prompt whose pass rate over the last `window` rounds "
                                     "it was sampled in is at least this rests for `rest_rounds` rounds.")
    rest_rounds: int | None = Field(
        None, ge=1, description="[prompts] curriculum: rounds a solved prompt rests after its last round (it goes "
                                "after every other prompt meanwhile); default: the rounds the pool takes to go "
                                "round twice, 2 x ceil(pool / per_round).")
    unsolved_visits: int = Field(
        2, ge=1, description="[prompts] curriculum: a prompt with no pass after this many rounds counts as "
                             "unsolved and weighs `unsolved_weight`.")
    unsolved_weight: float = Field(
        0.25, gt=0, le=1, description="[prompts] curriculum: weight of an unsolved prompt (least_used: each of its "
                                      "uses counts 1 / weight times; informative: its draw weight times this).")
    pass_reward: float = Field(
        1.0, description="[prompts] curriculum: a sample passes when its reward is at least this (1.0: a 0/1 "
                         "reward's pass).")


class _Context(Protocol):
    """What prompt choice reads of the round loop's RoundContext."""

    spec: object
    store: RunStore
    prompts: PromptBook
    prompt_files: list[str]

    @property
    def location(self) -> RunLocation: ...


def choose_prompts(ctx: _Context, round: int) -> Path:
    """The prompts of `round` (see the module docstring), written once to
    RUN/_rounds/round=<n>/prompts.parquet; returns that file (in this machine's work folder:
    store/location.py)."""
    location, rel = ctx.location, round_prompts_rel(round)
    if location.storage.exists(rel):
        return location.fetch(rel)
    state = load_pipeline_state(location.storage)
    pool, keys = _ranking_keys(ctx, round, state)
    chosen = pool.table.take(pa.array(first_in_order(keys, ctx.spec.prompts.per_round), type=pa.int64()))
    write_atomic(location.work / rel, lambda f: pq.write_table(chosen, f))
    location.upload(rel)
    files = sorted(set(state.get("prompt_files", [])) | set(ctx.prompt_files))
    if files != state.get("prompt_files"):
        save_pipeline_state(location.storage, {**state, "prompt_files": files})
    return location.work / rel


def ranked_prompts(ctx: _Context, round: int, state: dict | None = None,
                   exclude: set[str] | None = None) -> pa.Table:
    """The whole pool in the order `round` takes it (choose_prompts takes the first
    `per_round`; a round that needs more prompts can take the next ones), minus the prompt
    ids in `exclude`. `state` is RUN/pipeline.json (read when not given)."""
    pool, keys = _ranking_keys(ctx, round, load_pipeline_state(ctx.location.storage) if state is None else state)
    order = np.lexsort(keys[::-1]).tolist()
    if exclude:
        order = [i for i in order if pool.ids[i] not in exclude]
    return pool.table.take(pa.array(order, type=pa.int64()))


def _ranking_keys(ctx: _Context, round: int, state: dict) -> tuple[_Pool, list[np.ndarray]]:
    """The pool and its sort keys for `round`, most significant first (the module docstring):
    least_used (2 * times used + not new, h), informative (not new, -ln(u) / weight, h)."""
    spec = ctx.spec
    choice = prompt_choice(spec)
    seen = set(state.get("prompt_files", []))
    pool = ctx.prompts.pool(ctx.prompt_files, seen if seen else None)
    h = tiebreak(spec.run.seed, round, pool.keys)
    rules = _curriculum(ctx, round, pool, choice)
    if choice.strategy == "least_used":
        used = ctx.prompts.times_used(ctx.store, round)
        if rules is None:  # (times used, not new) as one key: not_new is 0 or 1.
            return pool, [used * 2 + pool.not_new, h]
        rested, weight = rules
        return pool, [rested, used / weight, pool.not_new, h]
    rates = pass_rates(ctx.store, round, choice.window)
    weight = pool.per_prompt({prompt_id: choice.floor for prompt_id, (_, flat) in rates.items() if flat}, 1.0)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # h's top 53 bits, in (0, 1)
    if rules is None:
        return pool, [pool.not_new, -np.log(u) / weight, h]
    rested, unsolved = rules
    return pool, [rested, pool.not_new, -np.log(u) / (weight * unsolved), h]


def _curriculum(ctx: _Context, round: int, pool: _Pool, choice: PromptChoice) -> tuple[np.ndarray, np.ndarray] | None:
    """(rested, weight) per pool prompt under `[prompts] curriculum` (pipelines/loop/curriculum.py);
    None when it is off."""
    if not ctx.spec.prompts.curriculum:
        return None
    stats = ctx.prompts.history.through(ctx.store, round, choice.window, choice.pass_reward)
    rest = choice.rest_rounds or default_rest_rounds(len(pool.ids), ctx.spec.prompts.per_round)
    return curriculum_rules(stats, pool.ids, round, choice, rest)


def first_in_order(keys: list[np.ndarray], count: int) -> np.ndarray:
    """The positions of the first `count` items in the order `np.lexsort(keys[::-1])` gives
    (`keys` most significant first; ties in every key go to the earlier position), without
    sorting them all: each key in turn keeps the items below its count-th smallest value
    (they are in) and narrows the rest to those equal to it; the few kept are then sorted."""
    size = len(keys[0])
    if count >= size:
        return np.lexsort(keys[::-1])
    sure: list[np.ndarray] = []
    tied = np.arange(size)
    need = count
    for at, key in enumerate(keys):
        if need == 0 or len(tied) <= need:
            break
        values = key if at == 0 else key[tied]
        kth = np.partition(values, need - 1)[need - 1]
        below = tied[values < kth]
        sure.append(below)
        need -= len(below)
        tied = tied[values == kth]
    picked = np.sort(np.concatenate([*sure, tied[:need]]))  # ascending: lexsort is stable
    return picked[np.lexsort([key[picked] for key in keys[::-1]])]


def prompt_choice(spec: object) -> PromptChoice:
    """The spec's `[prompts] choice` (the default PromptChoice while the spec has none)."""
    choice = getattr(spec.prompts, "choice", None)
    if choice is None:
        return PromptChoice()
    return choice if isinstance(choice, PromptChoice) else PromptChoice.model_validate(choice)


def _round_ids(store: RunStore, round: int) -> frozenset[str]:
    """The prompt ids the round's samples hold (held parts from memory)."""
    return frozenset(store.read_columns("samples", ["prompt_id"], round, validate=False)
                     .column("prompt_id").unique().to_pylist())


@dataclass
class PromptBook:
    """The round loop's prompt-choice state: the pool of its train files and how many earlier
    rounds sampled each prompt (see the module docstring)."""

    _pool: _Pool | None = None
    _pool_key: tuple | None = None
    _used: np.ndarray | None = None
    """Per pool position: the rounds before `_counted` that sampled it."""
    _counted: int = 1
    """The first round not counted in `_used` yet."""
    history: PromptHistory = field(default_factory=PromptHistory)
    """Each sampled prompt's pass-rate history (`[prompts] curriculum`: pipelines/loop/curriculum.py)."""

    def pool(self, files: list[str], seen: set[str] | None) -> _Pool:
        """The pool of `files` (the run's train files) with which of them are new to the run
        (`seen`: the files the run saw before; None: nothing is new); read once for the run."""
        key = (tuple(str(f) for f in files), None if seen is None else tuple(sorted(seen)))
        if key != self._pool_key:
            ids = None if self._pool is None else self._pool.ids
            self._pool, self._pool_key = _prompt_pool(files, seen), key
            if ids != self._pool.ids:  # another pool: count again
                self._used, self._counted = None, 1
        return self._pool

    def times_used(self, store: RunStore, round: int) -> np.ndarray:
        """Times used (rounds before `round` that sampled the prompt) of each prompt of the pool,
        in pool order; counts the rounds not counted yet (all of them on the first call)."""
        pool = self._pool
        if self._used is None or round < self._counted:
            self._used, self._counted = np.zeros(len(pool.ids), dtype=np.int64), 1
            earlier = [r for r in store.rounds("samples") if r < round]
        else:
            earlier = range(self._counted, round)
        for r in earlier:  # a round without samples holds no ids
            self._used[pool.positions(_round_ids(store, r))] += 1
        self._counted = max(self._counted, round)
        return self._used.copy()


_PASS_RATE_SQL = """
WITH per_round AS (
    SELECT prompt_id, round, min(reward) AS lo, max(reward) AS hi, sum(reward) AS total, count(reward) AS n
    FROM scores
    WHERE reward IS NOT NULL
    GROUP BY prompt_id, round
), recent AS (
    SELECT *, row_number() OVER (PARTITION BY prompt_id ORDER BY round DESC) AS age FROM per_round
)
SELECT prompt_id, sum(total) / sum(n) AS pass_rate, min(lo) = max(hi) AS saturated
FROM recent WHERE age <= $window
GROUP BY prompt_id
"""


def pass_rates(store: RunStore, round: int, window: int) -> dict[str, tuple[float, bool]]:
    """Per prompt_id sampled (and scored) before `round`: (recent pass rate, saturated) over
    its samples in the last `window` rounds it was sampled in. Recent pass rate: the mean
    reward; saturated: all those rewards are equal."""
    earlier = [r for r in store.rounds("scores") if r < round]
    if not earlier:
        return {}
    scores = store.read_columns("scores", ["prompt_id", "round", "reward"], earlier)  # noqa: F841 (read by the SQL)
    rows = duckdb.sql(_PASS_RATE_SQL, params={"window": window}).fetchall()
    return {prompt_id: (float(rate), bool(saturated)) for prompt_id, rate, saturated in rows}


@dataclass(frozen=True, eq=False)
class _Pool:
    table: pa.Table
    """Every prompt of the train files, the first occurrence of each prompt_id."""
    ids: list[str]
    not_new: np.ndarray
    """Per prompt: not from a file new to the run (bool)."""
    keys: np.ndarray
    """Per prompt: s(prompt_id), the first 8 bytes of sha256(prompt_id) as a uint64."""
    index: dict[str, int]
    """prompt_id -> its position in the pool."""

    def positions(self, ids: frozenset[str]) -> np.ndarray:
        """The pool positions of the ids that are in the pool (each once: `ids` is a set)."""
        index = self.index
        return np.fromiter((index[i] for i in ids if i in index), dtype=np.int64)

    def per_prompt(self, values: dict[str, float], default: float) -> np.ndarray:
        """`values` (by prompt_id; ids not in the pool ignored) as an array in pool order."""
        out = np.full(len(self.ids), default, dtype=np.float64 if isinstance(default, float) else np.int64)
        for prompt_id, value in values.items():
            at = self.index.get(prompt_id)
            if at is not None:
                out[at] = value
        return out


def _prompt_pool(files: list[str], seen: set[str] | None) -> _Pool:
    """The pool of the spec's train files (first occurrence of each prompt_id kept), with
    whether each prompt comes from a file the run has not seen before (seen None: nothing is
    new)."""
    tables = [load_prompts(f) for f in files]
    new_flags = [[seen is not None and str(f) not in seen] * t.num_rows for f, t in zip(files, tables)]
    table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    is_new = [flag for flags in new_flags for flag in flags]
    ids = table.column("prompt_id").to_pylist()
    seen_ids: set[str] = set()
    keep = [i for i, prompt_id in enumerate(ids) if not (prompt_id in seen_ids or seen_ids.add(prompt_id))]
    if len(keep) < len(ids):
        table, ids, is_new = table.take(pa.array(keep)), [ids[i] for i in keep], [is_new[i] for i in keep]
    return _Pool(table, ids, ~np.asarray(is_new, dtype=bool), prompt_keys(ids),
                 {prompt_id: at for at, prompt_id in enumerate(ids)})


def _sha64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64s (multiplications wrap mod 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def tiebreak(seed: int, round: int, keys: np.ndarray) -> np.ndarray:
    """h of each prompt for (seed, round), from its key s(prompt_id) (the module docstring)."""
    with np.errstate(over="ignore"):
        return _splitmix64(np.asarray(keys, dtype=np.uint64) ^ np.uint64(_sha64(f"{seed}:{round}")))


def prompt_keys(prompt_ids: list[str]) -> np.ndarray:
    """s(prompt_id) of each prompt id: the first 8 bytes of its sha256, as uint64s."""
    return np.array([_sha64(i) for i in prompt_ids], dtype=np.uint64)
