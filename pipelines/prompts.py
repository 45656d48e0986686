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

A prompt is saturated when every reward of its samples in the last `window` rounds it was
sampled in (the scores tables of earlier rounds) is the same: recent pass rate p = 0 or 1
for a 0/1 reward, a group that filter drops as zero_variance and that costs sampling but
teaches nothing. Prompts never sampled count as worth training on. A saturated prompt is
drawn less, never dropped: its weight stays `floor` > 0, and a round that samples it again
refreshes its pass rate.

Only rounds before `round` count (a rerun after a kill, with this round's samples already
on disk, chooses the same); the choice is written to RUN/_rounds/round=<n>/prompts.parquet
once and reused on resume. Train files are recorded in RUN/pipeline.json (`prompt_files`);
on a new run no file counts as new.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from curation.fingerprints import FileCache, file_stat
from curation.generate.base import load_prompts
from curation.runlog import load_pipeline_state, round_prompts_path, save_pipeline_state, write_atomic
from curation.store import RunStore

__all__ = ["PromptChoice", "choose_prompts", "pass_rates", "prompt_keys", "ranked_prompts", "tiebreak", "times_used"]


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


class _Context(Protocol):
    """What prompt choice reads of the round loop's RoundContext."""

    spec: object
    store: RunStore

    @property
    def run_dir(self) -> Path: ...


def choose_prompts(ctx: _Context, round: int) -> Path:
    """The prompts of `round` (see the module docstring), written once to
    RUN/_rounds/round=<n>/prompts.parquet; returns that file."""
    path = round_prompts_path(ctx.run_dir, round)
    if path.is_file():
        return path
    state = load_pipeline_state(ctx.run_dir)
    chosen = ranked_prompts(ctx, round, state).slice(0, ctx.spec.prompts.per_round)
    write_atomic(path, lambda f: pq.write_table(chosen, f))
    files = sorted(set(state.get("prompt_files", [])) | {str(f) for f in ctx.spec.prompts.train})
    if files != state.get("prompt_files"):
        save_pipeline_state(ctx.run_dir, {**state, "prompt_files": files})
    return path


def ranked_prompts(ctx: _Context, round: int, state: dict | None = None,
                   exclude: set[str] | None = None) -> pa.Table:
    """The whole pool in the order `round` takes it (choose_prompts takes the first
    `per_round`; a round that needs more prompts can take the next ones), minus the prompt
    ids in `exclude`. `state` is RUN/pipeline.json (read when not given)."""
    spec = ctx.spec
    choice = prompt_choice(spec)
    state = load_pipeline_state(ctx.run_dir) if state is None else state
    seen = set(state.get("prompt_files", []))
    pool = _prompt_pool(spec.prompts.train, seen if seen else None)
    ids = pool.ids
    h = tiebreak(spec.run.seed, round, pool.keys)
    if choice.strategy == "least_used":
        used = pool.per_prompt(times_used(ctx.store, round), 0)
        order = np.lexsort((h, pool.not_new, used))
    else:
        rates = pass_rates(ctx.store, round, choice.window)
        weight = pool.per_prompt({prompt_id: choice.floor for prompt_id, (_, flat) in rates.items() if flat}, 1.0)
        u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # h's top 53 bits, in (0, 1)
        order = np.lexsort((h, -np.log(u) / weight, pool.not_new))
    order = order.tolist()
    if exclude:
        order = [i for i in order if ids[i] not in exclude]
    return pool.table.take(pa.array(order, type=pa.int64()))


def prompt_choice(spec: object) -> PromptChoice:
    """The spec's `[prompts] choice` (the default PromptChoice while the spec has none)."""
    choice = getattr(spec.prompts, "choice", None)
    if choice is None:
        return PromptChoice()
    return choice if isinstance(choice, PromptChoice) else PromptChoice.model_validate(choice)


_SAMPLED: FileCache[frozenset[str]] = FileCache(max_entries=1 << 16)
"""The prompt ids of each samples part file this process read (a part is written once; a
rewritten one has another size or mtime_ns and is read again)."""


def times_used(store: RunStore, round: int) -> dict[str, int]:
    """Per prompt_id: how many rounds before `round` sampled it. Each round's samples parts are
    read once per process (their prompt_id column only); later rounds reuse them."""
    counts: Counter[str] = Counter()
    for earlier in [r for r in store.rounds("samples") if r < round]:
        ids: set[str] = set()
        for path in store.files("samples", earlier):
            ids |= _SAMPLED.get(path, lambda path=path: frozenset(
                pq.read_table(path, columns=["prompt_id"]).column("prompt_id").unique().to_pylist()))
        counts.update(ids)
    return dict(counts)


_PASS_RATE_SQL = """
WITH per_round AS (
    SELECT prompt_id, round, min(reward) AS lo, max(reward) AS hi, sum(reward) AS total, count(reward) AS n
    FROM read_parquet($f, hive_partitioning = false)
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
    files = [str(f) for f in store.files("scores", [r for r in store.rounds("scores") if r < round])]
    if not files:
        return {}
    rows = duckdb.sql(_PASS_RATE_SQL, params={"f": files, "window": window}).fetchall()
    return {prompt_id: (float(rate), bool(saturated)) for prompt_id, rate, saturated in rows}


@dataclass(frozen=True)
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

    def per_prompt(self, values: dict[str, float], default: float) -> np.ndarray:
        """`values` (by prompt_id; ids not in the pool ignored) as an array in pool order."""
        out = np.full(len(self.ids), default, dtype=np.float64 if isinstance(default, float) else np.int64)
        for prompt_id, value in values.items():
            at = self.index.get(prompt_id)
            if at is not None:
                out[at] = value
        return out


_POOLS: dict[tuple, _Pool] = {}  # the last few pools, by (each file's path, size, mtime_ns; files seen)


def _prompt_pool(files: list[str], seen: set[str] | None) -> _Pool:
    """The pool of the spec's train files (first occurrence of each prompt_id kept), with
    whether each prompt comes from a file the run has not seen before (seen None: nothing is
    new); kept while the files are unchanged (a round loop asks once per round)."""
    stats = tuple((os.path.abspath(f), *file_stat(f).values()) for f in files)
    key = (stats, None if seen is None else tuple(sorted(seen)))
    if key in _POOLS:
        return _POOLS[key]
    tables = [load_prompts(f) for f in files]
    new_flags = [[seen is not None and str(f) not in seen] * t.num_rows for f, t in zip(files, tables)]
    table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    is_new = [flag for flags in new_flags for flag in flags]
    ids = table.column("prompt_id").to_pylist()
    seen_ids: set[str] = set()
    keep = [i for i, prompt_id in enumerate(ids) if not (prompt_id in seen_ids or seen_ids.add(prompt_id))]
    if len(keep) < len(ids):
        table, ids, is_new = table.take(pa.array(keep)), [ids[i] for i in keep], [is_new[i] for i in keep]
    if len(_POOLS) >= 4:
        _POOLS.pop(next(iter(_POOLS)))
    pool = _POOLS[key] = _Pool(table, ids, ~np.asarray(is_new, dtype=bool), prompt_keys(ids),
                               {prompt_id: at for at, prompt_id in enumerate(ids)})
    return pool


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
