"""Benchmark: a round's commits before Delta, now, and the floor of any design that commits a
stage through deltalake.

    git worktree add /tmp/before 50d927b      # the code before Delta became the only log
    .venv/bin/python bench/commit_floor.py --before /tmp/before
    .venv/bin/python bench/commit_floor.py --before /tmp/before --append   # to BENCHMARKS.md

bench/object_store.py's commits job (a round's four commits, generate, score, filter, label, of
512 samples through one store kept open), on local disk and on a moto S3 endpoint, three arms
in turn in one sitting:

    before   the checkout at --before (groupforge's own commit log), in a child process
    now      this checkout: each stage's Delta versions of its tables, then its `_commits` row
    floor    this checkout with the `_commits` rows kept in memory and `_commits` not read again
             once the job has opened the run: one Delta version per table a stage writes and
             nothing more. Not a mode of the store (no fencing, no whole-or-nothing reads of a
             multi-table commit): what a round would cost at the least if each stage's commit
             point were its table's own Delta version, the redesign the `_commits` table stands
             in for.

Each arm's figure is the median round from round 3 on; the requests are counted from moto's log.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import pyarrow.parquet as pq  # noqa: E402
from _report import command, machine, publish  # noqa: E402
from object_store import REQUEST_ROUNDS_FROM, _round_tables, commits, requests_per_round  # noqa: E402
from table_format import BUCKET, Moto, use_endpoint  # noqa: E402

from store.run_log import Entry, RunLog  # noqa: E402
from store.run_store import RunStore  # noqa: E402

OUT = ROOT / "runs" / "bench"
BEFORE_JOB = """
import json, sys
from pathlib import Path
sys.path[:0] = [{root!r}, {root!r} + "/bench"]
import pyarrow.parquet as pq
from object_store import commits
samples, prompts = pq.read_table({samples!r}), pq.read_table({prompts!r})
print(json.dumps(commits({run!r}, samples, prompts, {rounds})))
"""


class TableVersionsOnly(RunLog):
    """The floor arm's log: a commit row is applied to this object's state and not written, and
    `_commits` is not read again once the job has opened the run."""

    def _append(self, entry: Entry) -> None:
        if entry.kind != "commit":
            super()._append(entry)
            return
        self._entries.append(entry)
        self.state.apply(entry)

    def _read_rows(self) -> None:
        if not self.opened:
            super()._read_rows()


def floor_store(run: str) -> RunStore:
    store = RunStore(run)
    store.log = TableVersionsOnly(store.storage)
    return store


def before_arm(checkout: Path, run: str, tables: dict[str, Path], rounds: int) -> list[float]:
    """The --before checkout's commits job in a child process (its own imports, this endpoint)."""
    code = BEFORE_JOB.format(root=str(checkout), samples=str(tables["samples"]), prompts=str(tables["prompts"]),
                             run=run, rounds=rounds)
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{checkout}: its commits job failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds[REQUEST_ROUNDS_FROM:])


def markdown(results: dict, requests: dict, args) -> str:
    arms = list(results)
    lines = [f"## commit floor: a round's commits before Delta, now, and at the least — "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             f"- machine: {machine(('pyarrow', 'deltalake', 'obstore', 'moto'))}",
             f"- command: `{command('commit_floor.py')}` (before: git {args.before_rev})",
             f"- {args.rounds} rounds of 512 samples a run, median round from round {REQUEST_ROUNDS_FROM}; "
             f"{args.repeats} runs of each arm, in turn; s3: moto's server on 127.0.0.1", "",
             "| arm | local ms (each run) | s3 ms (each run) | local / before | s3 / before | "
             "requests a round (s3) |", "|---|--:|--:|--:|--:|--:|"]
    base = {side: statistics.median(results["before"][side]) for side in ("local", "s3")} if "before" in results else {}
    for arm in arms:
        local, s3 = results[arm]["local"], results[arm]["s3"]
        ratio = {side: (f"{statistics.median(results[arm][side]) / base[side]:.2f}x" if base else "-")
                 for side in ("local", "s3")}
        lines.append(f"| {arm} | {', '.join(f'{v:.0f}' for v in local)} | {', '.join(f'{v:.0f}' for v in s3)} | "
                     f"{ratio['local']} | {ratio['s3']} | {statistics.median(requests[arm]):.1f} |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code before Delta (e.g. git 50d927b)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--append", action="store_true", help="append the section to BENCHMARKS.md")
    args = parser.parse_args()
    args.before_rev = "-"
    if args.before:
        args.before = args.before.resolve()
        args.before_rev = subprocess.run(["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True, check=True).stdout.strip()
    arms = (["before"] if args.before else []) + ["now", "floor"]
    results: dict = {arm: {"local": [], "s3": []} for arm in arms}
    requests: dict = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log = tmp / "moto-requests.log"
        moto = Moto(log=log)
        use_endpoint(moto.endpoint)
        try:
            samples, prompts = _round_tables(512, tmp / "scratch")
            tables = {"samples": tmp / "samples.parquet", "prompts": tmp / "prompts.parquet"}
            pq.write_table(samples, tables["samples"])
            pq.write_table(prompts, tables["prompts"])
            for _ in range(args.repeats):
                for arm in arms:
                    for side in ("local", "s3"):
                        run = f"{tmp}/{arm}-{uuid.uuid4().hex[:6]}" if side == "local" else \
                            f"s3://{BUCKET}/{arm}-{uuid.uuid4().hex[:6]}"
                        start = log.stat().st_size
                        if arm == "before":
                            seconds = before_arm(args.before, run, tables, args.rounds)
                        else:
                            seconds = commits(run, samples, prompts, args.rounds,
                                              make_store=floor_store if arm == "floor" else RunStore)
                        results[arm][side].append(median_ms(seconds))
                        if side == "s3":
                            # the whole job (the first rounds create the tables: a little above the steady count)
                            requests[arm].append(requests_per_round(log, start, args.rounds)["all requests"])
                    print(f"{arm}: local {results[arm]['local'][-1]:.0f} ms, s3 {results[arm]['s3'][-1]:.0f} ms, "
                          f"{requests[arm][-1]:.1f} requests a round", flush=True)
        finally:
            moto.stop()
    publish(markdown(results, requests, args), "commit_floor", OUT, args.append)


if __name__ == "__main__":
    main()
