"""Running functions isolated in worker processes with a per-item timeout, or inline in batches.

The mechanism is generic: a `WorkerPool` gives each worker process a copy of a job (an
`IsolatedJob`: a picklable object that decodes a chunk of items and computes one item's
result) and then chunks of items; the worker computes one item at a time and writes one byte
to a progress pipe before each. The parent counts those bytes: an item that runs past
`timeout_s` gets "timeout after Xs" and its worker is killed; a worker that dies (segfault,
os._exit, OOM kill) blames the item it was on. Either way a fresh worker takes over the rest
of the chunk, so one bad item never blocks or kills the caller. A pool keeps its workers
between `run` calls (the tools environment sends each turn's calls to the same workers) until
`close()`.

Two jobs are built on it: `run_isolated` scores the rows of a table with a reward function
(the score stage), and `call_isolated` calls any module-level function on each item of a list.
The tools environment (curation/env/environments.py) keeps one pool of `CallEach(RunTool(...))`
for its life and sends it each turn's tool calls.

Workers are fresh interpreters (`python -c ...`, not multiprocessing): no fork of a parent
that holds DuckDB, Polars and torch threads, and no re-import of the caller's __main__
script, so a plain script without an `if __name__ == "__main__"` guard works. The job is
pickled to them after the parent's sys.path is set, so a user's `module:function` imports the
same there. The job's `prepare()` runs once per worker, before its first item and outside the
item timeout (a reward's optional `prepare()`, e.g. the math reward imports math-verify there).

    values, errors = run_isolated(fn, inputs, timeout_s=10, workers=4)
    # values[i]: float | None (the raw return), errors[i]: str | None ("ValueError: ...")

Besides the wall-clock timeout, each worker runs under resource limits (`setrlimit`):
`memory_mb` caps its address space (RLIMIT_AS), so a function that allocates without bound
gets a MemoryError (its item fails) or dies alone, instead of the machine's OOM killer
taking the job; `cpu_s` caps the CPU seconds of each item (RLIMIT_CPU, raised before every
item), so a function that burns several cores within its timeout is stopped too. A worker's
stdout goes to the parent's stderr: a function that prints never mixes with the CLI's output.

For rewards, `inputs` is a table of prompt, messages, response and any of registry.TRL_COLUMNS.
"""

from __future__ import annotations

import math
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import pyarrow as pa

from curation.rewards.registry import trl_arguments
from store.faults import fault_point

_START_TIMEOUT_S = 120.0  # a worker that cannot even import the job's module in this time is a config error


def error_text(exc: BaseException) -> str:
    """'TypeName: message', one line, at most 300 characters."""
    message = str(exc).strip().replace("\n", " ")
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def as_score(result: object, expected: int) -> list[float | None]:
    """Check a reward function's return value: a list of `expected` numbers or Nones."""
    if not hasattr(result, "__len__") or isinstance(result, (str, bytes, dict, set, frozenset)):
        raise TypeError(f"reward function returned {type(result).__name__}, expected a list of floats")
    if len(result) != expected:
        raise ValueError(f"reward function returned {len(result)} scores for {expected} completions")
    out: list[float | None] = []
    for value in result:
        if value is None:
            out.append(None)
        elif isinstance(value, (str, bytes)):
            raise TypeError(f"reward function returned a {type(value).__name__} score {value!r}")
        else:
            out.append(float(value))
    return out


# ---- jobs ---------------------------------------------------------------------------


class IsolatedJob(Protocol):
    """What a worker process runs, pickled to it once: `prepare()` before the first item,
    `decode(data)` turns a chunk's bytes (made by the parent's `encode`) into its items, and
    `__call__(item)` computes one item's result, which must pickle; an exception it raises
    becomes that item's error text."""

    def prepare(self) -> None: ...

    def decode(self, data: bytes) -> Sequence[Any]: ...

    def __call__(self, item: Any) -> Any: ...


class CallEach:
    """The job of `call_isolated`: `fn(item)` for each item of a pickled list."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def prepare(self) -> None:
        if hasattr(self.fn, "prepare"):
            self.fn.prepare()

    def decode(self, data: bytes) -> Sequence[Any]:
        return pickle.loads(data)

    def __call__(self, item: Any) -> Any:
        result = self.fn(item)
        pickle.dumps(result)  # a result that cannot be sent back is this item's error, not a dead worker
        return result


class ScoreRows:
    """The job of `run_isolated`: a reward function over table rows sent as Arrow IPC, one
    completion at a time in TRL's form."""

    def __init__(self, fn: Callable[..., list]):
        self.fn = fn

    def prepare(self) -> None:
        if hasattr(self.fn, "prepare"):
            self.fn.prepare()

    def decode(self, data: bytes) -> Sequence[Any]:
        prompts, completions, columns = trl_arguments(pa.ipc.open_stream(data).read_all())
        return [(prompts[i], completions[i], {k: [v[i]] for k, v in columns.items()})
                for i in range(len(completions))]

    def __call__(self, item: tuple[Any, Any, dict[str, list]]) -> float | None:
        prompt, completion, columns = item
        return as_score(self.fn([prompt], [completion], **columns), 1)[0]


