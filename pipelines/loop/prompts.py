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
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from curation.generate.base import load_prompts, remember_prompts
from curation.store.fingerprints import FileCache, file_stat
from curation.store.run_store import RunStore, parquet_files
from curation.store.runlog import load_pipeline_state, round_prompts_path, save_pipeline_state, write_atomic

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
    pool, keys = _ranking_keys(ctx, round, state)
    chosen = pool.table.take(pa.array(first_in_order(keys, ctx.spec.prompts.per_round), type=pa.int64()))
    write_atomic(path, lambda f: pq.write_table(chosen, f))
    remember_prompts(path, chosen)  # the generate stage reads this file next
    files = sorted(set(state.get("prompt_files", [])) | {str(f) for f in ctx.spec.prompts.train})
    if files != state.get("prompt_files"):
        save_pipeline_state(ctx.run_dir, {**state, "prompt_files": files})
    return path


def ranked_prompts(ctx: _Context, round: int, state: dict | None = None,
                   exclude: set[str] | None = None) -> pa.Table:
    """The whole pool in the order `round` takes it (choose_prompts takes the first
    `per_round`; a round that needs more prompts can take the next ones), minus the prompt
    ids in `exclude`. `state` is RUN/pipeline.json (read when not given)."""
    pool, keys = _ranking_keys(ctx, round, load_pipeline_state(ctx.run_dir) if state is None else state)
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
    pool = _prompt_pool(spec.prompts.train, seen if seen else None)
    h = tiebreak(spec.run.seed, round, pool.keys)
    if choice.strategy == "least_used":
        # (times used, not new) as one key: not_new is 0 or 1.
        return pool, [_used_in_pool(ctx.store, round, pool) * 2 + pool.not_new, h]
    rates = pass_rates(ctx.store, round, choice.window)
    weight = pool.per_prompt({prompt_id: choice.floor for prompt_id, (_, flat) in rates.items() if flat}, 1.0)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # h's top 53 bits, in (0, 1)
    return pool, [pool.not_new, -np.log(u) / weight, h]


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


_SAMPLED: FileCache[frozenset[str]] = FileCache(max_entries=1 << 16)
"""The prompt ids of each samples part file this process read (a part is written once; a
rewritten one has another size or mtime_ns and is read again)."""


def times_used(store: RunStore, round: int) -> dict[str, int]:
    """Per prompt_id: how many rounds before `round` sampled it."""
    return dict(Counter(prompt_id for ids in _sampled_rounds(store, round).values() for prompt_id in ids))


@dataclass(frozen=True)
class _RoundFolder:
    """A samples round folder as this process last listed it."""

    mtime_ns: int
    listed_ns: int
    """time.time_ns() when it was listed."""
    files: tuple[tuple[str, int, int], ...]
    """Its part files: (path, size, mtime_ns)."""
    ids: frozenset[str]
    """The prompt ids its part files hold."""


_FOLDERS: dict[str, _RoundFolder] = {}  # by the folder's absolute path
_RACY_NS = 2_000_000_000
"""A folder listed less than this after its last change is listed again on the next call: a
file system's clock may tick as rarely as once a second, so a file added in the same tick as
the listing would leave the folder's mtime_ns unchanged."""


def _sampled_rounds(store: RunStore, round: int) -> dict[int, frozenset[str]]:
    """{earlier round: the prompt ids its samples parts hold} for the rounds before `round`
    that hold a samples part. A round folder is listed again only when its mtime_ns changed
    (a part added, replaced or removed) and a part read again only when its size or mtime_ns
    changed (rewritten in place), so a call costs two stats per earlier round, not a listing
    and a read of each."""
    if getattr(store, "_committed", None) is not None:  # a snapshot reads only its committed files
        return {earlier: _read_ids(store.files("samples", earlier))
                for earlier in store.rounds("samples") if earlier < round}
    try:
        entries = list(os.scandir(store.table_dir("samples")))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found: dict[int, frozenset[str]] = {}
    for entry in entries:
        digits = entry.name[len("round="):]
        # Only the folders RunStore.partition_dir names (round=<n>, no leading zeros) hold a round.
        if not (entry.name.startswith("round=") and digits.isdecimal() and digits.isascii()
                and entry.name == f"round={int(digits)}") or int(digits) >= round:
            continue
        folder = _round_folder(entry.path)
        if folder is not None and folder.files:
            found[int(digits)] = folder.ids
    return found


