"""Helpers the test modules share: paths and the toy, the CLI, hand-made tables and runs, the
run specs of the end-to-end tests, generate and Ray checks, prompt choice, and loop-written
references for the losses. Fixtures live in the conftest files; the two fixtures here
(`prompts_file`, `vllm_generator`) are taken into a test module by assignment.

torch, transformers and safetensors are imported inside the helpers that need them, so a test
module that imports this one for a path or a table does not load them.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.generate.base import SamplingConfig, prompt_id_of
from store.run_store import RunStore
from store.schema import SCHEMAS, TRAJECTORY_FIELDS, empty

if TYPE_CHECKING:
    from pipelines.loop.run import RoundContext

# ---------------------------------------------------------------------------------------------
# Paths and the toy
# ---------------------------------------------------------------------------------------------


REPO = Path(__file__).resolve().parents[1]


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Held while a test builds (or finds cached) the toy at `out`: two xdist workers that
    want the same toy build it once, the second waiting for the first's cache."""
    with open(Path(tempfile.gettempdir()) / f"groupforge-test-build-{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def make_toy_run(toy_dir: Path, folder: Path, prompts_from: str, n_prompts: int, group_size: int,
                 max_tokens: int, rounds=(0, 1), **sampling) -> Path:
    """A run with `rounds` of the first `n_prompts` toy prompts of `prompts_from`
    ("train" or "eval"), sampled with the transformers backend (fast to start); seed = round;
    `sampling`: more SamplingConfig settings (temperature, top_p, top_k)."""
    from curation.generate.stage import generate

    prompts_file = folder / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / f"{prompts_from}.parquet").slice(0, n_prompts), prompts_file)
    run_dir = folder / "run"
    for round in rounds:
        generate(run_dir, prompts_file, SamplingConfig(group_size=group_size, max_tokens=max_tokens, seed=round,
                                                       **sampling),
                 model=toy_dir / "model", backend="hf", round=round)
    return run_dir


