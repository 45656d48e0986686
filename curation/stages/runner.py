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

`run_stage` does the rest. The inputs are the part files of READS for the round (prompts:
the parts its samples came from), each fingerprinted; a stage that also reads a table it writes (filter reads
rejects) leaves its own part files out of both its fingerprints and its read, so its own
commit never makes it out of date. A part file is hashed only when no manifest of the round
(nor this process) has hashed its current bytes (`curation.store.fingerprints.known_fingerprint`).
A round without its main input is an error. Only the columns the stage uses are read (a
samples file is mostly token ids the filter never looks at), each file's footer checked
against the contract. Callers hold the run's lock
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from curation import schema
from curation.errors import disk_write
from curation.faults import fault_point
from curation.stages.common import drop_counts
from curation.store.commit import encode_part
from curation.store.fingerprints import FileCache, known_fingerprint
from curation.store.run_store import Held, RunStore, contract_columns, held_entry

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
    written: dict[str, tuple[dict, pa.Table]] = field(default_factory=dict, repr=False, compare=False)
    """What the stage committed ({} when skipped): {relative path: ({sha256, size, mtime_ns},
    table)}, for a caller (the next stage: `held`) that would otherwise read the files back."""


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


def input_fingerprints(store: RunStore, tables: tuple[str, ...], round: int, exclude_parts: tuple[str, ...] = (),
                       recorded: Mapping[str, dict] | None = None) -> dict[str, str]:
    """{relative path: sha256} of every part file of `tables` for `round` (prompts: all
    parts), leaving out the parts named in `exclude_parts`. Files whose hash `recorded`
    ({relative path: {sha256, size, mtime_ns}}; default: what the round's manifests record)
    or this process holds for their size and mtime_ns are not read again."""
    paths = [path for table in tables for path in _files(store, table, round)
             if not _own_part(path, exclude_parts)]
    rel = {path: path.relative_to(store.root).as_posix() for path in paths}
    if recorded is None or not all(rel[path] in recorded for path in paths if path.parent.name != "prompts"):
        recorded = {**store.recorded_files(round), **(recorded or {})}
    digests = {path: known_fingerprint(path, recorded.get(rel[path]), compute=False) for path in paths}
    todo = [path for path, digest in digests.items() if digest is None]
    if len(todo) > 1:  # hashlib lets go of the GIL: files are hashed in parallel
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            digests.update(zip(todo, pool.map(known_fingerprint, todo)))
    elif todo:
        digests[todo[0]] = known_fingerprint(todo[0])
    return {rel[path]: digests[path] for path in paths}


def run_stage(stage: str | ModuleType, run_dir: str | Path, round: int, cfg=None, force: bool = False,
              held: Mapping[str, tuple[dict, pa.Table]] | None = None) -> StageReport:
    """Run one curation stage on one round of the run (`cfg`: the stage's CONFIG, default
    its defaults); skipped, with the counts of its manifest, when the manifest matches the
    inputs and config (unless `force`). `held`: tables earlier stages committed (their
    reports' `written`), used instead of reading those files while size and mtime_ns match."""
    module = stage_module(stage)
    name, cfg = module.STAGE, cfg if cfg is not None else module.CONFIG()
    store = RunStore(run_dir)
    own = (name,) if set(module.READS) & set(module.WRITES) else ()
    inputs = input_fingerprints(store, module.READS, round, exclude_parts=own,
                                recorded={rel: entry for rel, (entry, _) in held.items()} if held else None)
    config = module.hashed_config(cfg) if hasattr(module, "hashed_config") else as_dict(cfg)
    if not force and store.is_up_to_date(name, round, inputs, config):
        manifest = store.load_manifest(name, round) or {}
        return StageReport(name, round, skipped=True, rows_in=manifest.get("rows_in") or 0,
                           rows_out=manifest.get("rows_out") or 0, drops=manifest.get("drops", {}))
    main = module.READS[0]
    if not store.files(main, round):
        raise FileNotFoundError(f"run {store.root} has no {main} for round {round}; run {_writer_of(main)} first")

    slices = _slice_count(store, module, cfg, round, own, held or {})
    if slices > 1:
        return _run_sliced(module, store, round, cfg, inputs, config, own, slices)
    started = time.perf_counter()
    tables = {table: _read(store, table, round, columns, own, held or {}, inputs)
              for table, columns in module.columns(cfg).items()}
    if not force and hasattr(module, "reused_tables"):
        tables.update(module.reused_tables(store, round, inputs))
    out = _transform(module, tables, cfg)
    drops = out.drops
    fault_point("stage.before_commit")
    with store.commit(name, round, inputs, config) as commit:
        for table in module.WRITES:
            commit.write(table, out.tables[table], part=name)  # validated against the table's contract
        commit.record(rows_in=out.rows_in, rows_out=out.rows_out, drops=drops, **out.extra)
    return StageReport(name, round, skipped=False, rows_in=out.rows_in, rows_out=out.rows_out, drops=drops,
                       seconds=time.perf_counter() - started, written=commit.written)


