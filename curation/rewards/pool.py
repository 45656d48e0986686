"""Running reward functions: in worker processes with a per-item timeout, or inline in batches.

`run_isolated` gives each worker process a copy of the reward function and chunks of rows;
the worker calls the function one completion at a time and writes one byte to a progress
pipe before each item. The parent counts those bytes: an item that runs past `timeout_s`
gets "timeout after Xs" and its worker is killed; a worker that dies (segfault, os._exit,
OOM kill) blames the item it was on. Either way a fresh worker takes over the rest of the
chunk, so one bad completion never blocks or kills the stage.

Workers are fresh interpreters (`python -c ...`, not multiprocessing): no fork of a parent
that holds DuckDB, Polars and torch threads, and no re-import of the caller's __main__
script, so a plain script without an `if __name__ == "__main__"` guard works. The function
is pickled to them after the parent's sys.path is set, so a user's `module:function`
imports the same there. A reward's optional `prepare()` runs once per worker, before its
first item and outside the item timeout (e.g. the math reward imports math-verify there).

    values, errors = run_isolated(fn, inputs, timeout_s=10, workers=4)
    # values[i]: float | None (the raw return), errors[i]: str | None ("ValueError: ...")

Besides the wall-clock timeout, each worker runs under resource limits (`setrlimit`):
`memory_mb` caps its address space (RLIMIT_AS), so a reward that allocates without bound
gets a MemoryError (its row is rejected) or dies alone, instead of the machine's OOM killer
taking the job; `cpu_s` caps the CPU seconds of each item (RLIMIT_CPU, raised before every
item), so a reward that burns several cores within its timeout is stopped too. A worker's
stdout goes to the parent's stderr: a reward that prints never mixes with the CLI's output.

`inputs` is a table of prompt, messages, response and any of registry.TRL_COLUMNS.
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
from collections import deque
from multiprocessing.connection import Connection, wait

import pyarrow as pa

from curation.rewards.registry import trl_arguments

_START_TIMEOUT_S = 120.0  # a worker that cannot even import the reward's module in this time is a config error


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
    """A worker process: load the function, then score chunks until an empty message."""
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
        fn = pickle.loads(payload)
        if hasattr(fn, "prepare"):
            fn.prepare()
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
        prompts, completions, columns = trl_arguments(pa.ipc.open_stream(data).read_all())
        results: list[tuple[float | None, str | None]] = []
        for i in range(len(completions)):
            _limit_cpu(cpu_s)
            os.write(progress_fd, b".")
            try:
                value = as_score(fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()}), 1)[0]
                results.append((value, None))
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
        self.task: tuple[int, int] | None = None  # rows [start, stop) being scored
        self.started = 0  # items of `task` the worker has begun
        self.since = time.monotonic()  # when `started` last changed (or the worker started / got work)

    def dispatch(self, task: tuple[int, int], inputs: pa.Table) -> bool:
        """Send rows [start, stop) to the worker; False if it is gone (the loop replaces it)."""
        sink = pa.BufferOutputStream()
        rows = inputs.slice(task[0], task[1] - task[0])
        with pa.ipc.new_stream(sink, rows.schema) as writer:  # IPC, not pickle: a slice sends only its rows
            writer.write_table(rows)
        try:
            self.out.send_bytes(sink.getvalue())
        except OSError:
            return False
        self.task, self.started, self.since = task, 0, time.monotonic()
        return True

    def poll_progress(self, now: float) -> None:
        """Count the items begun since the last look; restart the item clock if any."""
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

    def current_row(self) -> int:
        """The row the worker is on (the first of its task before it has begun one)."""
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


def run_isolated(fn, inputs: pa.Table, *, timeout_s: float, workers: int = 2,
                 chunk_rows: int | None = None, memory_mb: int | None = None,
                 cpu_s: float | None = None) -> tuple[list[float | None], list[str | None]]:
    """Score every row of `inputs` with `fn` in `workers` processes, each item within `timeout_s`
    (wall) and `cpu_s` (CPU seconds), each worker within `memory_mb` of address space."""
    n = inputs.num_rows
    if n == 0:
        return [], []
    try:
        payload = pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"reward function {fn!r} cannot be sent to worker processes ({error_text(exc)}); "
                         "define it at module level, or as a callable class") from None
    chunk_rows = chunk_rows or max(1, min(512, math.ceil(n / (workers * 4))))
    scoring = _Scoring(fn, inputs, payload, (memory_mb, cpu_s), timeout_s, workers, chunk_rows)
    try:
        while scoring.pending or any(w.task is not None for w in scoring.pool):
            scoring.dispatch()
            ready = set(wait([w.conn for w in scoring.pool], timeout=0.05))
            now = time.monotonic()
            for k, worker in enumerate(scoring.pool):
                worker.poll_progress(now)
                dead = worker.conn in ready and scoring.receive(worker, now)
                scoring.check(k, worker, dead, now)
    finally:
        scoring.close()
    return scoring.values, scoring.errors


class _Scoring:
    """One `run_isolated` call: the results so far, the chunks of rows left, the worker pool.
    A worker that dies or runs past a limit blames the row it was on; the rest of its chunk
    goes back to the queue and a fresh worker takes its place."""

    def __init__(self, fn, inputs: pa.Table, payload: bytes, limits: tuple[int | None, float | None],
                 timeout_s: float, workers: int, chunk_rows: int):
        n = inputs.num_rows
        self.fn, self.inputs, self.payload, self.limits, self.timeout_s = fn, inputs, payload, limits, timeout_s
        self.values: list[float | None] = [None] * n
        self.errors: list[str | None] = [None] * n
        self.pending = deque((s, min(s + chunk_rows, n)) for s in range(0, n, chunk_rows))
        self.pool = [_Worker(payload, limits) for _ in range(min(workers, len(self.pending)))]

    def dispatch(self) -> None:
        """Give a chunk to each started worker without one."""
        for worker in self.pool:
            if worker.ready and worker.task is None and self.pending:
                task = self.pending.popleft()
                if not worker.dispatch(task, self.inputs):
                    self.pending.appendleft(task)  # it died while idle: replaced by `check`

    def receive(self, worker: _Worker, now: float) -> bool:
        """Read the worker's messages (started, a chunk's results); True if its pipe broke."""
        while worker.conn.poll():
            try:
                kind, body = worker.conn.recv()
            except (EOFError, OSError):
                return True
            if kind == "error":
                raise RuntimeError(f"reward worker could not load {self.fn!r}: {body}")
            if kind == "ready":
                worker.ready, worker.since = True, now
            elif kind == "done":
                start, stop = worker.task
                for row, (value, error) in zip(range(start, stop), body):
                    self.values[row], self.errors[row] = value, error
                worker.task = None
        return False

    def check(self, k: int, worker: _Worker, dead: bool, now: float) -> None:
        """Replace pool[k] if it died or its item ran past the timeout (blaming that item);
        a worker that cannot start is a config error."""
        if dead or not worker.alive():
            worker.process.wait()
            code = _exit_status(worker.process.returncode)
            if not worker.ready:
                raise RuntimeError(f"reward worker for {self.fn!r} died while starting ({code})")
            if worker.task is None:
                worker.kill()
                self.pool[k] = _Worker(self.payload, self.limits)
            elif worker.process.returncode == -signal.SIGXCPU:
                self.requeue_and_replace(k, worker.current_row(), f"over the CPU-time limit of {self.limits[1]:g}s")
            else:
                self.requeue_and_replace(k, worker.current_row(), f"reward worker died ({code})")
            return
        if not worker.ready and now - worker.since > max(_START_TIMEOUT_S, self.timeout_s):
            raise RuntimeError(f"reward worker for {self.fn!r} did not start in {_START_TIMEOUT_S:g}s")
        if worker.task is not None and now - worker.since > self.timeout_s and not worker.conn.poll():
            self.requeue_and_replace(k, worker.current_row(), f"timeout after {self.timeout_s:g}s")

    def requeue_and_replace(self, k: int, row: int, error: str) -> None:
        worker = self.pool[k]
        start, stop = worker.task
        self.errors[row], self.values[row] = error, None
        for task in ((row + 1, stop), (start, row)):  # rows before `row` were scored, but their results died with it
            if task[0] < task[1]:
                self.pending.appendleft(task)
        worker.kill()
        self.pool[k] = _Worker(self.payload, self.limits)

    def close(self) -> None:
        """Ask every worker to exit, give them 2 s together, then kill what is left."""
        for worker in self.pool:
            try:
                worker.out.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self.pool:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            worker.kill()


def _exit_status(returncode: int) -> str:
    """'exit code 3', or 'signal SIGKILL' for a process a signal ended."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


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
