"""One runner for every curation stage: fingerprints -> up-to-date check -> read -> transform
-> validate -> atomic commit -> report.

A stage is a module (score.py, filter.py, label.py, pair.py) that declares:

    STAGE = "filter"                          its name: manifest, part files, rejects.stage
    READS = ("samples", "scores", "rejects")  the tables it reads; READS[0] is its main input
    WRITES = ("rejects",)                     the tables it writes, each as part-<STAGE>.parquet
    CONFIG = FilterConfig                     its pydantic config (a spec section)
    def columns(cfg) -> {table: [column, ...] | None}    what it reads of each (None: all)
    def transform(tables, cfg) -> StageOutput            pure: no I/O, the SQL inline

and, where it needs them, three hooks (score has the first two, label the third):

    def hashed_config(cfg) -> dict            the config as hashed and recorded (default: all
                                              of it; score leaves out `workers`)
    def reused_tables(store, round, inputs) -> {table: pa.Table}
                                              earlier outputs the transform may reuse (score:
                                              its own scores of the same samples); not with force
    def sliceable(cfg) -> bool                whether the transform may see a round a slice of
                                              groups at a time (default True; label's batch
                                              estimator needs every group of the round at once)

`run_stage` does the rest, the same way for the CLI, the round loop and large rounds:

    plan_stage     the inputs (the part files of READS for the round; prompts: the parts its
                   samples came from), each fingerprinted, the hashed config, the slice count
    up to date?    the manifest has these inputs and config: skipped
    read           only the columns the stage uses (each file's footer checked against the
                   contract); parts the store holds (`RunStore(..., hold=True)`, the loop's
                   store: what the stages before committed) come from memory
    transform      pure
    commit         the tables validated and written, the manifest last (store/run_store.py `Commit`)

A stage that also reads a table it writes (filter reads rejects) leaves its own part files out
of both its fingerprints and its read, so its own commit never makes it out of date. A part
file is hashed only when neither the store's held parts nor the round's manifests give its
sha256. A round without its main input is an error. Callers hold the run's lock
(`RunStore.lock()`).

Memory. A round whose main input has more than `slice_rows()` rows (default 1,000,000;
`GROUPFORGE_SLICE_ROWS`) runs in K = ceil(rows / slice_rows) slices: slice s holds the
groups whose prompt_id hashes to s mod K, read from the input files batch by batch, so a
group is never split and memory holds one slice of inputs and outputs, not the round. Each
slice commits its own part file (`part-<STAGE>-s<s>.parquet`), all in the stage's one commit;
the manifest's counts are the slices' sums. A sliced score stage does not reuse earlier scores
(it rescores), and a stage that is not sliceable reads the round whole.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

import numpy as np
import polars as pl
import pyarrow as pa

from curation.stages.common import drop_counts
from store import schema
from store.errors import disk_write
from store.faults import fault_point
from store.layout import part_name
from store.run_store import RunStore

CURATION_STAGES = ("score", "filter", "label", "pair")
SLICE_ROWS_ENV = "GROUPFORGE_SLICE_ROWS"
DEFAULT_SLICE_ROWS = 1_000_000
"""Main-input rows above which a stage runs a round in slices: ~0.6 GiB of peak memory per
slice for the four stages (BENCHMARKS.md, load check)."""
SPLIT_BATCH_ROWS = 131_072
"""Rows read at a time while a sliced stage splits its inputs."""


@dataclass
class StageOutput:
    """What a transform returns: the tables to commit and the counts for the manifest."""

    tables: dict[str, pa.Table]
    """One table per name in WRITES, committed as part-<STAGE>.parquet of the round."""
    rows_in: int
    """Rows the stage looked at (e.g. the samples no earlier stage rejected)."""
    rows_out: int
    """Rows that went on (e.g. the samples that survived the filter)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More manifest fields (score: scorer, reward_columns; label: rows_in_kept_groups)."""

    @property
    def drops(self) -> dict[str, int]:
        """{reason: rows} of the rejects this stage wrote ({} when it writes none)."""
        return drop_counts(self.tables["rejects"]) if "rejects" in self.tables else {}


@dataclass
class StageReport:
    """What run_stage did to one round: skipped (up to date, counts from the manifest) or ran."""

    stage: str
    round: int
    skipped: bool
    rows_in: int = 0
    rows_out: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall seconds of the call, the up-to-date check included."""