@dataclass
class PreparedStage:
    """A stage's round computed in memory, its commit not yet made (`prepare_stage`)."""

    report: StageReport
    """What run_stage would return, `written` included, whose entries hold each part's
    sha256 and size, and mtime_ns None until `publish` has put the file in place."""
    publish: Callable[[], dict[str, tuple[dict, pa.Table]]]
    """Make the commit (files, then manifest): what run_stage commits, byte for byte. Returns
    the commit's `written` (with mtime_ns). Call it once, in order after the earlier stages'."""


def fresh_round(store: RunStore, round: int, stages: Sequence[str | ModuleType],
                held: Mapping[str, tuple[dict, pa.Table]]) -> bool:
    """Whether `prepare_stage` may run `stages` (in order) on `round`: none of them has a
    manifest or a pending journal for it, every part file the round holds of a table they
    read or write is one `held` has as it is on disk (the round loop: the samples the
    generate stage just committed, or is committing in the background), and no stage would
    take the round in slices."""
    modules = [stage_module(stage) for stage in stages]
    names = {module.STAGE for module in modules}
    for path in store.round_manifests(round) + store.round_manifests(round, ".pending"):
        if path.name.rsplit("-round=", 1)[0] in names:
            return False  # run before: run_stage decides what is up to date
    tables = {table for module in modules for table in (*module.READS, *module.WRITES)} - {"prompts"}
    for table in tables:
        if any(_held(held, store, path) is None for path in store.files(table, round)):
            return False
    main = modules[0].READS[0] if modules else None
    if not any(rel.startswith(f"{main}/round={round}/") for rel in held):
        return False  # the samples are not handed over: run_stage reads (or misses) them
    rows: dict[str, int] = {}
    for rel, (_, part) in held.items():  # on disk as held, or in flight (the generate commit)
        table = rel.split("/", 1)[0]
        if table in tables and rel.startswith(f"{table}/round={round}/"):
            rows[table] = rows.get(table, 0) + part.num_rows
    return all(rows.get(module.READS[0], 0) <= slice_rows() for module in modules)


def prepare_stage(stage: str | ModuleType, store: RunStore, round: int, cfg,
                  held: Mapping[str, tuple[dict, pa.Table]]) -> PreparedStage:
    """run_stage's work on a round `fresh_round` accepted, from the tables in `held` (the
    generate stage's and the earlier stages' outputs, published or not), without a file
    read or written: inputs fingerprinted from their sha256, the transform, and its tables
    validated and encoded. The commit is left to `PreparedStage.publish`, so the round loop
    can go on (train) while a background thread writes (pipelines/loop/steps.py). The
    manifest it writes is the one run_stage would: run_stage afterwards finds it up to date."""
    module = stage_module(stage)
    name = module.STAGE
    own = (name,) if set(module.READS) & set(module.WRITES) else ()
    parts: dict[str, list[tuple[str, pa.Table]]] = {table: [] for table in module.READS}
    for rel in sorted(held):  # as store.files lists them: by name within the round folder
        name_of = rel.split("/", 1)[0]
        if name_of in parts and name_of != "prompts" and not _own_part(Path(rel), own):
            parts[name_of].append((rel, held[rel][1]))
    inputs = {rel: held[rel][0]["sha256"] for found in parts.values() for rel, _ in found}
    prompts_held = sorted(rel for rel in held if rel.startswith("prompts/"))
    if "prompts" in module.READS:  # the parts committed with the round's samples: held with them, or listed
        inputs.update({rel: held[rel][0]["sha256"] for rel in prompts_held} if prompts_held
                      else input_fingerprints(store, ("prompts",), round))
    config = module.hashed_config(cfg) if hasattr(module, "hashed_config") else as_dict(cfg)
    started = time.perf_counter()
    tables = {}
    for table, columns in module.columns(cfg).items():
        if table == "prompts":
            tables[table] = (_joined_prompts(store, [held[rel][1] for rel in prompts_held]) if prompts_held else
                             _prompts(store, [store.root / rel for rel in inputs if rel.startswith("prompts/")]))
        elif columns is None:
            raise ValueError(f"stage {name!r} reads every column of {table!r}: run it with run_stage")
        else:
            tables[table] = _held_columns(table, [part for _, part in parts[table]], columns)
    out = _transform(module, tables, cfg)
    drops = out.drops
    fault_point("stage.before_commit")
    encoded = [part for part in (encode_part(store, name, table, out.tables[table], name, round)
                                 for table in module.WRITES) if part is not None]
    written = {part.rel: part.in_flight() for part in encoded}

    def publish() -> dict[str, tuple[dict, pa.Table]]:
        with store.commit(name, round, inputs, config) as commit:
            for part in encoded:
                commit.put(part)
            commit.record(rows_in=out.rows_in, rows_out=out.rows_out, drops=drops, **out.extra)
        return commit.written

    report = StageReport(name, round, skipped=False, rows_in=out.rows_in, rows_out=out.rows_out, drops=drops,
                         seconds=time.perf_counter() - started, written=written)
    return PreparedStage(report, publish)


