"""Benchmark: a run's tables as plain Parquet files, Delta Lake (deltalake) or Apache Iceberg (pyiceberg).

    .venv/bin/python bench/table_format.py           # ~10 min on 2 shared cores (more when they are busy)
    .venv/bin/python bench/table_format.py --quick   # ~3 min: fewer rounds, repeats and rows
    .venv/bin/python bench/table_format.py --append  # also append the section to BENCHMARKS.md

Needs the `bench` extra (pyiceberg with its SQL catalog, polars-iceberg): `pip install -e ".[bench]"`.
Writes runs/bench/table_format.md (the section) and runs/bench/table_format.json (every timing).

One run measures every format side by side, on local disk and on an S3-compatible endpoint
(a moto server this script starts on 127.0.0.1 and stops at the end), and reports each figure
as a ratio to plain Parquet measured in the same run (the machine is shared: compare ratios):

    parquet   the baseline: one zstd file per round, RUN/<table>/round=<n>/part-0.parquet with
              the round column inside (groupforge's layout), a small JSON manifest per commit;
              a replaced round is the file written again (an atomic rename on disk, one PUT on S3)
    delta     deltalake (delta-rs), partitioned by round, zstd; a commit is write_deltalake by
              URI (the table opened from its log each time); on S3 with conditional_put=etag
    delta-cp10  the same with delta.checkpointInterval = 10 (delta-rs's default is 100)
    iceberg   pyiceberg's SQL catalog (a SQLite file on local disk, also for the S3 tables:
              the catalog lives outside the object store) with pyarrow's FileIO, identity
              partition on round, zstd; a commit is catalog.load_table + append

The table is samples-like: round int64, prompt_id string (64 hex), sample_idx int32, response
string (~200 characters), token_ids list<int32> and logprobs list<float> (40-80 each), reward
float64; 512 rows a round (8 samples of 64 prompts), and 8,192 in the larger-round case.

Measured: a round's commit (medians over windows of 5 commits, so growth with the table's log or
metadata shows: commits 2-6, the last 5 of --rounds, either side of delta-rs's default checkpoint
at commit 101, the last 5 of --long; then 5 more through a table handle held open, as a long-lived
loop would hold it), the log / metadata files after --long commits, one round replaced by a rerun
of its stage (Delta overwrite with predicate `round = n`, Iceberg overwrite
with a filter), reads of the whole table and of one round with each format's own reader,
Polars (scan_parquet / scan_delta / scan_iceberg), a pyarrow dataset and DuckDB over that
dataset (DuckDB's delta / iceberg / httpfs extensions are downloaded at first use: where they
cannot be, this is the way DuckDB reads these tables), time travel (the table as of an earlier
commit), our own JSON on a commit read back, two processes committing to the same table version
on the S3 endpoint, and a 1M-row write and read. Medians of --repeats, formats interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.dataset as pads  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

OUT = ROOT / "runs" / "bench"
# delta-cp10: Delta with a checkpoint every 10 commits instead of delta-rs's 100: a reader or a writer that
# opens the table replays the JSON commits since the last checkpoint, one GET each on object storage
FORMATS = ("parquet", "delta", "delta-cp10", "iceberg")
ONE_COMMIT = ("parquet", "delta", "iceberg")  # where a table holds a few commits, delta-cp10 is delta
BUCKET = "groupforge-bench"
CREDENTIALS = {"key": "testing", "secret": "testing", "region": "us-east-1"}
SCHEMA = pa.schema([
    ("round", pa.int64()), ("prompt_id", pa.string()), ("sample_idx", pa.int32()), ("response", pa.string()),
    ("token_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())), ("reward", pa.float64()),
])
WORDS = ("the answer is so we add carry one two three four five six seven eight nine ten step then "
         "check sum digit result first second next total equals plus minus because therefore").split()


# -- data


class Rows:
    """Samples-like rounds, the same for every format (seeded)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        pool = []
        while len(pool) < 4096:
            words = self.rng.choice(WORDS, size=int(self.rng.integers(30, 50)))
            pool.append(" ".join(words)[: int(self.rng.integers(170, 230))])
        self.pool = pa.array(pool, pa.string())

    def million(self, rows: int) -> pa.Table:
        """One large round, made once (the same for both storages)."""
        if getattr(self, "_million", None) is None or self._million.num_rows != rows:
            self._million = self.round(0, rows)
        return self._million

    def round(self, round: int, rows: int, reward: float | None = None) -> pa.Table:
        rng, prompts = self.rng, (rows + 7) // 8
        ids = np.frombuffer(rng.bytes(32 * prompts), dtype=np.uint8).reshape(prompts, 32)
        prompt_ids = pa.array([row.tobytes().hex() for row in ids], pa.string()).take(np.arange(rows) // 8)
        lengths = rng.integers(40, 81, rows)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        total = int(lengths.sum())
        tokens = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 32000, total, dtype=np.int32)))
        logprobs = pa.ListArray.from_arrays(offsets, pa.array(-rng.exponential(0.3, total).astype(np.float32)))
        rewards = np.full(rows, reward) if reward is not None else rng.random(rows)
        return pa.Table.from_arrays([
            pa.array(np.full(rows, round, dtype=np.int64)), prompt_ids,
            pa.array((np.arange(rows) % 8).astype(np.int32)),
            self.pool.take(rng.integers(0, len(self.pool), rows)), tokens, logprobs, pa.array(rewards),
        ], schema=SCHEMA)


