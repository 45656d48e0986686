"""Benchmark: the same jobs on a local run folder and on an S3-compatible endpoint.

    .venv/bin/python bench/object_store.py            # 1M samples, 40 rounds: ~10 min on 2 cores
    .venv/bin/python bench/object_store.py --quick    # 100k samples, 8 rounds: a smoke run
    .venv/bin/python bench/object_store.py --append   # also append the section to BENCHMARKS.md

A moto server on 127.0.0.1 (the one bench/table_format.py starts) stands in for the object
store: every request is an HTTP round trip to a Python process on the same two cores, so the
S3 figures are an upper bound on the cost of the store's protocol, not a forecast for AWS.
Each job runs on local disk and on the endpoint in the same sitting, alternating; the report
gives each S3 figure as a ratio to the local one.

    curation     one round of N samples (the toy's shape, bench/curation.py's generator) committed
                 as generate would, then score -> filter -> label -> pair through `run_stage`,
                 as `groupforge curate` runs them
    commits      a round's four commits (generate, score, filter, label) of 512 samples, each its
                 part files, the Delta versions of its tables and its `_commits` row: the
                 per-round cost of the store alone, median over the rounds; on the endpoint
                 also the HTTP requests a round makes, from the server's request log
    loop         the toy round loop (toy-grpo.toml at 64 prompts x 8, 2 steps a round, eval every
                 10 rounds), every round's wall seconds and the part of it the store's work shows
                 in (generate's commit, the curation stages, checkpoints)
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from _report import command, machine, publish, use_threads  # noqa: E402
from table_format import BUCKET, Moto, use_endpoint  # noqa: E402

OUT = ROOT / "runs" / "bench"
LOOP_SETTINGS = ["prompts.per_round=64", "run.steps_per_round=2", "eval.every=10", "run.checkpoint_every=10"]
STORE_PHASES = ("generate", "score", "filter", "label", "checkpoint")
REQUEST_ROUNDS_FROM = 3
"""The commits job counts requests from this round on (the first rounds create the tables)."""


def _bench_curation():
    """bench/curation.py as a module (its file name is the package's): its round generator and
    stage configs."""
    spec = importlib.util.spec_from_file_location("bench_curation", ROOT / "bench" / "curation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH_CURATION = _bench_curation()


def _round_tables(rows: int, scratch: Path) -> tuple[pa.Table, pa.Table]:
    """A round of `rows` samples and its prompts, in the toy's shape."""
    BENCH_CURATION.make_run(scratch, rows)
    return pq.read_table(scratch / "samples/round=0/part-generate.parquet"), \
        pq.read_table(scratch / "prompts/part-generate.parquet")


def _commit_generate(store, round: int, samples: pa.Table, prompts: pa.Table) -> None:
    from store.schema import empty

    with store.commit("generate", round, inputs={"prompts": "bench"}, config={}) as commit:
        commit.write("samples", samples.set_column(samples.schema.get_field_index("round"), "round",
                                                   pa.array([round] * samples.num_rows, pa.int32())),
                     part="generate")
        commit.write("rejects", empty("rejects"), part="generate")
        if round == 0:
            commit.write("prompts", prompts, part="bench", round=None)
        commit.record(rows_in=prompts.num_rows, rows_out=samples.num_rows)


def curation(run: str, samples: pa.Table, prompts: pa.Table) -> dict[str, float]:
    """Seconds of generate's commit and of each curation stage on `run`."""
    from curation.stages.runner import CURATION_STAGES, run_stage
    from store.run_store import RunStore

    cfgs = BENCH_CURATION.configs(None)
    out = {}
    tic = time.perf_counter()
    _commit_generate(RunStore(run), 0, samples, prompts)
    out["commit generate"] = time.perf_counter() - tic
    for name, cfg in zip(CURATION_STAGES, cfgs):
        tic = time.perf_counter()
        run_stage(name, run, 0, cfg, force=True)
        out[name] = time.perf_counter() - tic
    out["total"] = sum(out.values())
    return out


def commits(run: str, samples: pa.Table, prompts: pa.Table, rounds: int,
            before_round: Callable[[int], None] = lambda round: None,
            make_store: Callable | None = None) -> list[float]:
    """Seconds of each round's four commits (generate, then the curation stages but pair) through
    one store kept open, as the round loop keeps it. `before_round(round)` runs before each;
    `make_store(run)`: the store (a RunStore; bench/commit_floor.py's floor arm passes its own)."""
    from curation.stages.runner import CURATION_STAGES, run_stage
    from store.run_store import RunStore

    cfgs = dict(zip(CURATION_STAGES, BENCH_CURATION.configs(None)))
    store = (make_store or RunStore)(run)
    seconds = []
    for round in range(rounds):
        before_round(round)
        tic = time.perf_counter()
        _commit_generate(store, round, samples, prompts)
        for name in ("score", "filter", "label"):
            run_stage(name, store, round, cfgs[name])
        seconds.append(time.perf_counter() - tic)
    return seconds


REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP')
DELTA_COMMIT = re.compile(r"/_delta_log/\d{20}\.json$")


def requests_per_round(log: Path, start: int, rounds: int) -> dict[str, float]:
    """The HTTP requests the server logged after byte `start` of `log`, per round: by kind (a GET
    with `list-type` is a LIST) and by target (a table's Delta log, or any other object)."""
    counts: Counter = Counter()
    delta_commits = 0
    with open(log, "rb") as f:
        f.seek(start)
        for line in f.read().decode("utf-8", "replace").splitlines():
            found = REQUEST.search(line)
            if found is None:
                continue
            method, target = found.groups()
            kind = "LIST" if method == "GET" and "list-type=" in target else method
            counts[f"{kind} {'a Delta log' if '_delta_log' in target else 'other objects'}"] += 1
            delta_commits += method == "PUT" and DELTA_COMMIT.search(target) is not None
    per_round = {key: n / rounds for key, n in sorted(counts.items())}
    per_round["all requests"] = sum(counts.values()) / rounds
    per_round["Delta commits (PUT of _delta_log/<version>.json)"] = delta_commits / rounds
    return per_round


def loop(run: str, rounds: int) -> list[dict]:
    """The toy loop on `run`; its round records (round 0, the start model's eval, left out)."""
    from _gf_run import loop_spec

    import pipelines.toy.build as toy_module
    from pipelines.loop.run import run_pipeline
    from store.run_files import MetricsLog
    from store.storage import open_storage

    toy = toy_module.build_toy(ROOT / "runs" / "toy", progress=False)
    spec = loop_spec(ROOT / "pipelines" / "specs" / "toy-grpo.toml", toy, "object-store", 0, LOOP_SETTINGS,
                     rounds=rounds)
    run_pipeline(spec, run, log=lambda message: None, report=False)
    rounds_done, _, _ = MetricsLog(open_storage(run)).read()
    return [r for r in rounds_done if r["round"] >= 1]


def _ratio(s3: float, local: float) -> str:
    return f"{s3 / local:.2f}x" if local > 0 else "-"


def markdown(cur: dict, com: dict, requests: dict[str, float], lp: dict, args, rows: int) -> str:
    lines = [f"## object storage: local disk vs an S3 endpoint (moto) — {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"- machine: {machine(('pyarrow', 'deltalake', 'obstore', 'moto'))}",
             f"- command: `{command('object_store.py')}`",
             "- s3: moto's server on 127.0.0.1 (a Python process on the same cores: every request costs more "
             "than on a real object store); local: a folder on this machine's disk; both in this one sitting", "",
             f"### curation of {rows:,} samples (one round: generate's commit, then score, filter, label, pair)", "",
             "| step | local s | s3 s | s3 / local |", "|---|--:|--:|--:|"]
    for key in cur["local"]:
        lines.append(f"| {key} | {cur['local'][key]:.2f} | {cur['s3'][key]:.2f} | "
                     f"{_ratio(cur['s3'][key], cur['local'][key])} |")
    med = {side: statistics.median(v) for side, v in com.items()}
    lines += ["", f"### commit latency per round ({args.commit_rounds} rounds of 512 samples: generate's commit, "
                  "then score, filter, label, each its part files, its tables' Delta versions and its `_commits` "
                  "row, through one store kept open as the loop keeps it)", "",
              "| | local ms | s3 ms | s3 / local |", "|---|--:|--:|--:|",
              f"| median round | {1000 * med['local']:.0f} | {1000 * med['s3']:.0f} | "
              f"{_ratio(med['s3'], med['local'])} |",
              f"| last 5 rounds (median) | {1000 * statistics.median(com['local'][-5:]):.0f} | "
              f"{1000 * statistics.median(com['s3'][-5:]):.0f} | "
              f"{_ratio(statistics.median(com['s3'][-5:]), statistics.median(com['local'][-5:]))} |", "",
              f"HTTP requests to the endpoint per round (rounds {REQUEST_ROUNDS_FROM}-{args.commit_rounds - 1}; "
              "a LIST is a GET with list-type):", "",
              "| requests | per round |", "|---|--:|",
              *(f"| {key} | {value:.1f} |" for key, value in requests.items()), ""]
    walls = {side: sum(r["wall_seconds"] for r in records) for side, records in lp.items()}
    lines += [f"### the toy loop, {args.rounds} rounds of 64 prompts x 8 ({', '.join(LOOP_SETTINGS)})", "",
              "| | local | s3 | s3 / local |", "|---|--:|--:|--:|",
              f"| all rounds, s | {walls['local']:.1f} | {walls['s3']:.1f} | {_ratio(walls['s3'], walls['local'])} |"]
    for phase in STORE_PHASES:  # checkpoint: the rounds that write one (every checkpoint_every rounds)
        med = {side: statistics.median([r["phase_seconds"].get(phase, 0.0) for r in records
                                        if phase != "checkpoint" or r["phase_seconds"].get(phase, 0.0) > 0] or [0.0])
               for side, records in lp.items()}
        lines.append(f"| {phase} per round{' that writes one' if phase == 'checkpoint' else ''} (median), ms | "
                     f"{1000 * med['local']:.0f} | {1000 * med['s3']:.0f} | {_ratio(med['s3'], med['local'])} |")
    acc = {side: records[-1]["eval_accuracy"] for side, records in lp.items()}
    lines += [f"| final eval accuracy | {acc['local']:.3f} | {acc['s3']:.3f} | |", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="samples in the curation round (default 1M)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the toy loop (default 40)")
    parser.add_argument("--commit-rounds", type=int, default=30, help="rounds of the commit latency job")
    parser.add_argument("--quick", action="store_true", help="100k samples, 8 rounds, 10 commit rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--append", action="store_true", help="append the section to BENCHMARKS.md")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds, args.commit_rounds = 100_000, 8, 10
    use_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=OUT.parent if OUT.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        log = tmp / "moto-requests.log"
        moto = Moto(log=log)
        use_endpoint(moto.endpoint)
        stamp = uuid.uuid4().hex[:8]
        try:
            where = {"local": str(tmp / "local"), "s3": f"s3://{BUCKET}/{stamp}"}
            samples, prompts = _round_tables(args.rows, tmp / "scratch")
            small, small_prompts = _round_tables(512, tmp / "scratch-small")
            cur = {side: curation(f"{base}/curation", samples, prompts) for side, base in where.items()}
            log_start: list[int] = []  # the log's size when the S3 commits job reaches REQUEST_ROUNDS_FROM

            def mark(round: int) -> None:
                if round == REQUEST_ROUNDS_FROM:
                    log_start.append(log.stat().st_size)

            com = {"local": commits(f"{where['local']}/commits", small, small_prompts, args.commit_rounds),
                   "s3": commits(f"{where['s3']}/commits", small, small_prompts, args.commit_rounds, mark)}
            requests = requests_per_round(log, log_start[0], args.commit_rounds - REQUEST_ROUNDS_FROM)
            lp = {side: loop(f"{base}/loop", args.rounds) for side, base in where.items()}
        finally:
            moto.stop()
    publish(markdown(cur, com, requests, lp, args, samples.num_rows), "object_store", OUT, args.append)


if __name__ == "__main__":
    main()