def check_same_seed_same_bytes(tmp_path: Path, config) -> Path:
    """Builds `config` twice with seed 3 (a, b: byte-identical files) and once with seed 4 (c:
    other weights); returns a."""
    from pipelines.toy.build import build_toy

    a = build_toy(tmp_path / "a", seed=3, progress=False, config=config)
    b = build_toy(tmp_path / "b", seed=3, progress=False, config=config)
    for name in ("model/model.safetensors", "model/tokenizer.json", "train.parquet", "eval.parquet"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_toy(tmp_path / "c", seed=4, progress=False, config=config)
    assert (a / "model/model.safetensors").read_bytes() != (c / "model/model.safetensors").read_bytes()
    return a


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


GROUPFORGE = str(Path(sys.executable).parent / "groupforge")


ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def groupforge(*args, timeout=600) -> subprocess.CompletedProcess:
    """The installed `groupforge` command with `args`, its output captured."""
    return subprocess.run([GROUPFORGE, *map(str, args)], capture_output=True, text=True, env=ENV, timeout=timeout)


def groupforge_in_process(*args, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`groupforge args` run in this process, as `groupforge()` runs it in a child: in `cwd`, with
    `env` added to the environment, its stdout and stderr captured (the consoles 200 columns wide
    and without colour, as on a pipe), its exit code from SystemExit, an exception that escapes
    printed as a traceback on stderr with exit code 1, warnings printed on stderr under Python's
    default filters, and torch's thread count OMP_NUM_THREADS's (as a child's torch starts with).
    Not for a command that starts a vLLM engine: one that fails may leave its state in this
    process. Afterwards the environment, cwd, sys.argv, sys.excepthook (typer sets it), the
    consoles, the logging handlers (also those a command's log file replaced:
    curation/library_logs.py) and torch's thread count are as they were before. A test that runs
    the CLI to its end, not killed and without vLLM, saves the ~9 s a child takes to import
    torch, transformers and matplotlib."""
    import io
    import logging
    import traceback
    import warnings

    import torch  # loaded here, so that its thread count is set for the call and put back after

    from pipelines.cli.app import console, err_console
    from pipelines.cli.main import main

    argv = ["groupforge", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv, saved_hook = dict(os.environ), os.getcwd(), sys.argv, sys.excepthook
    saved_out, saved_err = sys.stdout, sys.stderr
    saved_consoles = [(c, c._width, c._height, c._color_system) for c in (console, err_console)]
    capture = {id(saved_out): out, id(saved_err): err, id(sys.__stdout__): out, id(sys.__stderr__): err}

    def stream_handlers() -> list[logging.StreamHandler]:
        loggers = [logging.root, *(x for x in logging.Logger.manager.loggerDict.values()
                                   if isinstance(x, logging.Logger))]
        return [h for x in loggers for h in x.handlers  # (logging's _StderrHandler follows sys.stderr)
                if isinstance(h, logging.StreamHandler) and "stream" in vars(h)]

    def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    def loggers() -> dict[str, logging.Logger]:
        return {"": logging.root, **{name: x for name, x in logging.Logger.manager.loggerDict.items()
                                      if isinstance(x, logging.Logger)}}

    logger_state = {name: (x.handlers[:], x.level, x.propagate) for name, x in loggers().items()}
    capturing_warnings = logging._warnings_showwarning is not None
    moved = [(h, h.stream) for h in stream_handlers() if id(h.stream) in capture]
    threads = torch.get_num_threads()
    code = 0
    try:
        os.environ.update({key: str(value) for key, value in (env or {}).items()})
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # as a child's torch starts with
        for handler, stream in moved:  # a handler on this process's stdout or stderr: captured too
            handler.setStream(capture[id(stream)])
        os.environ["COLUMNS"] = "200"
        os.chdir(cwd)
        sys.argv = argv
        for c in (console, err_console):
            c.size = (200, 25)
            c._color_system = None
        with warnings.catch_warnings():
            warnings.resetwarnings()  # Python's default filters: pytest's would record a warning, not print it
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = show_warning
            sys.stdout, sys.stderr = out, err
            try:
                main()
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:  # sys.exit("message"): the message on stderr, exit code 1
                    print(exc.code, file=err)
                    code = 1
            except Exception:
                traceback.print_exc(file=err)
                code = 1
    finally:
        sys.stdout, sys.stderr = saved_out, saved_err
        from curation.library_logs import LibraryLogHandler, OwnWarningsHandler

        for name, x in loggers().items():  # a command log's handlers off, the ones they replaced back
            for handler in x.handlers[:]:
                if isinstance(handler, (LibraryLogHandler, OwnWarningsHandler)):
                    x.removeHandler(handler)
                    handler.close()
            if name in logger_state:
                handlers, level, x.propagate = logger_state[name]
                x.handlers[:] = handlers
                x.setLevel(level)
        logging.captureWarnings(capturing_warnings)
        for handler, stream in moved:
            handler.setStream(stream)
        for handler in stream_handlers():  # added while the output was captured
            if handler.stream is out or handler.stream is err:
                handler.setStream(saved_out if handler.stream is out else saved_err)
        for c, width, height, colors in saved_consoles:
            c._width, c._height, c._color_system = width, height, colors
        sys.argv, sys.excepthook = saved_argv, saved_hook
        torch.set_num_threads(threads)
        os.chdir(saved_cwd)
        for name in set(os.environ) - set(saved_env):
            del os.environ[name]
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one "error: ..." line a failed command printed."""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{proc.stderr}"
    assert lines[0].startswith("error: ")
    return lines[0]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `cli`: this process's, one torch thread, this checkout first on the
    path (the installed `groupforge` runs another checkout's code), and `env`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}


def cli(*args, env: dict[str, str] | None = None, cwd: Path = REPO, timeout: float = 600
        ) -> subprocess.CompletedProcess:
    """This checkout's CLI, `python -m pipelines.cli args`, in a process of its own in `cwd`
    (`cli_env(env)`), its output captured."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=cli_env(env))


def cli_all(commands: list[tuple[list, dict[str, str] | None]], cwd: Path = REPO, timeout: float = 600
            ) -> list[subprocess.CompletedProcess]:
    """Each (args, env) of `commands` run as `cli` runs it, all at once (a command that fails
    early is mostly Python start-up); their results, in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "pipelines.cli", *map(str, args)], cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(env))
             for args, env in commands]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def stopped_with(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one "error: ..." line of a command that ran for a while (other lines on stderr: its
    progress) and exited with `code`, with no traceback."""
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{proc.stderr[-3000:]}"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


# ---------------------------------------------------------------------------------------------
# Hand-made tables and runs
# ---------------------------------------------------------------------------------------------


def samples_and_scores(rows: list[dict], round: int = 0, run_id: str = "r") -> tuple[pa.Table, pa.Table]:
    """samples and scores tables of `rows`: dicts with prompt_id, sample_idx, reward and
    optionally response, n_tokens, finish_reason, scored (False: no scores row at all)."""
    samples = pa.Table.from_pylist([
        {"run_id": run_id, "round": round, "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
         "group_size": 8, "prompt_token_ids": [1, 2], "response": r.get("response", f"answer {r['sample_idx']}"),
         "response_token_ids": [7] * r.get("n_tokens", 3), "behavior_logprobs": [-0.5] * r.get("n_tokens", 3),
         "finish_reason": r.get("finish_reason", "stop"), "policy_version": 0, "generator": "test", "seed": 1}
        for r in rows
    ], schema=SCHEMAS["samples"])
    scores = pa.Table.from_pylist([
        {"run_id": run_id, "round": round, "prompt_id": r["prompt_id"], "sample_idx": r["sample_idx"],
         "reward": r["reward"], "scorer": "{}"}
        for r in rows if r.get("scored", True)
    ], schema=SCHEMAS["scores"])
    return samples, scores


TRAJECTORY_SCHEMA = pa.schema(list(SCHEMAS["samples"]) + TRAJECTORY_FIELDS)
"""A multi-turn samples table's schema: the contract's columns, then the trajectory columns."""


def trajectory_row(turns: list[tuple[str, list[int]]], prompt_id: str = "p0", sample_idx: int = 0, round: int = 0,
                   prompt: tuple[int, ...] = (1, 2, 3), logprob: float = -0.5, reward: float | None = None,
                   run_id: str = "r") -> dict:
    """A multi-turn samples row built by hand from its turns, (role, token ids) in order:
    response_mask 1 on the assistant turns' tokens, behavior_logprobs `logprob` there and 0.0
    on the tool/environment tokens, one turn_rewards value per assistant turn (`reward` on the
    last), a tool call per tool turn, stop_reason "done"."""
    tokens, mask, spans, start = [], [], [], 0
    for role, ids in turns:
        tokens += ids
        mask += [int(role == "assistant")] * len(ids)
        spans.append({"role": role, "start": start, "length": len(ids)})
        start += len(ids)
    assistant = sum(role == "assistant" for role, _ in turns)
    messages = [{"role": role, "content": " ".join(map(str, ids))} for role, ids in turns]
    return {"run_id": run_id, "round": round, "prompt_id": prompt_id, "sample_idx": sample_idx, "group_size": 2,
            "prompt_token_ids": list(prompt), "response": messages[-1]["content"], "response_token_ids": tokens,
            "behavior_logprobs": [logprob if m else 0.0 for m in mask], "finish_reason": "stop",
            "policy_version": 0, "generator": "test", "seed": 1,
            "response_mask": mask, "turns": spans, "num_turns": assistant, "messages_out": json.dumps(messages),
            "turn_rewards": [None] * (assistant - 1) + [reward], "tool_calls": sum(r == "tool" for r, _ in turns),
            "tool_errors": 0, "stop_reason": "done"}


def trajectory_table(rows: list[dict]) -> pa.Table:
    """A multi-turn samples table (TRAJECTORY_SCHEMA) of rows such as trajectory_row's."""
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def group_rows(rewards: dict[str, list[float | None]]) -> list[dict]:
    """One row per reward: prompt_id -> rewards by sample_idx."""
    return [{"prompt_id": p, "sample_idx": i, "reward": r} for p, rs in rewards.items() for i, r in enumerate(rs)]


def rejects_of(rows: list[tuple[str, int | None]], stage: str = "score", reason: str = "invalid_reward",
               round: int = 0, run_id: str = "r") -> pa.Table:
    """A rejects table of (prompt_id, sample_idx or None for the whole prompt) rows."""
    return pa.Table.from_pylist([
        {"run_id": run_id, "round": round, "prompt_id": p, "sample_idx": i, "stage": stage, "reason": reason,
         "detail": None} for p, i in rows
    ], schema=SCHEMAS["rejects"])


def commit_inputs(store: RunStore, round: int, samples: pa.Table, scores: pa.Table,
                  score_rejects: pa.Table | None = None) -> None:
    """Write a round's samples and scores as the generate and score stages would."""
    with store.commit("generate", round, inputs={}, config={}) as commit:
        commit.write("samples", samples, part="generate")
        commit.write("rejects", empty("rejects"), part="generate")
    with store.commit("score", round, inputs={}, config={}) as commit:
        commit.write("scores", scores, part="score")
        commit.write("rejects", score_rejects if score_rejects is not None else empty("rejects"), part="score")


def rewards_table(rewards: dict[str, list[float]], round: int = 0) -> pa.Table:
    """A table of (run_id, round, prompt_id, sample_idx, reward), prompt_id -> rewards by sample_idx."""
    rows = group_rows(rewards)
    return pa.table({
        "run_id": ["r"] * len(rows), "round": pa.array([round] * len(rows), pa.int32()),
        "prompt_id": [r["prompt_id"] for r in rows],
        "sample_idx": pa.array([r["sample_idx"] for r in rows], pa.int32()),
        "reward": pa.array([r["reward"] for r in rows], pa.float64()),
    })


HAND_MADE_RESPONSES = {"p0": ["4", "4", "4", "4"], "p1": ["4", "5", "4", "6"], "p2": ["5", "4", "5", "5"]}


def hand_made_run(run: Path, rounds=(0,)) -> Path:
    """A run as generate leaves it, without a model: 3 prompts (reference "4") x 4 samples per round."""
    store = RunStore(run)
    prompts = pa.table({"prompt_id": list(HAND_MADE_RESPONSES), "prompt": ["2+2=", "1+3=", "0+4="],
                        "reference": ["4"] * 3})
    for round in rounds:
        rows = [{"prompt_id": p, "sample_idx": i, "reward": 0.0, "response": text}
                for p, texts in HAND_MADE_RESPONSES.items() for i, text in enumerate(texts)]
        samples, _ = samples_and_scores(rows, round=round)
        with store.commit("generate", round, inputs={"prompts": "sha"}, config={}) as commit:
            commit.write("samples", samples, part="generate")
            commit.write("rejects", empty("rejects"), part="generate")
            commit.write("prompts", prompts, part="hand-made", round=None)
            commit.record(rows_in=len(HAND_MADE_RESPONSES), rows_out=samples.num_rows)
    return run


def round_records(run_dir):
    """The round records of RUN/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "round"]


def step_records(run_dir):
    """The step records of RUN/metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "step"]


def commit_rows(run_dir: Path) -> list[dict]:
    """The rows of RUN/_commits read with deltalake, not the store, oldest first; each row's
    manifest and versions decoded."""
    from deltalake import DeltaTable

    rows = DeltaTable(str(Path(run_dir) / "_commits")).to_pyarrow_table().sort_by("seq").to_pylist()
    return [{**r, "manifest": json.loads(r["manifest"] or "{}"), "versions": json.loads(r["versions"])} for r in rows]


def edit_commit_row(run_dir: Path, seq: int, edit) -> Path:
    """Rewrite by hand the RUN/_commits file holding row `seq`: `edit(row)` returns the new row
    (its manifest a JSON string). The file's path."""
    for path in sorted((Path(run_dir) / "_commits").glob("*.parquet")):
        table = pq.read_table(path)
        rows = table.to_pylist()
        if any(r["seq"] == seq for r in rows):
            pq.write_table(pa.Table.from_pylist([edit(r) if r["seq"] == seq else r for r in rows],
                                                schema=table.schema), path)
            return path
    raise AssertionError(f"no row {seq} in {run_dir}/_commits")


def logged_files(run_dir: Path, table: str, rounds=None) -> list[Path]:
    """The live files of `table` (`rounds`: only those rounds') as the run's `_commits` rows
    list them, read without the store: the newest commit per (stage, round) and the files
    imports take in. Unlike a glob of the table folder, this leaves out files of earlier
    versions, killed commits' files and the Delta log's own files."""
    newest, imported = {}, set()
    for row in commit_rows(run_dir):
        if row["kind"] == "commit":
            newest[(row["stage"], row["round"])] = set(row["manifest"].get("outputs", []))
        elif row["kind"] == "import":
            imported |= set(row["manifest"].get("outputs", []))
    live = imported.union(*newest.values())
    folders = None if rounds is None else {f"round={r}" for r in rounds}
    return sorted(Path(run_dir) / rel for rel in live if rel.split("/")[0] == table
                  and (folders is None or rel.split("/")[1] in folders))


def parquet_sql(run_dir: Path, table: str, rounds=None) -> str:
    """DuckDB's read_parquet over the live files of `table` (`logged_files`), without hive columns."""
    files = [str(f) for f in logged_files(run_dir, table, rounds)]
    assert files, f"no live {table} file in {run_dir}"
    return f"read_parquet({files!r}, hive_partitioning = false, union_by_name = true)"


def check_tables(run_dir):
    """Every (round, prompt_id, sample_idx) once in samples; groups + rejects (a run may have
    none) cover samples exactly."""
    dup = duckdb.sql("SELECT count(*) - count(DISTINCT (round, prompt_id, sample_idx)) "
                     f"FROM {parquet_sql(run_dir, 'samples')}")
    assert dup.fetchall()[0][0] == 0
    rejected = f"""
            UNION ALL
            SELECT s.round, s.prompt_id, s.sample_idx, 1 FROM {parquet_sql(run_dir, 'rejects')} r
            JOIN {parquet_sql(run_dir, 'samples')} s
              ON s.round = r.round AND s.prompt_id = r.prompt_id
             AND (r.sample_idx IS NULL OR r.sample_idx = s.sample_idx)""" if logged_files(run_dir, "rejects") else ""
    uncovered = duckdb.sql(f"""
        WITH covered AS (
            SELECT round, prompt_id, sample_idx, 1 AS n FROM {parquet_sql(run_dir, 'groups')}{rejected})
        SELECT count(*) FROM {parquet_sql(run_dir, 'samples')} s
        LEFT JOIN (SELECT round, prompt_id, sample_idx, sum(n) AS n FROM covered GROUP BY ALL) c
          USING (round, prompt_id, sample_idx)
        WHERE c.n IS DISTINCT FROM 1""")
    assert uncovered.fetchall()[0][0] == 0


def check_invariants(run_dir: Path) -> None:
    """A finished (or stopped) run folder, read without the store: `check_tables`; every file
    a row of `_commits` lists there with the sha256, size and rows its manifest records; no part
    file in a table folder that no row lists; each table's Delta version that the newest row
    records listing the live files; each round and step once in metrics.jsonl; every checkpoint
    loading with transformers."""
    from deltalake import DeltaTable

    check_tables(run_dir)
    listed = set()
    rows = commit_rows(run_dir)
    for row in rows:
        manifest = row["manifest"]
        for rel, meta in (manifest.get("output_files") or {}).items():
            file, where = run_dir / rel, f"row {row['seq']} of _commits"
            assert file.is_file(), f"{where} lists {rel}, which is missing"
            assert file.stat().st_size == meta["size"], f"{rel}: size differs from {where}"
            assert hashlib.sha256(file.read_bytes()).hexdigest() == meta["sha256"], f"{rel}: sha256 differs"
            assert pq.read_metadata(file).num_rows == manifest["output_rows"][rel], f"{rel}: rows differ"
            listed.add(rel)
    for table in ("samples", "scores", "groups", "rejects", "pairs", "prompts"):
        folder = run_dir / table
        files = [f for f in folder.rglob("*.parquet") if "_delta_log" not in f.parts] if folder.is_dir() else []
        for file in files:
            rel = file.relative_to(run_dir).as_posix()
            assert rel in listed, f"{rel} is in a table folder but no row of _commits lists it"
        if files:
            live = {f.relative_to(folder).as_posix() for f in logged_files(run_dir, table)}
            version = rows[-1]["versions"][table]
            uris = {Path(uri.removeprefix("file://")).relative_to(folder.resolve()).as_posix()
                    for uri in DeltaTable(str(folder), version=version).file_uris()}
            assert uris == live, f"{table}: its Delta version {version} and the _commits rows differ"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r["round"] for r in records if r["event"] == "round"]
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert rounds == sorted(set(rounds)) and steps == sorted(set(steps)), "a round or step is logged twice"
    from transformers import AutoModelForCausalLM

    for folder in sorted((run_dir / "checkpoints").glob("step-*")):
        AutoModelForCausalLM.from_pretrained(folder)  # loads, weights and config complete
    assert duckdb.sql(f"SELECT count(*) FROM {parquet_sql(run_dir, 'samples')}").fetchall()[0][0] > 0