def table_chunks(table: pa.Table) -> Callable[[int, int], pa.Buffer]:
    """An `encode` for rows [start, stop) of a table: Arrow IPC, so a slice sends only its rows
    (a pa.Buffer, sent without a copy)."""

    def encode(start: int, stop: int) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        rows = table.slice(start, stop - start)
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_table(rows)
        return sink.getvalue()

    return encode


# ---- the worker ---------------------------------------------------------------------


def _cpu_seconds_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _limit_cpu(cpu_s: float | None) -> None:
    """Let the next item use at most `cpu_s` more CPU seconds (SIGXCPU ends the worker past it)."""
    if cpu_s is not None:
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(_cpu_seconds_used() + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def worker_main(read_fd: int, write_fd: int, progress_fd: int) -> None:
    """A worker process: load the job, then compute chunks until an empty message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which kills us
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    cpu_s = None
    try:
        sys_path, payload, (memory_mb, cpu_s) = pickle.loads(conn_in.recv_bytes())
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker ended by a limit leaves no core file
        if memory_mb is not None:
            limit = int(memory_mb) * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        sys.path[:] = sys_path
        job = pickle.loads(payload)
        job.prepare()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn_out.send(("error", error_text(exc)))
        return
    conn_out.send(("ready", None))
    while True:
        try:
            data = conn_in.recv_bytes()
        except EOFError:
            return
        if not data:
            return
        results: list[tuple[Any, str | None]] = []
        for item in job.decode(data):
            _limit_cpu(cpu_s)
            os.write(progress_fd, b".")
            try:
                results.append((job(item), None))
            except (Exception, SystemExit) as exc:
                results.append((None, error_text(exc)))
        conn_out.send(("done", results))


# ---- the parent ---------------------------------------------------------------------


class _Worker:
    def __init__(self, payload: bytes, limits: tuple[int | None, float | None] = (None, None)):
        child_in_r, parent_out_w = os.pipe()
        parent_in_r, child_out_w = os.pipe()
        progress_r, progress_w = os.pipe()
        code = (f"from curation.rewards.pool import worker_main; "
                f"worker_main({child_in_r}, {child_out_w}, {progress_w})")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                        stdout=_stderr_fd(), pass_fds=(child_in_r, child_out_w, progress_w),
                                        start_new_session=True)
        for fd in (child_in_r, child_out_w, progress_w):
            os.close(fd)
        self.conn = Connection(parent_in_r, writable=False)
        self.out = Connection(parent_out_w, readable=False)
        self.progress_fd = progress_r
        os.set_blocking(progress_r, False)
        try:
            self.out.send_bytes(pickle.dumps((list(sys.path), payload, limits)))
        except OSError:
            pass  # it died on start-up (its traceback is on stderr); the parent's loop reports it
        self.ready = False
        self.task: tuple[int, int] | None = None  # items [start, stop) being computed
        self.started = 0  # items of `task` the worker has begun
        self.since = time.monotonic()  # when `started` last changed (or the worker started / got work)

    def dispatch(self, task: tuple[int, int], data: bytes | pa.Buffer) -> bool:
        """Send items [start, stop), encoded as `data`; False if the worker is gone (the loop replaces it)."""
        try:
            self.out.send_bytes(data)
        except OSError:
            return False
        self.task, self.started, self.since = task, 0, time.monotonic()
        return True

    def poll_progress(self, now: float) -> int:
        """Count the items begun since the last look (returned); restart the item clock if any."""
        begun = 0
        while True:
            try:
                chunk = os.read(self.progress_fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            begun += len(chunk)
        if begun:
            self.started, self.since = self.started + begun, now
        return begun

    def current_item(self) -> int:
        """The item the worker is on (the first of its task before it has begun one)."""
        return self.task[0] + max(0, self.started - 1)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        if self.progress_fd >= 0:
            self.conn.close()
            self.out.close()
            os.close(self.progress_fd)
            self.progress_fd = -1


def _stderr_fd() -> int | None:
    """The parent's stderr as a file descriptor for a worker's stdout (None: inherit, when stderr
    is not a real file, e.g. under a test's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _close_workers(workers: list[_Worker]) -> None:
    """Ask every worker to exit, give them 2 s together, then kill what is left."""
    for worker in workers:
        try:
            worker.out.send_bytes(b"")
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


class WorkerPool:
    """Up to `workers` worker processes running `job`, each item within `timeout_s` (wall) and
    `cpu_s` (CPU seconds), each worker within `memory_mb` of address space. Workers start on
    the first `run` and stay for the next until `close()` (or the pool is garbage-collected).
    `what` names the function in messages ("reward worker died (exit code 3)"); `started_point`,
    a kill point of store/faults.py passed each time the parent sees a worker begin items.

        with WorkerPool(CallEach(fn), timeout_s=2, what="tool") as pool:
            results, errors = pool.run(len(items), lambda a, b: pickle.dumps(items[a:b]))
    """

    def __init__(self, job: IsolatedJob, *, timeout_s: float, workers: int = 2, memory_mb: int | None = None,
                 cpu_s: float | None = None, what: str = "reward", describe: str | None = None,
                 started_point: str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"worker pool: timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"worker pool: workers must be >= 1, got {workers}")
        self.what, self.describe = what, describe or repr(getattr(job, "fn", job))
        self.started_point = started_point
        try:
            self.payload = pickle.dumps(job)
        except Exception as exc:
            raise ValueError(f"{what} function {self.describe} cannot be sent to worker processes "
                             f"({error_text(exc)}); define it at module level, or as a callable class") from None
        self.limits = (memory_mb, cpu_s)
        self.timeout_s, self.size = timeout_s, workers
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _close_workers, self.workers)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; a later `run` starts fresh ones."""
        _close_workers(self.workers)

    def run(self, n: int, encode: Callable[[int, int], bytes | pa.Buffer],
            chunk_items: int | None = None) -> tuple[list[Any], list[str | None]]:
        """(results, errors) of items 0..n-1, sent to the workers as `encode(start, stop)` chunks:
        results[i] is the job's return for item i (None where it failed), errors[i] its error
        text ("ValueError: boom", "timeout after 2s", "tool worker died (exit code 3)") or None."""
        if n == 0:
            return [], []
        chunk_items = chunk_items or max(1, min(512, math.ceil(n / (self.size * 4))))
        batch = _Batch(self, n, encode, chunk_items)
        finished = False
        try:
            while batch.pending or any(w.task is not None for w in self.workers):
                batch.dispatch()
                ready = set(wait([w.conn for w in self.workers], timeout=0.05))
                now = time.monotonic()
                for k, worker in enumerate(self.workers):
                    if worker.poll_progress(now) and self.started_point is not None:
                        fault_point(self.started_point)
                    dead = worker.conn in ready and batch.receive(worker, now)
                    batch.check(k, worker, dead, now)
            finished = True
        finally:
            if not finished:  # an error or an interrupt: workers may hold half-done chunks
                self.close()
        return batch.results, batch.errors

    def _new_worker(self) -> _Worker:
        return _Worker(self.payload, self.limits)


class _Batch:
    """One `WorkerPool.run`: the results so far and the chunks left. A worker that dies or runs
    past a limit blames the item it was on; the rest of its chunk goes back to the queue and a
    fresh worker takes its place."""

    def __init__(self, pool: WorkerPool, n: int, encode: Callable[[int, int], bytes | pa.Buffer], chunk_items: int):
        self.pool, self.encode = pool, encode
        self.results: list[Any] = [None] * n
        self.errors: list[str | None] = [None] * n
        self.pending = deque((s, min(s + chunk_items, n)) for s in range(0, n, chunk_items))
        workers = pool.workers
        for k, worker in enumerate(workers):
            if not worker.alive():  # died while idle between runs
                worker.kill()
                workers[k] = pool._new_worker()
        while len(workers) < min(pool.size, len(self.pending)):
            workers.append(pool._new_worker())

    def dispatch(self) -> None:
        """Give a chunk to each started worker without one."""
        for worker in self.pool.workers:
            if worker.ready and worker.task is None and self.pending:
                task = self.pending.popleft()
                if not worker.dispatch(task, self.encode(*task)):
                    self.pending.appendleft(task)  # it died while idle: replaced by `check`

    def receive(self, worker: _Worker, now: float) -> bool:
        """Read the worker's messages (started, a chunk's results); True if its pipe broke."""
        while worker.conn.poll():
            try:
                kind, body = worker.conn.recv()
            except (EOFError, OSError):
                return True
            if kind == "error":
                raise RuntimeError(f"{self.pool.what} worker could not load {self.pool.describe}: {body}")
            if kind == "ready":
                worker.ready, worker.since = True, now
            elif kind == "done":
                start, stop = worker.task
                for item, (result, error) in zip(range(start, stop), body):
                    self.results[item], self.errors[item] = result, error
                worker.task = None
        return False

    def check(self, k: int, worker: _Worker, dead: bool, now: float) -> None:
        """Replace the k-th worker if it died or its item ran past the timeout (blaming that
        item); a worker that cannot start is a config error."""
        pool = self.pool
        if dead or not worker.alive():
            worker.process.wait()
            code = _exit_status(worker.process.returncode)
            if not worker.ready:
                raise RuntimeError(f"{pool.what} worker for {pool.describe} died while starting ({code})")
            if worker.task is None:
                worker.kill()
                pool.workers[k] = pool._new_worker()
            elif worker.process.returncode == -signal.SIGXCPU:
                self.requeue_and_replace(k, worker.current_item(), f"over the CPU-time limit of {pool.limits[1]:g}s")
            else:
                self.requeue_and_replace(k, worker.current_item(), f"{pool.what} worker died ({code})")
            return
        if not worker.ready and now - worker.since > max(_START_TIMEOUT_S, pool.timeout_s):
            raise RuntimeError(f"{pool.what} worker for {pool.describe} did not start in {_START_TIMEOUT_S:g}s")
        if worker.task is not None and now - worker.since > pool.timeout_s and not worker.conn.poll():
            self.requeue_and_replace(k, worker.current_item(), f"timeout after {pool.timeout_s:g}s")

    def requeue_and_replace(self, k: int, item: int, error: str) -> None:
        worker = self.pool.workers[k]
        start, stop = worker.task
        self.errors[item], self.results[item] = error, None
        for task in ((item + 1, stop), (start, item)):  # items before `item` were done, but their results died with it
            if task[0] < task[1]:
                self.pending.appendleft(task)
        worker.kill()
        self.pool.workers[k] = self.pool._new_worker()


def _exit_status(returncode: int) -> str:
    """'exit code 3', or 'signal SIGKILL' for a process a signal ended."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def call_isolated(fn: Callable[[Any], Any], items: Sequence[Any], *, timeout_s: float, workers: int = 2,
                  chunk_items: int | None = None, memory_mb: int | None = None, cpu_s: float | None = None,
                  what: str = "worker") -> tuple[list[Any], list[str | None]]:
    """`fn(item)` for each of `items` in `workers` fresh processes, each item within `timeout_s`:
    (results, errors) as `WorkerPool.run` gives them. `fn`, the items and the results must pickle."""
    with WorkerPool(CallEach(fn), timeout_s=timeout_s, workers=workers, memory_mb=memory_mb, cpu_s=cpu_s,
                    what=what, describe=repr(fn)) as pool:
        return pool.run(len(items), lambda start, stop: pickle.dumps(list(items[start:stop])), chunk_items)