def stage_module(stage: str | ModuleType) -> ModuleType:
    """The module of a curation stage, by name ('score', 'filter', 'label', 'pair') or as is."""
    if isinstance(stage, ModuleType):
        return stage
    if stage not in CURATION_STAGES:
        raise ValueError(f"unknown curation stage {stage!r}; known: {', '.join(CURATION_STAGES)}")
    return importlib.import_module(f"curation.stages.{stage}")


def as_dict(config) -> Mapping:
    """A pydantic model or dataclass config as a plain dict (for manifests)."""
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    if hasattr(config, "__dataclass_fields__"):
        return asdict(config)
    return dict(config)


def input_fingerprints(store: RunStore, tables: tuple[str, ...], round: int,
                       exclude_parts: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: sha256} of every part file of `tables` for `round` (prompts: the parts
    the round's samples came from), leaving out the parts named in `exclude_parts`
    (`RunStore.part_fingerprints`: held parts and manifests vouch for most)."""
    rels = [rel for table in tables for rel in _files(store, table, round) if not _own_part(rel, exclude_parts)]
    return store.part_fingerprints(rels)


@dataclass(frozen=True)
class StagePlan:
    """What a stage run of one round reads and how (`plan_stage`)."""

    inputs: dict[str, str]
    """{relative path: sha256} of its input part files."""
    config: Mapping
    """The config as hashed and recorded in the manifest."""
    own: tuple[str, ...]
    """Its own part names left out of what it reads (a stage that reads a table it writes)."""
    slices: int
    """How many slices of groups the round is taken in (1: whole)."""


def plan_stage(module: ModuleType, store: RunStore, round: int, cfg) -> StagePlan:
    """The stage's inputs (fingerprinted), hashed config, own parts and slice count for `round`."""
    own = (module.STAGE,) if set(module.READS) & set(module.WRITES) else ()
    inputs = input_fingerprints(store, module.READS, round, exclude_parts=own)
    config = module.hashed_config(cfg) if hasattr(module, "hashed_config") else as_dict(cfg)
    return StagePlan(inputs, config, own, _slice_count(store, module, cfg, round, own))


def run_stage(stage: str | ModuleType, run: RunStore | str | Path, round: int, cfg=None,
              force: bool = False) -> StageReport:
    """Run one curation stage on one round of the run (a folder, or the RunStore whose held
    parts it reads and adds to; `cfg`: the stage's CONFIG, default its defaults): plan (inputs,
    config, slices) -> skipped, with the counts of its manifest, when the manifest matches
    (unless `force`) -> read -> transform -> validate -> one commit. A large round is read,
    transformed and written a slice of groups at a time, all in the same commit."""
    started = time.perf_counter()
    module = stage_module(stage)
    name, cfg = module.STAGE, cfg if cfg is not None else module.CONFIG()
    store = run if isinstance(run, RunStore) else RunStore(run)
    main = module.READS[0]
    if not store.files(main, round):
        raise FileNotFoundError(f"run {store.location} has no {main} for round {round}; run {_writer_of(main)} first")
    plan = plan_stage(module, store, round, cfg)
    if not force and store.is_up_to_date(name, round, plan.inputs, plan.config):
        manifest = store.load_manifest(name, round) or {}
        return StageReport(name, round, skipped=True, rows_in=manifest.get("rows_in") or 0,
                           rows_out=manifest.get("rows_out") or 0, drops=manifest.get("drops", {}),
                           seconds=time.perf_counter() - started)
    rows_in = rows_out = 0
    drops: Counter[str] = Counter()
    extra: dict[str, Any] = {}
    with store.commit(name, round, plan.inputs, plan.config) as commit:
        for s, tables in enumerate(_slice_tables(module, store, round, cfg, plan, commit, force)):
            out = _transform(module, tables, cfg)
            part = name if plan.slices == 1 else f"{name}-s{s:04d}"
            for table in module.WRITES:  # validated against the table's contract
                commit.write(table, out.tables[table], part=part, hold=plan.slices == 1)
            rows_in, rows_out = rows_in + out.rows_in, rows_out + out.rows_out
            drops.update(out.drops)
            extra = _merged(extra, out.extra)
            del tables, out
        fault_point("stage.before_commit")
        slices = {"slices": plan.slices} if plan.slices > 1 else {}
        commit.record(rows_in=rows_in, rows_out=rows_out, drops=dict(drops), **slices, **extra)
    return StageReport(name, round, skipped=False, rows_in=rows_in, rows_out=rows_out, drops=dict(drops),
                       seconds=time.perf_counter() - started)


def _slice_tables(module: ModuleType, store: RunStore, round: int, cfg, plan: StagePlan, commit,
                  force: bool) -> Iterator[dict[str, pa.Table]]:
    """The transform's input tables: the round whole (with the stage's `reused_tables` unless
    `force`), or slice by slice (the module docstring's "Memory"): one pass splits each input
    into the slices' Arrow files in the commit's temp folder, then each slice is read alone."""
    prompts = None
    if "prompts" in module.READS:
        prompts = _prompts(store, [rel for rel in plan.inputs if rel.startswith("prompts/")])
    if plan.slices == 1:
        tables = {table: prompts if table == "prompts" else _read(store, table, round, columns, plan.own)
                  for table, columns in module.columns(cfg).items()}
        if not force and hasattr(module, "reused_tables"):
            tables.update(module.reused_tables(store, round, plan.inputs))
        yield tables
        return
    split = {table: _split(store, table, round, columns, plan.own, plan.slices, commit.scratch(f"slices-{table}"))
             for table, columns in module.columns(cfg).items() if table != "prompts"}
    prompt_slice = None if prompts is None else slice_of(prompts.column("prompt_id"), plan.slices)
    for s in range(plan.slices):
        tables = {table: _read_arrow(files[s]) for table, files in split.items()}
        if prompts is not None:
            tables["prompts"] = prompts.filter(pa.array(prompt_slice == s))
        yield tables


def slice_rows() -> int:
    """Main-input rows a stage takes at once: GROUPFORGE_SLICE_ROWS, else DEFAULT_SLICE_ROWS."""
    value = os.environ.get(SLICE_ROWS_ENV, "").strip()
    if not value:
        return DEFAULT_SLICE_ROWS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SLICE_ROWS_ENV}={value!r}: give a whole number of rows >= 1")
    return int(value)