# ---------------------------------------------------------------------------------------------
# Run specs of the end-to-end tests
# ---------------------------------------------------------------------------------------------


E2E_SPEC = """
[run]
name = "e2e"
rounds = 2
steps_per_round = 2
seed = 3

[model]
path = "{toy}/model"

[prompts]
train = [{train}]
eval = "{toy}/eval.parquet"
per_round = 24
eval_limit = 64

[generator]
backend = "vllm"
group_size = 4
max_tokens = 6

[filter]
drop_duplicates = false

[train]
objective = "grpo"
batch_size = 32
token_budget = 256
lr = 1e-4
"""
"""Two rounds of the toy with vLLM and grpo: `{toy}` the toy folder, `{train}` the train files."""


FAULTS_SPEC = (E2E_SPEC.replace('backend = "vllm"', 'backend = "hf"\nchunk_prompts = 8')
               .replace("per_round = 24", "per_round = 16").replace("eval_limit = 64", "eval_limit = 32"))
"""E2E_SPEC on the transformers backend, in chunks of 8 prompts, with fewer prompts."""


OPTIONS_SPEC = """
[run]
name = "options"
rounds = {rounds}
steps_per_round = 2
seed = 5
checkpoint_every = {checkpoint_every}
{refill}

[model]
path = "{toy}/model"

[prompts]
train = ["{toy}/train.parquet"]
eval = "{toy}/eval.parquet"
per_round = 16
eval_limit = 48

[generator]
backend = "hf"
group_size = 4
max_tokens = 6

[filter]
drop_duplicates = false

[train]
objective = "grpo"
batch_size = 32
token_budget = 256
lr = 1e-4

[eval]
every = {eval_every}
"""
"""A toy run on the transformers backend whose rounds, checkpoints, refill and eval are format fields."""