def run_isolated(fn, inputs: pa.Table, *, timeout_s: float, workers: int = 2,
                 chunk_rows: int | None = None, memory_mb: int | None = None,
                 cpu_s: float | None = None) -> tuple[list[float | None], list[str | None]]:
    """Score every row of `inputs` with `fn` in `workers` processes, each item within `timeout_s`
    (wall) and `cpu_s` (CPU seconds), each worker within `memory_mb` of address space."""
    if inputs.num_rows == 0:
        return [], []
    with WorkerPool(ScoreRows(fn), timeout_s=timeout_s, workers=workers, memory_mb=memory_mb, cpu_s=cpu_s,
                    what="reward", describe=repr(fn)) as pool:
        return pool.run(inputs.num_rows, table_chunks(inputs), chunk_rows)


def run_inline(fn, inputs: pa.Table, *, batch_rows: int = 1024) -> tuple[list[float | None], list[str | None]]:
    """Score `inputs` with `fn` in this process, `batch_rows` at a time; a batch that raises is
    retried row by row so that the error lands on the row that caused it."""
    values: list[float | None] = [None] * inputs.num_rows
    errors: list[str | None] = [None] * inputs.num_rows
    for start in range(0, inputs.num_rows, batch_rows):
        prompts, completions, columns = trl_arguments(inputs.slice(start, batch_rows))
        try:
            values[start : start + len(completions)] = as_score(fn(prompts, completions, **columns), len(completions))
            continue
        except Exception:  # noqa: BLE001 - find the row
            pass
        for i in range(len(completions)):
            try:
                values[start + i] = as_score(fn([prompts[i]], [completions[i]],
                                                **{k: [v[i]] for k, v in columns.items()}), 1)[0]
            except Exception as exc:  # noqa: BLE001
                errors[start + i] = error_text(exc)
    return values, errors


def default_workers() -> int:
    """Worker processes when the config does not say: the CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))
