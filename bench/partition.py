"""Benchmark: a run's tables as Delta tables partitioned by round vs unpartitioned with round statistics.

    .venv/bin/python bench/partition.py            # 300 rounds on local disk, 100 on S3 (moto): ~10-15 min
    .venv/bin/python bench/partition.py --quick    # 50 rounds: a smoke run (~4 min on 2 busy cores)
    .venv/bin/python bench/partition.py --append   # also append the section to BENCHMARKS.md

Writes runs/bench/partition.md (the section) and runs/bench/partition.json (every timing).

Issue 40 item 1 asks whether Delta partition columns (`partitionColumns: ["round"]`, the round
column out of the files, `round=<n>/` meaning partition values) make the round loop or the readers
faster than today's layout: an unpartitioned table whose part files sit under `round=<n>/` with the
round column inside, each add action carrying the file's round min/max statistics
(store/run_log.py, `_write_version`). Four tables, each figure a ratio partitioned /
unpartitioned measured in the same run (the machine is shared: compare ratios):

    tx            today's layout, written the store's way: pq.write_table of the round (zstd) to
                  round=<n>/part-generate-<sha>.parquet, then one Delta version through deltalake's
                  transaction API (create_write_transaction, an AddAction with numRecords and round
                  min/max only, as the store writes them)
    tx-part       the same API, partitioned: the table created with partition_by=["round"], the
                  file without the round column, the AddAction with partition_values {"round": n}
    wd            deltalake's write_deltalake(handle, round, mode="append"), one call per round,
                  unpartitioned (delta-rs's own file names at the table root; statistics of every
                  column, delta-rs's default)
    wd-part       the same with partition_by=["round"]

All four are created first (DeltaTable.create, the store's delta.checkpointInterval = 10) and
committed through a handle held open, as the round loop holds RunLog's handles. The table is
samples-like (bench/table_format.py's rows: round int64, prompt_id string, sample_idx int32,
response ~200 characters, token_ids list<int32> and logprobs list<float32> of 40-80, reward
float64), 512 rows a round, the same rows in all four tables.

Measured: a round's commit (median of rounds 2-6 and of the last 5), reads of one round (the newest
and a middle one) and of the whole table with Polars (scan_delta + filter), a pyarrow dataset
(DeltaTable(uri).to_pyarrow_dataset() + filter) and DuckDB over that dataset, each opening the
table by URI as a reader process does, and one round through the held handle's dataset; one
round as of an earlier version (load_as_version; Polars scan_delta(version=)); the _delta_log's
files and bytes at the end; the fragments a dataset keeps for `round = k` (what file skipping
leaves to open). Medians of --repeats (--whole-repeats for the whole table); the four tables' order
rotates every round and every repeat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from table_format import BUCKET, SCHEMA, Moto, Rows, Storage, use_endpoint  # noqa: E402

from store.run_log import TABLE_CONFIG  # noqa: E402

OUT = ROOT / "runs" / "bench"
ARMS = ("tx", "tx-part", "wd", "wd-part")
PAIRS = (("tx", "tx-part"), ("wd", "wd-part"))  # (unpartitioned, partitioned)


class Arm:
    """One Delta table of the comparison, with its handle held open."""

    def __init__(self, name: str, storage: Storage):
        self.name, self.storage = name, storage
        self.partitioned = name.endswith("-part")
        self.uri = storage.uri(name)
        self.options = storage.delta_options()
        self.fs = storage.fs()
        self.handle = None

    def create(self) -> None:
        from deltalake import DeltaTable

        self.handle = DeltaTable.create(self.uri, SCHEMA, mode="error", configuration=TABLE_CONFIG,
                                        partition_by=["round"] if self.partitioned else None,
                                        storage_options=self.options)

    def commit(self, data: pa.Table, round: int) -> int:
        from deltalake import CommitProperties, WriterProperties, write_deltalake

        properties = CommitProperties(custom_metadata={"groupforge": {"stage": "generate", "round": round}})
        if self.name.startswith("wd"):
            write_deltalake(self.handle, data, mode="append", partition_by=["round"] if self.partitioned else None,
                            writer_properties=WriterProperties(compression="ZSTD"), commit_properties=properties)
        else:
            self._transaction(data, round, properties)
        self.handle.update_incremental()
        return self.handle.version()

    def _transaction(self, data: pa.Table, round: int, properties) -> None:
        """The store's way: the part file written by us, then an add action through the transaction API."""
        from deltalake.transaction import AddAction

        body = data.drop_columns(["round"]) if self.partitioned else data
        sink = pa.BufferOutputStream()
        pq.write_table(body, sink, compression="zstd")
        blob = sink.getvalue()
        rel = f"round={round}/part-generate-{hashlib.sha256(blob).hexdigest()[:16]}.parquet"
        path = f"{self.storage.path(self.name)}/{rel}"
        if self.storage.name == "local":
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(blob)
        stats = {"numRecords": data.num_rows, "nullCount": {}, "minValues": {}, "maxValues": {}}
        if not self.partitioned:
            stats.update(minValues={"round": round}, maxValues={"round": round})
        action = AddAction(rel, blob.size, {"round": str(round)} if self.partitioned else {},
                           int(time.time() * 1000), True, json.dumps(stats, separators=(",", ":")))
        self.handle.create_write_transaction([action], mode="append", schema=self.handle.schema(),
                                             partition_by=["round"] if self.partitioned else None,
                                             commit_properties=properties)

    def open(self, version: int | None = None):
        """The table by URI, as a reader process opens it (load_as_version for an older version)."""
        from deltalake import DeltaTable

        table = DeltaTable(self.uri, storage_options=self.options)
        if version is not None:
            table.load_as_version(version)
        return table

    def log_size(self) -> dict:
        infos = self.storage.listing(f"{self.storage.path(self.name)}/_delta_log")
        data = [i for i in self.storage.listing(self.storage.path(self.name)) if i.path.endswith(".parquet")
                and "/_delta_log/" not in i.path]
        return {"files": len(infos), "bytes": sum(i.size for i in infos),
                "checkpoint_bytes": sum(i.size for i in infos if ".checkpoint." in i.path),
                "data_files": len(data), "data_bytes": sum(i.size for i in data)}