def slice_rows() -> int:
    """Main-input rows a stage takes at once: GROUPFORGE_SLICE_ROWS, else DEFAULT_SLICE_ROWS."""
    value = os.environ.get(SLICE_ROWS_ENV, "").strip()
    if not value:
        return DEFAULT_SLICE_ROWS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SLICE_ROWS_ENV}={value!r}: give a whole number of rows >= 1")
    return int(value)


def _slice_count(store: RunStore, module: ModuleType, cfg, round: int, own: tuple[str, ...],
                 held: Mapping[str, tuple[dict, pa.Table]]) -> int:
    """K: 1, or ceil(rows of the round's main input / slice_rows()) for a sliceable stage (the
    row counts come from the tables `held` for the files, else from the files' footers)."""
    if hasattr(module, "sliceable") and not module.sliceable(cfg):
        return 1
    table, rows = module.READS[0], 0
    for path in store.files(table, round):
        if _own_part(path, own):
            continue
        known = _held(held, store, path)
        if known is not None:
            rows += known.num_rows
            continue
        try:
            rows += pq.read_metadata(path).num_rows
        except (pa.ArrowInvalid, OSError):
            schema.read_table_file(path, table)  # raises SchemaError naming the file
            raise
    return max(1, math.ceil(rows / slice_rows()))


def slice_of(prompt_ids: pa.Array | pa.ChunkedArray, k: int) -> np.ndarray:
    """The slice (0..k-1) of each row: a hash of its prompt_id, so every row of a group lands in
    the same slice (the same slices for the same ids in one polars version)."""
    return (pl.Series(prompt_ids).hash(seed=0).to_numpy() % k).astype(np.int64)


def _run_sliced(module: ModuleType, store: RunStore, round: int, cfg, inputs: Mapping[str, str],
                config: Mapping, own: tuple[str, ...], slices: int) -> StageReport:
    """run_stage's transform and commit for a round taken `slices` slices of groups at a time
    (the module docstring's "Memory"): one pass splits each input into the slices' Arrow files
    in the commit's temp folder, then each slice is read, transformed and written on its own."""
    name, started = module.STAGE, time.perf_counter()
    rows_in = rows_out = 0
    drops: Counter[str] = Counter()
    extra: dict[str, Any] = {}
    with store.commit(name, round, inputs, config) as commit:
        split = {table: _split(store, table, round, columns, own, slices, commit.scratch(f"slices-{table}"))
                 for table, columns in module.columns(cfg).items() if table != "prompts"}
        prompts = (_prompts(store, [store.root / rel for rel in inputs if rel.startswith("prompts/")])
                   if "prompts" in module.READS else None)
        prompt_slice = None if prompts is None else slice_of(prompts.column("prompt_id"), slices)
        for s in range(slices):
            tables = {table: _read_arrow(files[s]) for table, files in split.items()}
            if prompts is not None:
                tables["prompts"] = prompts.filter(pa.array(prompt_slice == s))
            out = _transform(module, tables, cfg)
            for table in module.WRITES:
                commit.write(table, out.tables[table], part=f"{name}-s{s:04d}", hold=False)
            rows_in, rows_out = rows_in + out.rows_in, rows_out + out.rows_out
            drops.update(out.drops)
            extra = _merged(extra, out.extra)
            del tables, out
        fault_point("stage.before_commit")
        commit.record(rows_in=rows_in, rows_out=rows_out, drops=dict(drops), slices=slices, **extra)
    return StageReport(name, round, skipped=False, rows_in=rows_in, rows_out=rows_out, drops=dict(drops),
                       seconds=time.perf_counter() - started)


