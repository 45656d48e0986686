"""Named kill points for fault-injection tests: `GROUPFORGE_FAULT=<point>:<count>[:raise]`.

    GROUPFORGE_FAULT=commit.files_published:2 groupforge run spec.toml

SIGKILLs the process the `count`-th time (1 = the first) it passes `fault_point("<point>")`;
with `:raise` it raises `InjectedFault` there instead, once (a step that fails and is run
again in the same process: an orchestrator's retry). Several points may be given,
comma-separated. Unset (always, outside tests), a point costs one dictionary lookup. The
points, where they sit and what a kill there leaves behind:

    generate.chunk_staged      a chunk of a multi-chunk round is staged (RUN/_staging)
    generate.turn              a multi-turn generate's environment answered a turn of a chunk's
                               trajectories and their state is staged (curation/generate/stage.py),
                               the next turn not sampled
    env.tool_call              a tool worker has begun a call of the tools environment, the
                               parent waits for its result (curation/rewards/pool.py)
    commit.files_published     a commit's part files are written, no table has its Delta version
    commit.tables_written      its tables have their Delta versions, its row in RUN/_commits (the
                               commit point) is not
    commit.logged              its row is written (the commit is made), its staging folder not removed
    stage.before_commit        a curation stage computed its tables, nothing written
    train.step_logged          an optimizer step's metrics line is written
    checkpoint.weights_written a checkpoint's weights are in its temp folder, no optimizer state
    checkpoint.optimizer_written  ... and its optimizer state, no trainer_state.json (not complete)
    loop.after_curate          a round's curation is computed (its commits may still be in flight), training not started
    loop.reload                the engine is loading new weights
    loop.eval                  the greedy evaluation is running
    export.before_rename       an export file is written to its temp path
    report.before_write        the report's numbers are computed, no file written
    location.file_uploaded     a local file (a checkpoint's, the report's, a round's prompts) is
                               uploaded to an object-store run, the files after it are not
    dataset.rows_built         an append's rows are built, nothing written to the dataset
                               (curation/stages/dataset.py)

`GROUPFORGE_PAUSE=<point>:<count>:<folder>` stops there instead: the process writes
`<folder>/paused` and waits until `<folder>/resume` exists (concurrency tests: a reader runs
while a commit is half published, without a sleep deciding when).

Imports nothing heavy: curation, training and pipelines all call it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT_ENV = "GROUPFORGE_FAULT"
PAUSE_ENV = "GROUPFORGE_PAUSE"

POINTS = ("generate.chunk_staged", "generate.turn", "env.tool_call",
          "commit.files_published", "commit.tables_written", "commit.logged",
          "stage.before_commit",
          "train.step_logged", "checkpoint.weights_written", "checkpoint.optimizer_written", "loop.after_curate",
          "loop.reload", "loop.eval", "export.before_rename", "report.before_write",
          "location.file_uploaded", "dataset.rows_built")
KINDS = ("kill", "raise")

_passed: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """The failure a `<point>:<count>:raise` fault raises."""


def _targets() -> dict[str, tuple[int, str]]:
    """point -> (the pass it fires at, kill or raise)."""
    spec = os.environ.get(FAULT_ENV, "")
    targets = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        rest, _, kind = item.rpartition(":") if item.endswith(tuple(f":{k}" for k in KINDS)) else (item, "", "kill")
        point, _, count = rest.rpartition(":")
        if point not in POINTS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{FAULT_ENV}={spec!r}: {item!r} is not <point>:<count>[:raise]; points: "
                             f"{', '.join(POINTS)}")
        targets[point] = (int(count), kind)
    return targets


def _pause(name: str) -> None:
    point, count, folder = (os.environ[PAUSE_ENV].split(":", 2) + ["", ""])[:3]
    if point not in POINTS or not count.isdigit() or not folder:
        raise ValueError(f"{PAUSE_ENV}={os.environ[PAUSE_ENV]!r}: expected <point>:<count>:<folder>")
    if point != name:
        return
    key = f"pause:{name}"
    _passed[key] = _passed.get(key, 0) + 1
    if _passed[key] == int(count):
        (Path(folder) / "paused").write_text(str(os.getpid()))
        while not (Path(folder) / "resume").exists():
            time.sleep(0.02)


def fault_point(name: str) -> None:
    """SIGKILL this process here (or raise InjectedFault) when GROUPFORGE_FAULT names `name` and
    this is the pass it counts to; wait here when GROUPFORGE_PAUSE does."""
    if PAUSE_ENV in os.environ:
        _pause(name)
    if FAULT_ENV not in os.environ:
        return
    target = _targets().get(name)
    if target is None:
        return
    _passed[name] = _passed.get(name, 0) + 1
    count, kind = target
    if _passed[name] == count:
        if kind == "raise":
            raise InjectedFault(f"{FAULT_ENV}: injected failure at {name} (pass {count})")
        os.kill(os.getpid(), signal.SIGKILL)