# -- readers: (arm, round or None, version or None) -> rows


def polars_read(arm: Arm, round: int | None, version: int | None = None) -> pa.Table:
    import polars as pl

    frame = pl.scan_delta(arm.uri, version=version, storage_options=arm.storage.polars_options())
    return (frame if round is None else frame.filter(pl.col("round") == round)).collect().to_arrow()


def dataset_read(arm: Arm, round: int | None, version: int | None = None) -> pa.Table:
    dataset = arm.open(version).to_pyarrow_dataset()
    return dataset.to_table() if round is None else dataset.to_table(filter=pc.field("round") == round)


_DUCKDB = None


def duckdb_read(arm: Arm, round: int | None, version: int | None = None) -> pa.Table:
    global _DUCKDB
    import duckdb

    if _DUCKDB is None:
        _DUCKDB = duckdb.connect()
    _DUCKDB.register("ds", arm.open(version).to_pyarrow_dataset())
    out = _DUCKDB.sql("select * from ds" + ("" if round is None else f" where round = {round}")).to_arrow_table()
    _DUCKDB.unregister("ds")
    return out


def held_read(arm: Arm, round: int | None, version: int | None = None) -> pa.Table:
    """Through the handle the writer holds (the trainer reading its own run): no log replay."""
    dataset = arm.handle.to_pyarrow_dataset()
    return dataset.to_table() if round is None else dataset.to_table(filter=pc.field("round") == round)


READERS = {"polars": polars_read, "pyarrow dataset": dataset_read, "duckdb": duckdb_read,
           "held handle dataset": held_read}


def check(got: pa.Table, rows: int, round: int | None, what: str) -> None:
    if got.num_rows != rows:
        raise AssertionError(f"{what}: {got.num_rows} rows, expected {rows}")
    if round is not None and pc.any(pc.not_equal(got["round"], round)).as_py():
        raise AssertionError(f"{what}: rows of another round")


def rotated(repeat: int) -> tuple[str, ...]:
    k = repeat % len(ARMS)
    return ARMS[k:] + ARMS[:k]