# ---------------------------------------------------------------------------------------------
# Generate: a live vLLM generator and log-probs to check behavior_logprobs against
# ---------------------------------------------------------------------------------------------


SAMPLING = SamplingConfig(group_size=4, max_tokens=8, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def prompts_file(toy_dir: Path, tmp_path_factory) -> Path:
    """24 eval prompts of the toy, with their references."""
    table = pq.read_table(toy_dir / "eval.parquet").slice(0, 24)
    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def vllm_generator(toy_dir: Path):
    from curation.generate.vllm import VLLMGenerator

    generator = VLLMGenerator(toy_dir / "model", dtype="float32")
    yield generator
    generator.close()


def transformers_logprobs(model, samples: pa.Table, temperature: float = 1.0) -> list[list[float]]:
    """log p(response token | prefix) from one plain fp32 forward per sample."""
    import torch

    out = []
    with torch.no_grad():
        for prompt_ids, response_ids in zip(
            samples.column("prompt_token_ids").to_pylist(), samples.column("response_token_ids").to_pylist()
        ):
            ids = torch.tensor([prompt_ids + response_ids])
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
            out.append(logp.tolist())
    return out


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The mean |a - b| over every token of two equally shaped ragged lists."""
    flat_a = [x for row in a for x in row]
    flat_b = [x for row in b for x in row]
    assert len(flat_a) == len(flat_b) > 0
    return sum(abs(x - y) for x, y in zip(flat_a, flat_b)) / len(flat_a)


def load_fp32(folder: Path):
    """The model in `folder`, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_samples_table(samples: pa.Table, n_prompts: int, group_size: int) -> None:
    """n_prompts x group_size rows, each with log-probs <= 0 per response token, a finish
    reason, and a unique (prompt_id, sample_idx)."""
    assert samples.num_rows == n_prompts * group_size
    for ids, logprobs, reason in zip(
        samples.column("response_token_ids").to_pylist(),
        samples.column("behavior_logprobs").to_pylist(),
        samples.column("finish_reason").to_pylist(),
    ):
        assert len(ids) == len(logprobs) >= 1
        assert all(lp <= 0.0 for lp in logprobs)
        assert reason in {"stop", "length"}
    keys = samples.select(["prompt_id", "sample_idx"]).to_pylist()
    assert len({(k["prompt_id"], k["sample_idx"]) for k in keys}) == samples.num_rows


def perturbed_model(toy_dir: Path, out: Path, scale: float = 0.05, seed: int = 3) -> Path:
    """A copy of the toy model with every weight moved, the LM head included."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(toy_dir / "model", out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    new = {k: (v + scale * v.std() * torch.randn(v.shape, generator=gen)).contiguous() for k, v in state.items()}
    head = state["lm_head.weight"]
    new["lm_head.weight"] = (head * 1.5 + 0.1 * torch.randn(head.shape, generator=gen)).contiguous()
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------------------------------------
# Ray
# ---------------------------------------------------------------------------------------------

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a test's own local cluster needs no tokens


def ray_temp_dir() -> str:
    """A short temp folder for Ray's sessions and sockets: unix socket paths are limited to 107
    bytes, and pytest's (with xdist's popen-gwN) leave too little. Removed at exit."""
    path = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def sample_columns(samples: pa.Table) -> list[dict]:
    """What an engine decides, row by row (prompt order kept): tokens, log-probs, finish, seed."""
    return samples.select(["prompt_id", "sample_idx", "response_token_ids", "behavior_logprobs", "finish_reason",
                           "seed", "policy_version", "generator"]).to_pylist()


RAY_SAMPLING = SamplingConfig(group_size=4, max_tokens=8, seed=11)
"""The sampling of the Ray engine tests, whose engines' samples are checked against one in-process engine's."""


# ---------------------------------------------------------------------------------------------
# Prompt choice
# ---------------------------------------------------------------------------------------------


PROMPTS = [f"{a} + {b} =" for a in range(4) for b in range(5)]  # 20 distinct prompts


def prompt_file(path: Path, texts: list[str]) -> Path:
    """A prompts file of `texts` (reference "x")."""
    pq.write_table(pa.table({"prompt": texts, "reference": ["x"] * len(texts)}), path)
    return path


def context(run_dir: Path, train: list[Path], per_round: int, seed: int = 0) -> "RoundContext":
    """The round context of a run over `train` with `per_round` prompts a round."""
    from pipelines.loop.run import RoundContext
    from pipelines.spec import PipelineSpec

    spec = PipelineSpec.model_validate({
        "run": {"name": "choose", "seed": seed}, "model": {"path": "unused"},
        "prompts": {"train": [str(f) for f in train], "eval": "unused.parquet", "per_round": per_round}})
    return RoundContext(spec=spec, store=RunStore(run_dir))


def sampled(store: RunStore, round: int, texts: list[str], group_size: int = 2) -> None:
    """A samples table for `round`: `group_size` responses to each of `texts`."""
    rows = [{"run_id": "choose", "round": round, "prompt_id": prompt_id_of(text, None), "sample_idx": i,
             "group_size": group_size, "prompt_token_ids": [1, 2], "response": "r", "response_token_ids": [3],
             "behavior_logprobs": [-0.5], "finish_reason": "stop", "policy_version": 0, "generator": "test",
             "seed": 0}
            for text in texts for i in range(group_size)]
    with store.commit("generate", round, {}, {}) as commit:
        commit.write("samples", pa.Table.from_pylist(rows, schema=SCHEMAS["samples"]))


def chosen(path: Path) -> list[str]:
    """The chosen prompts' texts, in the order they were chosen."""
    return pq.read_table(path).column("prompt").to_pylist()