def _slice_count(store: RunStore, module: ModuleType, cfg, round: int, own: tuple[str, ...]) -> int:
    """K: 1, or ceil(rows of the round's main input / slice_rows()) for a sliceable stage (the
    row counts of held parts from memory, of the others from the files' footers)."""
    if hasattr(module, "sliceable") and not module.sliceable(cfg):
        return 1
    table, rows = module.READS[0], 0
    for rel in store.files(table, round):
        if not _own_part(rel, own):
            rows += store.row_count(rel)
    return max(1, math.ceil(rows / slice_rows()))


def slice_of(prompt_ids: pa.Array | pa.ChunkedArray, k: int) -> np.ndarray:
    """The slice (0..k-1) of each row: a hash of its prompt_id, so every row of a group lands in
    the same slice (the same slices for the same ids in one polars version)."""
    return (pl.Series(prompt_ids).hash(seed=0).to_numpy() % k).astype(np.int64)


def _split(store: RunStore, table: str, round: int, columns: list[str] | None, own: tuple[str, ...], k: int,
           folder: Path) -> list[Path]:
    """`columns` of the round's `table` split by slice_of into k Arrow files (lz4) in `folder`,
    read batch by batch: [the file of slice 0, ...]."""
    if columns is None or "prompt_id" not in columns:
        raise ValueError(f"a stage that runs in slices must name the columns it reads of {table!r}, "
                         "prompt_id among them")
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{s:04d}.arrow" for s in range(k)]
    wanted = pa.schema([schema.field_of(table, c) if c in schema.SCHEMAS[table].names
                        else schema.field_of(table, c).with_nullable(True) for c in columns])
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with disk_write(folder), contextlib.ExitStack() as stack:
        writers = [stack.enter_context(pa.ipc.new_file(str(path), wanted, options=options)) for path in files]
        for batch in store.iter_columns(table, columns, round, exclude_parts=_own_parts(store, table, round, own),
                                        batch_rows=SPLIT_BATCH_ROWS):
            ids = slice_of(batch.column("prompt_id"), k)
            ends = np.cumsum(np.bincount(ids, minlength=k))
            batch = batch.take(pa.array(np.argsort(ids, kind="stable")))  # rows of a slice together, in order
            for s, writer in enumerate(writers):
                start = int(ends[s - 1]) if s else 0
                if ends[s] > start:
                    writer.write_table(batch.slice(start, int(ends[s]) - start))
    return files