def storage_run(storage: Storage, args, rounds: int, rows: Rows, log) -> dict:
    arms = {name: Arm(name, storage) for name in ARMS}
    for arm in arms.values():
        arm.create()
    commits: dict[str, list[float]] = {name: [] for name in ARMS}
    versions: dict[str, list[int]] = {name: [] for name in ARMS}
    for r in range(rounds):
        data = rows.round(r, args.round_rows)
        for name in rotated(r):
            start = time.perf_counter()
            versions[name].append(arms[name].commit(data, r))
            commits[name].append(time.perf_counter() - start)
        if (r + 1) % 50 == 0:
            log(f"  {storage.name}: {r + 1} rounds committed: "
                + ", ".join(f"{k} {1000 * v[-1]:.0f} ms" for k, v in commits.items()))
    newest, middle = rounds - 1, rounds // 2
    cases = {"one round: the newest": newest, f"one round: a middle one ({middle})": middle, "whole table": None}
    expect = {None: rounds * args.round_rows}
    reads: dict = {case: {reader: {name: [] for name in ARMS} for reader in READERS} for case in cases}
    tt_round = rounds // 4
    tt_version = {name: versions[name][tt_round] for name in ARMS}  # as of the commit of round tt_round
    travel: dict = {reader: {name: [] for name in ARMS} for reader in ("polars", "pyarrow dataset")}
    for case, r in cases.items():  # untimed: each reader's first call loads its code; and the rows are checked
        for reader, fn in READERS.items():
            for arm in arms.values():
                check(fn(arm, r), expect.get(r, args.round_rows), r, f"{storage.name} {arm.name} {reader} {case}")
    for reader in travel:
        for arm in arms.values():
            check(READERS[reader](arm, tt_round, tt_version[arm.name]), args.round_rows, tt_round,
                  f"{storage.name} {arm.name} {reader} time travel")
            check(READERS[reader](arm, newest, tt_version[arm.name]), 0, None,
                  f"{storage.name} {arm.name} {reader} time travel, a later round")
    log(f"  {storage.name}: reads checked; timing {args.repeats} repeats ({args.whole_repeats} of whole-table reads)")
    for repeat in range(args.repeats):
        for case, r in cases.items():
            if r is None and repeat >= args.whole_repeats:
                continue
            for reader, fn in READERS.items():
                for name in rotated(repeat):
                    start = time.perf_counter()
                    fn(arms[name], r)
                    reads[case][reader][name].append(time.perf_counter() - start)
        for reader in travel:
            for name in rotated(repeat):
                start = time.perf_counter()
                READERS[reader](arms[name], tt_round, tt_version[name])
                travel[reader][name].append(time.perf_counter() - start)
    fragments = {}
    for name, arm in arms.items():
        dataset = arm.open().to_pyarrow_dataset()
        fragments[name] = {"all": len(list(dataset.get_fragments())),
                           "round": len(list(dataset.get_fragments(filter=pc.field("round") == middle)))}
    return {"rounds": rounds, "commits": commits, "reads": reads,
            "time_travel": {"round": tt_round, "versions": tt_version, "times": travel},
            "log": {name: arm.log_size() for name, arm in arms.items()}, "fragments": fragments}


# -- report


def med(values: list[float]) -> float:
    return statistics.median(values)


def pair_cells(values: dict[str, float], scale: float = 1000, unit: str = "ms") -> list[str]:
    out = []
    for unpart, part in PAIRS:
        out.append(f"{scale * values[unpart]:,.1f} {unit}")
        out.append(f"{scale * values[part]:,.1f} {unit} (**{values[part] / values[unpart]:.2f}x**)")
    return out