def sha64(text: str) -> int:
    """sha256's first 8 bytes as a big-endian integer."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def splitmix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (the reference for the module's numpy version)."""
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def by_tiebreak(texts: list[str], seed: int, round: int) -> list[str]:
    """The seeded order: h = splitmix64(s(prompt_id) ^ s("seed:round")), s = sha256's first 8 bytes."""
    return sorted(texts, key=lambda t: splitmix64(sha64(prompt_id_of(t, None)) ^ sha64(f"{seed}:{round}")))


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


def build_reward_model(folder: Path, toy_dir: Path, num_labels: int = 1) -> Path:
    """A tiny Llama sequence classifier with the toy's tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(toy_dir / "model")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, num_labels=num_labels,
                         id2label={i: ["bad", "good"][i] if num_labels == 2 else f"LABEL_{i}"
                                   for i in range(num_labels)})
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def plain_forward(folder: Path, texts: list[str], index: int) -> list[float]:
    """Logit `index` of each text from a plain transformers forward (the reference for RewardModel)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt")).logits[0, index].item() for t in texts]


# ---------------------------------------------------------------------------------------------
# Losses written as loops over rows and tokens
# ---------------------------------------------------------------------------------------------


def random_batch(seed, B=5, T=7, noise=0.3):
    """Seeded float64 (logp, old, ref, advantages, token advantages, mask) of B rows of up to T tokens."""
    import torch

    F64 = torch.float64
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    logp = -3 * torch.rand(B, T, generator=g, dtype=F64)
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    token_adv = torch.randn(B, T, generator=g, dtype=F64)
    return logp.requires_grad_(), old, ref, adv, token_adv, mask