# -- storage


@dataclass
class Storage:
    """Where the tables live: a local folder, or s3://BUCKET/<prefix> on the moto endpoint."""

    name: str  # "local" or "s3"
    root: str  # a local folder, or s3://bucket/prefix
    catalog_dir: str  # local folder of the Iceberg SQL catalogs (SQLite files)
    endpoint: str = ""

    def uri(self, table: str) -> str:
        return f"{self.root}/{table}"

    def path(self, table: str) -> str:
        """The table's path for `fs()` (no scheme on S3)."""
        return self.uri(table).removeprefix("s3://")

    def fs(self) -> pafs.FileSystem:
        if self.name == "local":
            return pafs.LocalFileSystem()
        return pafs.S3FileSystem(access_key=CREDENTIALS["key"], secret_key=CREDENTIALS["secret"],
                                 region=CREDENTIALS["region"], endpoint_override=self.endpoint, scheme="http")

    def delta_options(self, conditional_put: bool = True) -> dict[str, str] | None:
        if self.name == "local":
            return None
        options = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
                   "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"], "AWS_REGION": CREDENTIALS["region"],
                   "AWS_ALLOW_HTTP": "true"}
        return {**options, "conditional_put": "etag"} if conditional_put else options

    def polars_options(self) -> dict[str, str] | None:
        if self.name == "local":
            return None
        return {"aws_endpoint_url": self.endpoint, "aws_access_key_id": CREDENTIALS["key"],
                "aws_secret_access_key": CREDENTIALS["secret"], "aws_region": CREDENTIALS["region"],
                "aws_allow_http": "true"}

    def iceberg_properties(self) -> dict[str, str]:
        props = {"py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}
        if self.name == "s3":
            props.update({"s3.endpoint": self.endpoint, "s3.access-key-id": CREDENTIALS["key"],
                          "s3.secret-access-key": CREDENTIALS["secret"], "s3.region": CREDENTIALS["region"]})
        return props

    def warehouse(self) -> str:
        """The Iceberg catalog's warehouse: its tables' default locations are below it."""
        return self.root + "/iceberg" if self.name == "s3" else f"file://{self.root}/iceberg"

    def delete(self, path: str) -> None:
        try:
            self.fs().delete_dir(path)
        except (FileNotFoundError, OSError):
            pass

    def listing(self, path: str) -> list[pafs.FileInfo]:
        infos = self.fs().get_file_info(pafs.FileSelector(path, recursive=True))
        return [info for info in infos if info.type == pafs.FileType.File]


class Moto:
    """moto_server on a free port of 127.0.0.1, with the bench's bucket. `log`: a file that
    takes the server's request log (a line per HTTP request), for benches that count them."""

    def __init__(self, log: Path | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("moto_server")
        sink = open(log, "ab") if log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1",
                                          "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=sink)
        finally:
            if log:
                sink.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}") from None
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["region"],
                     aws_access_key_id=CREDENTIALS["key"],
                     aws_secret_access_key=CREDENTIALS["secret"]).create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def use_endpoint(endpoint: str) -> None:
    """Environment for libraries that read it (and keep every client off real AWS)."""
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": CREDENTIALS["key"],
                       "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"], "AWS_REGION": CREDENTIALS["region"],
                       "AWS_DEFAULT_REGION": CREDENTIALS["region"], "AWS_ALLOW_HTTP": "true",
                       "AWS_EC2_METADATA_DISABLED": "true"})


# -- formats: one table each, the same operations