def _read_arrow(path: Path) -> pa.Table:
    with pa.OSFile(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _merged(total: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Two slices' extra manifest fields as one: numbers add up, dicts merge key by key, and
    anything else must be equal in every slice (a scorer's fingerprints)."""
    out = dict(total)
    for key, value in more.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merged(out[key], value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = round(out[key] + value, 6)
        elif value != out[key]:
            raise RuntimeError(f"slices of one round disagree on manifest field {key!r}: {out[key]!r} vs {value!r}")
    return out


_SLICE_PART = re.compile(r"(?P<stage>.+)-s\d{4}")


def _own_part(rel: str, own: tuple[str, ...]) -> bool:
    """Whether the part file `rel` is one of the stages' `own` (whole or a slice of it)."""
    name = part_name(rel)
    sliced = _SLICE_PART.fullmatch(name)
    return name in own or (sliced is not None and sliced["stage"] in own)


def _own_parts(store: RunStore, table: str, round: int, own: tuple[str, ...]) -> tuple[str, ...]:
    """The part names (`part-<name>-<sha>.parquet`) of `table` in the round that are the stages' `own`."""
    if not own:
        return ()
    return tuple(part_name(rel) for rel in store.files(table, round) if _own_part(rel, own))


def _read(store: RunStore, table: str, round: int, columns: list[str] | None, own: tuple[str, ...]) -> pa.Table:
    """`columns` of the round's `table` (every column, through RunStore.read, when None),
    without the stage's `own` part files; held parts from memory."""
    if columns is None:
        if own:
            raise ValueError(f"a stage that reads its own table {table!r} must name the columns it reads")
        return store.read(table, round)
    return store.read_columns(table, columns, round, exclude_parts=_own_parts(store, table, round, own))


def _files(store: RunStore, table: str, round: int) -> list[str]:
    """The part files of `table` that a stage of `round` reads: the round's; for prompts (not
    partitioned by round) those the round's samples came from (`RunStore.round_prompts`), or
    every part when some samples part of the round does not say (written by another tool)."""
    if table != "prompts":
        return store.files(table, round)
    listed = store.round_prompts(round)
    return store.files("prompts") if listed is None else listed


def _prompts(store: RunStore, rels: list[str]) -> pa.Table:
    """The prompts parts `rels` (those `_files` chose for the round; held ones from memory),
    validated, as `store.read("prompts")` gives them."""
    parts = [store.read_part(rel, "prompts") for rel in rels]
    if not parts:
        return schema.empty("prompts")
    table = pa.concat_tables(parts, promote_options="permissive")
    return schema.validate(table, "prompts", store.where("prompts"))


def _transform(module: ModuleType, tables: dict[str, pa.Table], cfg) -> StageOutput:
    """The stage's transform, which must return one table per name in its WRITES."""
    out = module.transform(tables, cfg)
    if set(out.tables) != set(module.WRITES):
        raise RuntimeError(f"stage {module.STAGE!r} returned tables {sorted(out.tables)}, "
                           f"declared {list(module.WRITES)}")
    return out


def _writer_of(table: str) -> str:
    """The stage that writes `table` (samples: generate)."""
    return next((name for name in CURATION_STAGES if table in stage_module(name).WRITES), "generate")