def loop_agg(v, m, mode, norm_len):
    """agg_loss written as loops over rows and tokens: the reference for its modes."""
    B, T = len(v), len(v[0])
    total, seq_means, num_tokens = 0.0, 0.0, 0.0
    for i in range(B):
        row_sum, row_len = 0.0, 0.0
        for t in range(T):
            row_sum += v[i][t] * m[i][t]
            row_len += m[i][t]
        total += row_sum
        num_tokens += row_len
        seq_means += row_sum / row_len
    if mode == "token-mean":
        return total / num_tokens
    if mode == "seq-mean-token-mean":
        return seq_means / B
    return total / (B * (norm_len or T))


def loop_clip_pg(r, a, cfg):
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A), then the dual clip for A < 0."""
    clipped = min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high)
    pg = -min(r * a, clipped * a)
    if cfg.dual_clip is not None and a < 0:
        pg = min(pg, -cfg.dual_clip * a)
    return pg


def loop_seq_ratio(logp, old, m, i):
    """s_i = exp(sum_t m_it (logp_it - old_it) / |y_i|)."""
    log_sum, length = 0.0, 0.0
    for t in range(len(logp[0])):
        log_sum += m[i][t] * (logp[i][t] - old[i][t])
        length += m[i][t]
    return math.exp(log_sum / length)


PROMPT_STATS_SQL = """
WITH per_round AS (
    SELECT prompt_id, round, count(reward) AS n, count_if(reward >= 1.0) AS p FROM scores GROUP BY ALL
)
SELECT prompt_id, round,
       count(*) OVER upto AS rounds_seen, sum(n) OVER upto AS samples, sum(p) OVER upto AS passes,
       sum(n) OVER recent AS recent_samples, sum(p) OVER recent AS recent_passes