def _round_folder(key: str) -> _RoundFolder | None:
    """The listing and prompt ids of the samples round folder at path `key` (None: not a
    folder), from _FOLDERS while the folder and its parts are unchanged."""
    try:
        mtime_ns = os.stat(key).st_mtime_ns
    except (FileNotFoundError, NotADirectoryError):
        return None
    known = _FOLDERS.get(key)
    if known is not None and known.mtime_ns == mtime_ns and known.listed_ns - mtime_ns > _RACY_NS:
        try:
            for file, size, file_mtime_ns in known.files:
                stat = os.stat(file)
                if stat.st_size != size or stat.st_mtime_ns != file_mtime_ns:
                    break
            else:
                return known
        except FileNotFoundError:
            pass
    listed_ns = time.time_ns()
    parts = parquet_files(Path(key))  # as RunStore.files lists them
    files = tuple((str(part), *file_stat(part).values()) for part in parts)
    if key not in _FOLDERS and len(_FOLDERS) >= 1 << 16:
        _FOLDERS.pop(next(iter(_FOLDERS)))
    folder = _FOLDERS[key] = _RoundFolder(mtime_ns, listed_ns, files, _read_ids(parts))
    return folder


def remember_sampled(path: Path, stat: Mapping[str, int], samples: pa.Table) -> None:
    """Note the prompt ids of a samples part this process just committed (its size and
    mtime_ns as published), so the next prompt choice does not read the file back."""
    _SAMPLED.put(path, stat, _ids_of(samples))


def _read_ids(parts: list[Path]) -> frozenset[str]:
    """The prompt ids the samples parts hold (each part read once per process: _SAMPLED)."""
    ids: set[str] = set()
    for path in parts:
        ids |= _SAMPLED.get(path, lambda path=path: _ids_of(pq.read_table(path, columns=["prompt_id"])))
    return frozenset(ids)


def _ids_of(samples: pa.Table) -> frozenset[str]:
    return frozenset(samples.column("prompt_id").unique().to_pylist())


@dataclass
class _UsedCounts:
    """Times used in one pool's order, for the rounds (and their ids) counted so far."""

    counted: dict[int, frozenset[str]]
    used: np.ndarray


_USED: dict[tuple[str, int], tuple[_Pool, _UsedCounts]] = {}  # by (samples folder, id(pool)); the last 4


def _used_in_pool(store: RunStore, round: int, pool: _Pool) -> np.ndarray:
    """Times used (rounds before `round` that sampled the prompt) of each prompt of `pool`, in
    pool order. Kept between calls and updated by the rounds that changed: a new round's ids
    are added, a round whose parts changed is taken out and added again."""
    rounds = _sampled_rounds(store, round)
    key = (str(store.table_dir("samples")), id(pool))
    cached = _USED.get(key)
    if cached is None or cached[0] is not pool:
        if len(_USED) >= 4:
            _USED.pop(next(iter(_USED)))
        counts = _USED[key] = (pool, _UsedCounts({}, np.zeros(len(pool.ids), dtype=np.int64)))
        counts = counts[1]
    else:
        counts = cached[1]
    for earlier, ids in list(counts.counted.items()):
        if rounds.get(earlier) is not ids:
            counts.used[pool.positions(ids)] -= 1
            del counts.counted[earlier]
    for earlier, ids in rounds.items():
        if earlier not in counts.counted:
            counts.used[pool.positions(ids)] += 1
            counts.counted[earlier] = ids
    return counts.used.copy()


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