def _split(store: RunStore, table: str, round: int, columns: list[str] | None, own: tuple[str, ...], k: int,
           folder: Path) -> list[Path]:
    """`columns` of the round's `table` split by slice_of into k Arrow files (lz4) in `folder`,
    read batch by batch: [the file of slice 0, ...]."""
    if columns is None or "prompt_id" not in columns:
        raise ValueError(f"a stage that runs in slices must name the columns it reads of {table!r}, "
                         "prompt_id among them")
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{s:04d}.arrow" for s in range(k)]
    wanted = pa.schema([schema.SCHEMAS[table].field(c) for c in columns])
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


def _own_part(path: Path, own: tuple[str, ...]) -> bool:
    """Whether the part file at `path` is one of the stages' `own` (whole or a slice of it)."""
    name = path.stem.removeprefix("part-")
    sliced = _SLICE_PART.fullmatch(name)
    return name in own or (sliced is not None and sliced["stage"] in own)


def _own_parts(store: RunStore, table: str, round: int, own: tuple[str, ...]) -> tuple[str, ...]:
    """The part names (`part-<name>.parquet`) of `table` in the round that are the stages' `own`."""
    if not own:
        return ()
    return tuple(path.stem.removeprefix("part-") for path in store.files(table, round) if _own_part(path, own))


def _read(store: RunStore, table: str, round: int, columns: list[str] | None, own: tuple[str, ...],
          held: Mapping[str, tuple[dict, pa.Table]], inputs: Mapping[str, str]) -> pa.Table:
    """`columns` of the round's `table` (every column, through RunStore.read, when None;
    prompts: the parts fingerprinted in `inputs`), without the stage's `own` part files; from
    `held` when it has every part file as it is on disk now."""
    if columns is None:
        if own:
            raise ValueError(f"a stage that reads its own table {table!r} must name the columns it reads")
        if table == "prompts":
            return _prompts(store, [store.root / rel for rel in inputs if rel.startswith("prompts/")])
        return store.read(table, round)
    if table == "prompts":
        raise ValueError("a stage reads every column of the prompts table")
    paths = [path for path in store.files(table, round) if not _own_part(path, own)]
    known = [_held(held, store, path) for path in paths]
    if all(part is not None for part in known):
        return _held_columns(table, known, columns)
    return store.read_columns(table, columns, round, exclude_parts=_own_parts(store, table, round, own))


def _files(store: RunStore, table: str, round: int) -> list[Path]:
    """The part files of `table` that a stage of `round` reads: the round's; for prompts (not
    partitioned by round) those the round's samples came from (`RunStore.round_prompts`), or
    every part when some samples part of the round does not say (written by another tool)."""
    if table != "prompts":
        return store.files(table, round)
    listed = store.round_prompts(round)
    return store.files("prompts") if listed is None else listed


def _held(held: Held, store: RunStore, path: Path) -> pa.Table | None:
    """The table held for `path` (`curation.store.run_store.held_entry`)."""
    entry = held_entry(held, store.root, path)
    return None if entry is None else entry[1]


_PROMPT_PARTS: FileCache[pa.Table] = FileCache()  # prompts parts this process read, validated


def _prompts(store: RunStore, paths: list[Path]) -> pa.Table:
    """The prompts parts at `paths` (those `_files` chose for the round), validated, as
    `store.read("prompts")` gives them. A part this process read before (same size and
    mtime_ns) is not read again: rounds can share one."""
    return _joined_prompts(store, [_PROMPT_PARTS.get(path, lambda path=path: schema.read_table_file(path, "prompts"))
                                   for path in paths])


def _joined_prompts(store: RunStore, parts: list[pa.Table]) -> pa.Table:
    """Prompts parts as one validated table, as `store.read("prompts")` gives them."""
    if not parts:
        return schema.empty("prompts")
    table = pa.concat_tables(parts, promote_options="permissive")
    return schema.validate(table, "prompts", store.table_glob("prompts"))


def _held_columns(table: str, parts: list[pa.Table], columns: list[str]) -> pa.Table:
    """`columns` of a table's parts held in memory, as one table (none at all: the empty table,
    e.g. rejects of a round without drops)."""
    return pa.concat_tables([contract_columns(table, part, columns) for part in parts or [schema.empty(table)]])


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