FROM per_round
WINDOW upto AS (PARTITION BY prompt_id ORDER BY round ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW),
       recent AS (PARTITION BY prompt_id ORDER BY round ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
ORDER BY round, prompt_id
"""
"""prompt_stats computed independently of pipelines/loop/curriculum.py from a `scores` table in
scope: each (prompt, round that sampled it), its counts as of that round, the recent ones over
its last 2 rounds (window = 2)."""


# ---------------------------------------------------------------------------------------------
# The bench scripts
# ---------------------------------------------------------------------------------------------

BENCH = REPO / "bench"


def bench_script(name: str):
    """bench/<name>.py as a module, with bench/ on sys.path as when it runs as a script (its helpers
    _curves, _families, ... import). Appended, not prepended: bench/curation.py must not shadow the
    curation package."""
    import importlib.util

    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_curve(framework: str, seconds, accuracy, variant: str = "reverse-512", seed: int = 0, samples=None,
                **extra):
    """A bench run's curve (bench/_curves.py) with these evals, 2,048 samples apart unless `samples`."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    import _curves

    c = _curves.Curve(framework, variant, seed, extra=extra)
    for i, (s, a) in enumerate(zip(seconds, accuracy)):
        c.add(s, samples[i] if samples else 2048 * i, a, cpu_seconds=2 * s, load=1.0)
    return c


def flat_curve(framework: str, level: float, variant: str, seed: int = 0, every: float = 30, **extra):
    """A run that climbs from 0.3 to `level` at its second eval and stays there, an eval every `every` s."""
    return bench_curve(framework, [every * i for i in range(6)], [0.3] + [level] * 5, variant, seed, **extra)