def rows_for(storage: str, res: dict, args) -> list[list[str]]:
    out, rounds = [], res["rounds"]
    c = res["commits"]
    for lo, hi in ((2, 6), (rounds - 4, rounds), (rounds - min(49, rounds // 2), rounds)):
        out.append([storage, f"commit a round of {args.round_rows} rows, rounds {lo}-{hi} (median)",
                    *pair_cells({k: med(c[k][lo - 1:hi]) for k in ARMS})])
    for case, by_reader in res["reads"].items():
        for reader, times in by_reader.items():
            label = f"read {case} of {rounds}" if case != "whole table" else f"read the whole table ({rounds} rounds)"
            out.append([storage, f"{label}: {reader}", *pair_cells({k: med(v) for k, v in times.items()})])
    tt = res["time_travel"]
    for reader, times in tt["times"].items():
        out.append([storage, f"read round {tt['round']} as of its commit (load_as_version): {reader}",
                    *pair_cells({k: med(v) for k, v in times.items()})])
    lg = res["log"]
    cells = []
    for unpart, part in PAIRS:
        for k in (unpart, part):
            text = f"{lg[k]['files']} files, {lg[k]['bytes'] / 1024:,.0f} KiB"
            cells.append(text if k == unpart else f"{text} (**{lg[k]['bytes'] / lg[unpart]['bytes']:.2f}x**)")
    out.append([storage, f"_delta_log after {rounds} rounds", *cells])
    cells = []
    for unpart, part in PAIRS:
        for k in (unpart, part):
            ck = f"{lg[k]['checkpoint_bytes'] / 1024:,.0f} KiB"
            ratio = lg[k]["checkpoint_bytes"] / lg[unpart]["checkpoint_bytes"]
            cells.append(ck if k == unpart else f"{ck} (**{ratio:.2f}x**)")
    out.append([storage, "of which checkpoints (every 10 versions)", *cells])
    out.append([storage, "data files, MiB",
                *[f"{lg[k]['data_files']}, {lg[k]['data_bytes'] / 2**20:,.1f}" for k in ARMS]])
    fr = res["fragments"]
    out.append([storage, f"dataset fragments: all / kept for round = {rounds // 2}",
                *[f"{fr[k]['all']} / {fr[k]['round']}" for k in ARMS]])
    return out


def markdown(results: dict, args, command_line: str, machine_line: str, stamp: str) -> str:
    header = ["storage", "measure", "tx unpartitioned (today)", "tx partitioned (part/unpart)",
              "write_deltalake unpartitioned", "write_deltalake partitioned (part/unpart)"]
    lines = [f"## partition by round: Delta partition columns vs round statistics — {stamp}", "",
             f"- machine: {machine_line}", f"- command: `{command_line}`",
             f"- table: samples-like rows (bench/table_format.py's), {args.round_rows} a round, {args.rounds} rounds "
             f"on local disk, {args.s3_rounds} on s3, one part file a round (zstd), delta.checkpointInterval = 10 "
             f"(the store's); reads: medians of {args.repeats} repeats ({args.whole_repeats} for the whole table); "
             "commits: medians over the rounds named; the four tables' order rotated every round and repeat",
             "- tx: the store's way (our part file under round=<n>/, an add action through create_write_transaction; "
             "unpartitioned: round inside the file, numRecords and round min/max statistics only; partitioned: "
             "round out of the file, partition_values); write_deltalake: delta-rs's own writer, one call per round "
             "through a held handle (unpartitioned: statistics of every column)",
             "- readers open the table by URI each time (a report or a user), except the held-handle row (the "
             "writer's own DeltaTable, no log read); bold: partitioned / unpartitioned of the same API, same run",
             "- s3: moto's server on 127.0.0.1 (a Python process on the same cores: every request costs more than "
             "on a real object store)", "",
             "| " + " | ".join(header) + " |", "|---|---|--:|--:|--:|--:|"]
    for storage in ("local", "s3"):
        if storage in results["storages"]:
            lines += ["| " + " | ".join(row) + " |" for row in rows_for(storage, results["storages"][storage], args)]
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 rounds, 3 repeats")
    parser.add_argument("--rounds", type=int, help="rounds committed to each table (default 300; quick 50)")
    parser.add_argument("--s3-rounds", type=int, help="rounds on the S3 endpoint (default 100; quick 50)")
    parser.add_argument("--repeats", type=int, help="repeats of each one-round read (default 10; quick 5)")
    parser.add_argument("--whole-repeats", type=int, help="repeats of each whole-table read (default 5; quick 3)")
    parser.add_argument("--storage", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    args = parser.parse_args()
    args.rounds = args.rounds or (50 if args.quick else 300)
    args.s3_rounds = args.s3_rounds or min(args.rounds, 100)
    args.repeats = args.repeats or (5 if args.quick else 10)
    args.whole_repeats = min(args.whole_repeats or (3 if args.quick else 5), args.repeats)
    args.round_rows = 512
    if min(args.rounds, args.s3_rounds) < 10:
        parser.error("--rounds: at least 10")

    from _report import command, machine, publish

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", flush=True)

    OUT.mkdir(parents=True, exist_ok=True)
    moto = Moto() if args.storage != "local" else None
    if moto:
        use_endpoint(moto.endpoint)
    results: dict = {"settings": vars(args), "storages": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="partition-", dir=OUT) as tmp:
            stamp = time.strftime("%Y%m%d%H%M%S")
            storages = {"local": Storage("local", f"{tmp}/local", tmp)}
            if moto:
                storages["s3"] = Storage("s3", f"s3://{BUCKET}/partition-{stamp}", tmp, moto.endpoint)
            Path(tmp, "local").mkdir()
            for name, storage in storages.items():
                if args.storage in (name, "both"):
                    rounds = args.rounds if name == "local" else args.s3_rounds
                    log(f"{name}: {rounds} rounds into {len(ARMS)} tables")
                    results["storages"][name] = storage_run(storage, args, rounds, Rows(seed=0), log)
    finally:
        if moto:
            moto.stop()
    log("done")
    machine_line = machine(("pyarrow", "deltalake", "polars", "duckdb", "moto"))
    command_line = command("partition.py")
    results.update(machine=machine_line, command=command_line, seconds=time.perf_counter() - started)
    (OUT / "partition.json").write_text(json.dumps(results, indent=1))
    section = markdown(results, args, command_line, machine_line, time.strftime("%Y-%m-%d %H:%M"))
    publish(section, "partition", OUT, args.append)
    print(f"results: {OUT / 'partition.json'}")


if __name__ == "__main__":
    main()