class ParquetTable:
    """The baseline: one file per round (the round column inside), a JSON manifest per commit."""

    kind = "parquet"

    def __init__(self, storage: Storage, table: str):
        self.storage, self.table, self.fs, self.path = storage, table, storage.fs(), storage.path(table)

    def create(self) -> None:
        pass

    def location(self) -> str:
        return self.path

    def _write(self, data: pa.Table, round: int, meta: dict) -> None:
        folder = f"{self.path}/round={round}"
        final = f"{folder}/part-0.parquet"
        if self.storage.name == "local":  # atomic: write aside, rename into place (as groupforge's commits)
            self.fs.create_dir(folder, recursive=True)
            self.fs.create_dir(f"{self.path}/_manifests", recursive=True)
            pq.write_table(data, final + ".tmp", filesystem=self.fs, compression="zstd")
            self.fs.move(final + ".tmp", final)
        else:  # one PUT is atomic on S3
            pq.write_table(data, final, filesystem=self.fs, compression="zstd")
        with self.fs.open_output_stream(f"{self.path}/_manifests/{meta['stage']}-round={round}.json") as f:
            f.write(json.dumps(meta).encode())

    def open(self) -> None:
        return None  # no handle: every commit is its own

    def append(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        self._write(data, round, meta)

    def replace(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        self._write(data, round, meta)

    def dataset(self, round: int | None = None) -> pads.Dataset:
        where = self.path if round is None else f"{self.path}/round={round}"
        return pads.dataset(where, filesystem=self.fs, format="parquet", partitioning=None)

    def read(self, round: int | None = None) -> pa.Table:
        return self.dataset(round).to_table()

    def polars(self, round: int | None = None):
        import polars as pl

        glob = f"{self.storage.uri(self.table)}/round={'*' if round is None else round}/*.parquet"
        return pl.scan_parquet(glob, hive_partitioning=False, storage_options=self.storage.polars_options()).collect()

    def meta(self) -> list[dict]:
        infos = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/_manifests"))
        out = []
        for info in infos:
            with self.fs.open_input_stream(info.path) as f:
                out.append(json.loads(f.read()))
        return out


class DeltaLakeTable:
    kind = "delta"

    def __init__(self, storage: Storage, table: str, conditional_put: bool = True, checkpoint_every: int | None = None):
        from deltalake import WriterProperties

        self.storage, self.table, self.uri = storage, table, storage.uri(table)
        self.options = storage.delta_options(conditional_put)
        self.writer = WriterProperties(compression="ZSTD")
        # delta-rs writes a checkpoint every delta.checkpointInterval commits (100 unless set)
        self.configuration = {"delta.checkpointInterval": str(checkpoint_every)} if checkpoint_every else None
        self.kind = "delta" if checkpoint_every is None else f"delta-cp{checkpoint_every}"

    def create(self) -> None:
        pass  # the first write creates it, with self.configuration

    def open(self, version: int | None = None):
        from deltalake import DeltaTable

        return DeltaTable(self.uri, version=version, storage_options=self.options)

    def location(self) -> str:
        return self.storage.path(self.table)

    def _write(self, target, data: pa.Table, meta: dict, **kwargs) -> None:
        from deltalake import CommitProperties, write_deltalake

        write_deltalake(self.uri if target is None else target, data, partition_by=["round"],
                        storage_options=self.options, writer_properties=self.writer, configuration=self.configuration,
                        commit_properties=CommitProperties(custom_metadata={"groupforge": meta}), **kwargs)

    def append(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        self._write(target, data, meta, mode="append")

    def replace(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        self._write(target, data, meta, mode="overwrite", predicate=f"round = {round}")

    def version(self) -> int:
        return self.open().version()

    def dataset(self, round: int | None = None) -> pads.Dataset:
        table = self.open()
        if round is None:
            return table.to_pyarrow_dataset()
        return table.to_pyarrow_dataset(file_pruning_predicate=f"round = {round}")

    def read(self, round: int | None = None, version: int | None = None) -> pa.Table:
        table = self.open(version)
        return table.to_pyarrow_table() if round is None else table.to_pyarrow_table(filters=[("round", "=", round)])

    def polars(self, round: int | None = None, version: int | None = None):
        import polars as pl

        frame = pl.scan_delta(self.uri, version=version, storage_options=self.options)
        return (frame if round is None else frame.filter(pl.col("round") == round)).collect()

    def meta(self) -> list[dict]:
        return [entry["groupforge"] for entry in reversed(self.open().history()) if "groupforge" in entry]


class IcebergTable:
    kind = "iceberg"

    def __init__(self, storage: Storage, table: str):
        from pyiceberg.catalog.sql import SqlCatalog

        self.storage, self.ident = storage, f"run.{table.replace('-', '_')}"
        self.catalog = SqlCatalog("bench", uri=f"sqlite:///{storage.catalog_dir}/catalog-{storage.name}.db",
                                  warehouse=storage.warehouse(), **storage.iceberg_properties())
        self.fs = storage.fs()

    def create(self) -> None:
        self.catalog.create_namespace_if_not_exists("run")
        table = self.catalog.create_table(self.ident, schema=SCHEMA,
                                          properties={"write.parquet.compression-codec": "zstd"})
        with table.update_spec() as spec:  # a PartitionSpec needs field ids, which an Arrow schema lacks
            spec.add_identity("round")

    def open(self):
        return self.catalog.load_table(self.ident)

    def location(self) -> str:
        return self.open().location().removeprefix("s3://").removeprefix("file://")

    def append(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        (self.open() if target is None else target).append(data, snapshot_properties={"groupforge": json.dumps(meta)})

    def replace(self, data: pa.Table, round: int, meta: dict, target=None) -> None:
        from pyiceberg.expressions import EqualTo

        (self.open() if target is None else target).overwrite(
            data, overwrite_filter=EqualTo("round", round), snapshot_properties={"groupforge": json.dumps(meta)})

    def version(self) -> int:
        return self.open().current_snapshot().snapshot_id

    def _scan(self, round: int | None, version: int | None):
        from pyiceberg.expressions import AlwaysTrue, EqualTo

        return self.open().scan(row_filter=AlwaysTrue() if round is None else EqualTo("round", round),
                                snapshot_id=version)

    def dataset(self, round: int | None = None) -> pads.Dataset:
        """The data files a scan plans (no delete files here: pyiceberg's overwrites copy on write)."""
        files = [task.file.file_path.removeprefix("s3://").removeprefix("file://")
                 for task in self._scan(round, None).plan_files()]
        return pads.dataset(files, filesystem=self.fs, format="parquet", partitioning=None)

    def read(self, round: int | None = None, version: int | None = None) -> pa.Table:
        return self._scan(round, version).to_arrow()

    def polars(self, round: int | None = None, version: int | None = None):
        import polars as pl

        frame = pl.scan_iceberg(self.open(), snapshot_id=version)
        return (frame if round is None else frame.filter(pl.col("round") == round)).collect()

    def meta(self) -> list[dict]:
        return [json.loads(snapshot.summary["groupforge"]) for snapshot in self.open().snapshots()
                if "groupforge" in snapshot.summary.additional_properties]


def make(kind: str, storage: Storage, table: str):
    if kind.startswith("delta-cp"):
        return DeltaLakeTable(storage, table, checkpoint_every=int(kind.removeprefix("delta-cp")))
    return {"parquet": ParquetTable, "delta": DeltaLakeTable, "iceberg": IcebergTable}[kind](storage, table)


# -- measurements


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def med(values: list[float]) -> float:
    return statistics.median(values)


def meta_for(stage: str, round: int) -> dict:
    return {"stage": stage, "round": round, "inputs": {"prompts": f"sha256:{round:064x}"},
            "config_fingerprint": "sha256:" + "ab" * 32}


_DUCKDB = None


def duckdb_read(dataset: pads.Dataset, round: int | None) -> pa.Table:
    global _DUCKDB
    import duckdb

    if _DUCKDB is None:
        _DUCKDB = duckdb.connect()
    _DUCKDB.register("t", dataset)
    sql = "SELECT * FROM t" + ("" if round is None else f" WHERE round = {round}")
    out = _DUCKDB.sql(sql).fetch_arrow_table()
    _DUCKDB.unregister("t")
    return out


READERS = {
    "own": lambda t, r: t.read(r),
    "polars": lambda t, r: t.polars(r),
    "pyarrow dataset": lambda t, r: t.dataset(r).to_table(),
    "duckdb": lambda t, r: duckdb_read(t.dataset(r), r),
}


def commit_rounds(tables: dict, rows: Rows, first: int, last: int, per_round: int, times: dict, log,
                  held: dict | None = None) -> None:
    """Append rounds first..last-1 to every table, the formats interleaved; times[kind] gets each commit.
    With `held`, through those table handles (a long-lived process) instead of opening each table."""
    for r in range(first, last):
        for kind, table in tables.items():
            data = rows.round(r, per_round)
            target = (held or {}).get(kind)
            seconds, _ = timed(lambda table=table, data=data, r=r, target=target:
                               table.append(data, r, meta_for("generate", r), target=target))
            times[kind].append(seconds)
        if (r + 1) % 20 == 0:
            log(f"  {r + 1} rounds committed: " + ", ".join(f"{k} {1000 * v[-1]:.0f} ms" for k, v in times.items()))


def reads(tables: dict, readers: tuple[str, ...], round: int, repeats: int, expect_all: int,
          expect_round: int, whole: tuple[str, ...] | None = None) -> dict:
    """{reader: {"all"|"round": {kind: [seconds]}}}, formats and readers interleaved per repeat; the
    whole table only with the readers in `whole` (default: all of them; none: one round only)."""
    out = {reader: {"all": {k: [] for k in tables}, "round": {k: [] for k in tables}} for reader in readers}
    for reader in readers:  # untimed: the first call of a reader loads its code and starts its threads
        for table in tables.values():
            READERS[reader](table, round)
    for _ in range(repeats):
        for reader in readers:
            for which, r, expect in (("all", None, expect_all), ("round", round, expect_round)):
                if which == "all" and whole is not None and reader not in whole:
                    continue
                for kind, table in tables.items():
                    seconds, got = timed(lambda table=table, r=r, reader=reader: READERS[reader](table, r))
                    if len(got) != expect:
                        raise AssertionError(f"{kind} {reader} {which}: {len(got)} rows, expected {expect}")
                    out[reader][which][kind].append(seconds)
    return out


def metadata_size(table) -> dict:
    """Files and bytes of the table's log / metadata (not its data files)."""
    marker = {"parquet": "/_manifests/", "iceberg": "/metadata/"}.get(table.kind, "/_delta_log/")
    files = [info for info in table.storage.listing(table.location()) if marker in info.path]
    return {"files": len(files), "bytes": sum(info.size for info in files)}


def storage_run(storage: Storage, args, rows: Rows, log) -> dict:
    res: dict = {}
    tables = {kind: make(kind, storage, f"samples-{kind}") for kind in FORMATS}
    for table in tables.values():
        table.create()
    commits = {kind: [] for kind in FORMATS}
    log(f"[{storage.name}] {args.rounds} rounds of {args.round_rows} rows")
    commit_rounds(tables, rows, 0, args.rounds, args.round_rows, commits, log)

    log(f"[{storage.name}] reads of {args.rounds} rounds")
    res["reads"] = reads(tables, tuple(READERS), args.rounds // 2, args.repeats, args.rounds * args.round_rows,
                         args.round_rows)

    # time travel to the table as of commit k (k = half the rounds): its first k rounds
    k = args.rounds // 2
    log(f"[{storage.name}] time travel to commit {k}")
    iceberg_k = tables["iceberg"].open().snapshots()[k - 1].snapshot_id
    as_of = {kind: (iceberg_k if kind == "iceberg" else k - 1) for kind in FORMATS if kind != "parquet"}
    floor = [f"{tables['parquet'].path}/round={r}/part-0.parquet" for r in range(k)]
    travel = {"parquet": {"own": [], "polars": []}, **{kind: {"own": [], "polars": []} for kind in as_of}}
    for _ in range(args.repeats):
        seconds, got = timed(lambda: pads.dataset(floor, filesystem=tables["parquet"].fs, format="parquet").to_table())
        travel["parquet"]["own"].append(seconds)
        travel["parquet"]["polars"].append(seconds)
        for kind, version in as_of.items():
            for reader, fn in (("own", tables[kind].read), ("polars", tables[kind].polars)):
                seconds, got = timed(lambda fn=fn, version=version: fn(version=version))
                if len(got) != k * args.round_rows:
                    raise AssertionError(f"time travel {kind} {reader}: {len(got)} rows, not {k * args.round_rows}")
                travel[kind][reader].append(seconds)
    res["time_travel"] = {"commit": k, "times": travel}

    # our JSON on every commit, read back
    metas = {kind: table.meta() for kind, table in tables.items()}
    res["commit_meta"] = {kind: {"commits_with_meta": len(m), "first": m[0] if m else None,
                                 "round_trips": bool(m) and m[0] == meta_for("generate", 0)}
                          for kind, m in metas.items()}

    log(f"[{storage.name}] commits {args.rounds + 1}-{args.long} (the log / metadata grows)")
    commit_rounds(tables, rows, args.rounds, args.long, args.round_rows, commits, log)
    res["commit_times"] = commits
    res["metadata_size"] = {kind: metadata_size(table) for kind, table in tables.items()}

    log(f"[{storage.name}] reads of {args.long} rounds")
    res["reads_late"] = reads(tables, ("own", "polars"), args.long - 10, args.late_repeats,
                              args.long * args.round_rows, args.round_rows, whole=())

    log(f"[{storage.name}] {args.held} commits through a held table handle")
    held = {kind: table.open() for kind, table in tables.items()}
    held_times = {kind: [] for kind in FORMATS}
    commit_rounds(tables, rows, args.long, args.long + args.held, args.round_rows, held_times, log, held=held)
    res["held_commit_times"] = held_times
    total_rounds = args.long + args.held

    # a rerun of a stage replaces one round (reward -1 marks the new rows)
    log(f"[{storage.name}] replace one round x{args.replace_repeats}")
    before = {kind: tables[kind].version() for kind in FORMATS if kind != "parquet"}
    replace = {kind: [] for kind in FORMATS}
    replaced = set()
    for rep in range(args.replace_repeats):
        r = (37 * rep + 3) % total_rounds
        replaced.add(r)
        for kind, table in tables.items():
            data = rows.round(r, args.round_rows, reward=-1.0)
            seconds, _ = timed(lambda table=table, data=data, r=r: table.replace(data, r, meta_for("generate", r)))
            replace[kind].append(seconds)
    res["replace_times"] = replace
    checks = {}
    for kind, version in before.items():  # the replaced rows now; the originals as of before the replaces
        now, old = tables[kind].read(), tables[kind].read(version=version)
        checks[kind] = {"rows": now.num_rows, "replaced_rows_now": pc.sum(pc.equal(now["reward"], -1.0)).as_py(),
                        "replaced_rows_before": pc.sum(pc.equal(old["reward"], -1.0)).as_py() or 0,
                        "rows_before": old.num_rows}
        if checks[kind]["replaced_rows_now"] != len(replaced) * args.round_rows \
                or checks[kind]["replaced_rows_before"] != 0 or now.num_rows != total_rounds * args.round_rows:
            raise AssertionError(f"{kind} replace / time travel check failed: {checks[kind]}")
    res["replace_checks"] = checks
    for table in tables.values():
        storage.delete(table.location())

    log(f"[{storage.name}] {args.big_rounds} commits of {args.big_round_rows} rows")
    big = {kind: make(kind, storage, f"big-{kind}") for kind in ONE_COMMIT}
    for table in big.values():
        table.create()
    big_times = {kind: [] for kind in ONE_COMMIT}
    commit_rounds(big, rows, 0, args.big_rounds + 1, args.big_round_rows, big_times, log)
    res["big_commit_times"] = {kind: times[1:] for kind, times in big_times.items()}  # the first creates the table
    for table in big.values():
        storage.delete(table.location())

    log(f"[{storage.name}] {args.million:,} rows in one commit, written and read")
    data = rows.million(args.million)
    million, big_tables = {}, {}
    for kind in ONE_COMMIT:
        table = big_tables[kind] = make(kind, storage, f"million-{kind}")
        table.create()
        write, _ = timed(lambda table=table: table.append(data, 0, meta_for("curate", 0)))
        size = sum(info.size for info in storage.listing(table.location()))
        million[kind] = {"write": write, "bytes": size}
    big_tables["parquet"].read()  # untimed: the process's first read of this size pays for its memory
    for kind, table in big_tables.items():
        seconds, got = timed(lambda table=table: table.read())
        if len(got) != args.million:
            raise AssertionError(f"{kind} 1M read: {len(got)} rows")
        million[kind]["read"] = seconds
        del got
    for table in big_tables.values():
        storage.delete(table.location())
    res["million"] = million
    return res


# -- two writers at once


def race_worker(job: dict) -> None:
    """One of two processes: open the table, say ready, wait for go, commit; print the outcome."""
    storage = Storage(**job["storage"])
    use_endpoint(storage.endpoint)
    kind, action, who = job["kind"], job["action"], job["who"]
    if kind == "delta":
        table = DeltaLakeTable(storage, job["table"], conditional_put=job.get("conditional_put", True))
    else:
        table = make(kind, storage, job["table"])
    data = Rows(seed=10 + who).round(job["round"], job["rows"], reward=float(who))
    target = table.open()  # both processes hold the same version (plain Parquet: no handle)
    Path(job["ready"]).touch()
    while not Path(job["go"]).exists():
        time.sleep(0.002)
    start = time.perf_counter()
    try:
        getattr(table, action)(data, job["round"], meta_for(f"race-{who}", job["round"]), target=target)
        outcome = {"who": who, "ok": True}
    except Exception as e:  # the outcome is the measurement
        outcome = {"who": who, "ok": False, "error": type(e).__name__, "message": str(e).strip().splitlines()[0][:240]}
    outcome["seconds"] = time.perf_counter() - start
    print(json.dumps(outcome), flush=True)


def race(storage: Storage, kind: str, action: str, rows: int, scratch: Path, conditional_put: bool = True) -> dict:
    """Two processes commit `action` (append a round, or replace round 0) to the same version."""
    name = f"race-{kind}-{action}" + ("" if conditional_put else "-nocp")
    table = DeltaLakeTable(storage, name, conditional_put) if kind == "delta" else make(kind, storage, name)
    table.create()
    table.append(Rows(seed=5).round(0, rows), 0, meta_for("generate", 0))
    procs = []
    job = {"storage": asdict(storage), "kind": kind, "table": name, "action": action, "rows": rows,
           "round": 1 if action == "append" else 0, "go": str(scratch / f"{name}.go"),
           "conditional_put": conditional_put}
    for who in (1, 2):
        ready = scratch / f"{name}-{who}.ready"
        procs.append((ready, subprocess.Popen(
            [sys.executable, __file__, "--race-worker", json.dumps({**job, "who": who, "ready": str(ready)})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    deadline = time.monotonic() + 120
    while not all(ready.exists() for ready, _ in procs):
        if time.monotonic() > deadline or any(p.poll() is not None for _, p in procs):
            raise RuntimeError(f"race {name}: a worker did not get ready")
        time.sleep(0.01)
    Path(job["go"]).touch()
    outcomes = []
    for _, p in procs:
        stdout, stderr = p.communicate(timeout=120)
        outcome = json.loads(stdout.strip().splitlines()[-1])
        outcome["retries_logged"] = stderr.count("retrying")  # pyiceberg logs each retry of a commit
        outcomes.append(outcome)
    final = table.read() if kind != "parquet" else table.dataset().to_table()
    rewards = pc.value_counts(final.filter(pc.equal(final["round"], job["round"]))["reward"]).to_pylist()
    return {"kind": kind, "action": action, "conditional_put": conditional_put, "outcomes": outcomes,
            "rows": final.num_rows, "round_rewards": {str(v["values"]): v["counts"] for v in rewards}}


# -- report


def cells(values: dict[str, float | None], kinds: tuple[str, ...] = FORMATS, scale: float = 1000,
          unit: str = "ms") -> list[str]:
    """Each format's figure, and its ratio to plain Parquet's."""
    base, digits = values["parquet"], 2 if unit == "s" else 1
    out = []
    for kind in kinds:
        v = values.get(kind)
        if v is None:
            out.append("–")
        elif kind == "parquet":
            out.append(f"{scale * v:,.{digits}f} {unit}")
        else:
            out.append(f"{scale * v:,.{digits}f} {unit} ({v / base:.2f}x)")
    return out


def windows(args) -> list[tuple[int, int]]:
    """Windows of 5 commits (1-based, inclusive): early, the end of --rounds, either side of delta-rs's
    default checkpoint (version 100 = commit 101), the end of --long."""
    out = [(2, 6), (args.rounds - 4, args.rounds)]
    if args.long >= 106:
        out += [(96, 100), (102, 106)]
    out.append((args.long - 4, args.long))
    return sorted(set(out))


def rows_for(storage: str, res: dict, args) -> list[list[str]]:
    rows = []
    ct = res["commit_times"]
    for lo, hi in windows(args):
        rows.append([storage, f"commit a round of {args.round_rows} rows, commits {lo}-{hi}",
                     *cells({k: med(ct[k][lo - 1:hi]) for k in FORMATS})])
    rows.append([storage, f"commit a round of {args.round_rows} rows, commits {args.long + 1}-{args.long + args.held}, "
                          "table handle held", *cells({k: med(res["held_commit_times"][k]) for k in FORMATS})])
    rows.append([storage, f"commit a round of {args.big_round_rows:,} rows (median of {args.big_rounds})",
                 *cells({k: med(res["big_commit_times"][k]) for k in ONE_COMMIT})])
    rows.append([storage, f"replace one round of {args.round_rows} rows, at {args.long + args.held} commits",
                 *cells({k: med(res["replace_times"][k]) for k in FORMATS})])
    for reader in READERS:
        for which, label in (("all", f"read all {args.rounds} rounds"), ("round", f"read one round of {args.rounds}")):
            rows.append([storage, f"{label}: {reader}",
                         *cells({k: med(res["reads"][reader][which][k]) for k in FORMATS})])
    for reader in ("own", "polars"):
        for which, label in (("all", f"read all {args.long} rounds"), ("round", f"read one round of {args.long}")):
            if not res["reads_late"][reader][which]["parquet"]:
                continue
            rows.append([storage, f"{label}: {reader}",
                         *cells({k: med(res["reads_late"][reader][which][k]) for k in FORMATS})])
    tt = res["time_travel"]
    for reader in ("own", "polars"):
        rows.append([storage, f"read as of commit {tt['commit']} ({tt['commit']} rounds; parquet: those rounds' "
                              f"files): {reader}", *cells({k: med(tt["times"][k][reader]) for k in FORMATS})])
    m = res["million"]
    rows.append([storage, f"write {args.million:,} rows, one commit",
                 *cells({k: m[k]["write"] for k in ONE_COMMIT}, scale=1, unit="s")])
    rows.append([storage, f"read {args.million:,} rows: own (one read each)",
                 *cells({k: m[k]["read"] for k in ONE_COMMIT}, scale=1, unit="s")])
    rows.append([storage, f"{args.million:,} rows: bytes stored",
                 *[f"{m[k]['bytes'] / 2**20:,.0f} MiB" if k in m else "–" for k in FORMATS]])
    ms = res["metadata_size"]
    rows.append([storage, f"log / metadata files after {args.long} commits",
                 *[f"{ms[k]['files']} files, {ms[k]['bytes'] / 2**20:,.2f} MiB" for k in FORMATS]])
    return rows


def race_line(r: dict) -> str:
    what = "append a round" if r["action"] == "append" else "replace round 0"
    parts = []
    for o in sorted(r["outcomes"], key=lambda o: o["who"]):
        retries = f" after {o['retries_logged']} retry" if o.get("retries_logged") else ""
        parts.append(f"writer {o['who']}: " + (f"committed{retries}" if o["ok"] else f"{o['error']}: {o['message']}"))
    cp = "" if r["conditional_put"] else " (no conditional_put option)"
    return (f"- two writers on s3, {r['kind']}{cp}, both {what} from the same table version: {'; '.join(parts)}; "
            f"then {r['rows']} rows, the round's rows by writer (reward): {r['round_rewards']}")


def markdown(results: dict, args, command_line: str, machine_line: str, stamp: str) -> str:
    header = ["storage", "measure", "parquet (baseline)", *[f"{k} (ratio)" for k in FORMATS[1:]]]
    lines = [f"## table format: plain Parquet vs Delta Lake vs Iceberg for a run's tables — {stamp}", "",
             f"- machine: {machine_line}", f"- command: `{command_line}`",
             f"- tables: samples-like rows, {args.round_rows} a round ({args.big_round_rows:,} in the larger-round "
             f"row), zstd, partitioned by round; {args.rounds} rounds, then up to {args.long}; medians of "
             f"{args.repeats} repeats (reads of {args.rounds} rounds), {args.late_repeats} (reads of one round of "
             f"{args.long}), "
             f"{args.replace_repeats} replaces, 5 commits per commit window; formats interleaved",
             "- a commit opens the table (Delta by URI, Iceberg through catalog.load_table) unless the row says the "
             "handle is held; a read opens the table too; delta-cp10 is Delta with delta.checkpointInterval = 10 "
             "(delta-rs's default: 100); – : not measured (a table of one or a few commits: the same as delta)",
             "- s3: a moto server on 127.0.0.1 (in-process Python: every request is slower than a real object "
             "store's, so the format that makes more requests pays more); the Iceberg SQL catalog is a SQLite "
             "file on local disk for both storages", "",
             "| " + " | ".join(header) + " |", "|---|---|" + "--:|" * len(FORMATS)]
    for storage in ("local", "s3"):
        if storage in results["storages"]:
            lines += ["| " + " | ".join(row) + " |" for row in rows_for(storage, results["storages"][storage], args)]
    lines.append("")
    for storage, res in results["storages"].items():
        lines.append(f"- {storage}, our JSON on each commit read back: " + "; ".join(
            f"{kind} {v['commits_with_meta']} commits carry it, the first equal to what was written: "
            f"{'yes' if v['round_trips'] else 'NO'}" for kind, v in res["commit_meta"].items()))
        lines.append(f"- {storage}, time travel across the replaces: " + "; ".join(
            f"{kind} now {v['replaced_rows_now']} replaced rows, {v['replaced_rows_before']} as of the version "
            f"before them" for kind, v in res["replace_checks"].items()))
    lines += [race_line(r) for r in results.get("races", [])]
    lines.append(f"- duckdb extensions: {results['duckdb_extensions']}")
    return "\n".join(lines + [""])


def duckdb_extensions() -> str:
    import duckdb

    con = duckdb.connect()
    out = []
    for ext in ("delta", "iceberg", "httpfs"):
        try:
            con.sql(f"LOAD {ext}")
            out.append(f"{ext} loaded")
        except Exception:
            try:
                con.sql(f"INSTALL {ext}")
                out.append(f"{ext} installed")
            except Exception as e:  # no download here: say so
                message = str(e).splitlines()[0].split(" at URL")[0].removeprefix("IO Error: ")
                out.append(f"{ext}: {type(e).__name__}: {message}")
    return "; ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, repeats and rows (~3 min)")
    parser.add_argument("--rounds", type=int, help="rounds read back and time-travelled (default 40; quick 20)")
    parser.add_argument("--long", type=int, help="commits in all, for the growth (default 200; quick 50)")
    parser.add_argument("--repeats", type=int, help="repeats of each read (default 5; quick 3)")
    parser.add_argument("--million", type=int, help="rows of the one-commit write (default 1M; quick 100k)")
    parser.add_argument("--storage", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    parser.add_argument("--race-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.race_worker:
        return race_worker(json.loads(args.race_worker))
    quick = args.quick
    args.rounds = args.rounds or (20 if quick else 40)
    args.long = args.long or (50 if quick else 200)
    args.repeats = args.repeats or (3 if quick else 5)
    args.million = args.million or (100_000 if quick else 1_000_000)
    args.replace_repeats = 3 if quick else 5
    args.late_repeats, args.held = 3, 5
    args.round_rows, args.big_round_rows, args.big_rounds = 512, 8192, 3 if quick else 6

    from _report import command, machine, publish

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    OUT.mkdir(parents=True, exist_ok=True)
    moto = Moto()
    use_endpoint(moto.endpoint)
    results: dict = {"settings": {k: v for k, v in vars(args).items() if k != "race_worker"}, "storages": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="table-format-", dir=OUT) as tmp:
            tmp_path = Path(tmp)
            stamp = time.strftime("%Y%m%d%H%M%S")
            storages = {"local": Storage("local", str(tmp_path / "local"), str(tmp_path)),
                        "s3": Storage("s3", f"s3://{BUCKET}/{stamp}", str(tmp_path), moto.endpoint)}
            (tmp_path / "local").mkdir()
            rows = Rows(seed=0)
            extensions: dict = {}  # DuckDB's download attempts wait on the network, not the CPU: beside the rest
            checker = threading.Thread(target=lambda: extensions.update(text=duckdb_extensions()), daemon=True)
            checker.start()
            for name, storage in storages.items():
                if args.storage in (name, "both"):
                    results["storages"][name] = storage_run(storage, args, rows, log)
            log("two writers at once on s3")
            s3 = storages["s3"]
            results["races"] = [race(s3, kind, action, args.round_rows, tmp_path)
                                for kind in ONE_COMMIT for action in ("append", "replace")]
            results["races"].append(race(s3, "delta", "replace", args.round_rows, tmp_path, conditional_put=False))
            shutil.rmtree(tmp_path / "local", ignore_errors=True)
            checker.join(timeout=120)
            results["duckdb_extensions"] = extensions.get("text", "not checked (timed out)")
    finally:
        moto.stop()
    log("done")
    machine_line = machine(("pyarrow", "deltalake", "pyiceberg", "polars", "polars-iceberg", "duckdb", "moto"))
    command_line = command("table_format.py")
    results.update(machine=machine_line, command=command_line, seconds=time.perf_counter() - started)
    (OUT / "table_format.json").write_text(json.dumps(results, indent=1))
    section = markdown(results, args, command_line, machine_line, time.strftime("%Y-%m-%d %H:%M"))
    publish(section, "table_format", OUT, args.append)
    print(f"results: {OUT / 'table_format.json'}")


if __name__ == "__main__":
    main()
