"""Experiment trackers (pipelines/loop/trackers.py) on real toy runs, read back with each tracker's
own reader: TensorBoard's event reader, the MLflow client on the local file store, trackio's
SQLite file and W&B's offline run file. Each must hold the run's metrics.jsonl values."""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import E2E_SPEC, REPO, groupforge_in_process

SPEC = (E2E_SPEC.replace('backend = "vllm"', 'backend = "hf"').replace("rounds = 2", "rounds = 1")
        .replace("per_round = 24", "per_round = 16").replace("eval_limit = 64", "eval_limit = 32"))
ALL = ["tensorboard", "mlflow", "trackio", "wandb"]
# what each tracker writes, where the user has not pointed it elsewhere
CLEAN_ENV = ("MLFLOW_TRACKING_URI", "TRACKIO_DIR", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR")


def _spec(tmp_path: Path, toy_dir: Path, trackers: list[str]) -> Path:
    path = tmp_path / f"spec-{len(trackers)}.toml"
    text = SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"')
    path.write_text(text.replace("[run]\n", f"[run]\ntrackers = {json.dumps(trackers)}\n", 1))
    return path


def _cli(*args: str, env: dict | None = None, prelude: str = "", in_process: bool = False
         ) -> subprocess.CompletedProcess:
    """`groupforge args` in a child, after a `prelude` (Python run first); `in_process` for a run
    without trackers. The trackers' libraries keep process-wide state behind (W&B's wandb-core
    service process, their threads and atexit hooks), which a test's own process must not get."""
    if in_process:
        return groupforge_in_process(*args, env=env)
    base = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    code = (f"import sys\n{prelude}\nfrom pipelines.cli.main import main\n"
            "sys.argv = ['groupforge', *sys.argv[1:]]\nmain()")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**base, "OMP_NUM_THREADS": "1", **(env or {})})


def _metrics(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """({round: eval_accuracy}, {step: loss}) from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ({r["round"]: r["eval_accuracy"] for r in records if r["event"] == "round"},
            {r["step"]: r["loss"] for r in records if r["event"] == "step"})


def _tensorboard(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in sorted(folder.glob("events.out.tfevents.*")):  # one file per process
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


def _wandb_records(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file: a 7-byte header (":W&B", a key, a version),
    then LevelDB-log records (32 KiB blocks; each chunk: crc32 4, length 2, type 1) holding
    wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def tracked_run(toy_dir, tmp_path_factory):
    """A 1-round run with all four trackers, then extended by a round (a second process)."""
    tmp = tmp_path_factory.mktemp("trackers")
    spec, run_dir = _spec(tmp, toy_dir, ALL), tmp / "run"
    first = _cli("run", str(spec), "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((run_dir / "trackers" / "state.json").read_text())
    again = _cli("run", str(spec), "--run-dir", str(run_dir), "--rounds", "+1")
    assert again.returncode == 0, again.stderr[-3000:]
    return run_dir, state, first.stdout + again.stdout


def test_every_tracker_holds_the_metrics_of_metrics_jsonl(tracked_run):
    run_dir, first_state, stdout = tracked_run
    accuracy, loss = _metrics(run_dir)
    assert sorted(accuracy) == [0, 1, 2] and len(loss) == 4  # 2 rounds of 2 steps
    folder = run_dir / "trackers"
    state = json.loads((folder / "state.json").read_text())
    assert state["round"] == 2 and state["step"] == 4 and state["ids"] == first_state["ids"]  # one run each

    # TensorBoard: both processes' event files, rounds against round, steps against step
    assert _tensorboard(folder / "tensorboard", "eval_accuracy") == pytest.approx(accuracy, abs=1e-6)
    assert _tensorboard(folder / "tensorboard", "loss") == pytest.approx(loss, abs=1e-6)
    assert set(_tensorboard(folder / "tensorboard", "phase_seconds/train")) == {0, 1, 2}

    # MLflow: one run in the local file store, resumed by the second process
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("groupforge").experiment_id])
    assert [r.info.run_id for r in runs] == [state["ids"]["mlflow"]]
    run = runs[0]
    history = client.get_metric_history(run.info.run_id, "eval_accuracy")
    assert {m.step: m.value for m in history} == pytest.approx(accuracy, abs=1e-9) and len(history) == 3
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(loss)
    assert run.data.params["train.objective"] == "grpo" and float(run.data.params["train.lr"]) == 1e-4
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/progress.png", "report/training.png", "report/summary.md"} <= artifacts

    # trackio: its local SQLite file, one run named after the run folder
    with sqlite3.connect(folder / "trackio" / "groupforge.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
        configs = db.execute("SELECT config FROM configs").fetchall()
    assert {name for name, _, _ in rows} == {"run"}
    logged = [(step, json.loads(metrics)) for _, step, metrics in rows]
    assert {s: m["eval_accuracy"] for s, m in logged if "eval_accuracy" in m} == pytest.approx(accuracy)
    assert {s: m["loss"] for s, m in logged if "loss" in m} == pytest.approx(loss)
    assert any(json.loads(c)["train.lr"] == 1e-4 for (c,) in configs)

    # W&B: offline run files (one per process, the same run id), history rows with their axis
    files = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and {f.stem for f in files} == {f"run-{state['ids']['wandb']}"}
    history = [row for f in files for row in _wandb_records(f)]
    assert {r["round"]: r["eval_accuracy"] for r in history if "eval_accuracy" in r} == pytest.approx(accuracy)
    assert {r["step"]: r["loss"] for r in history if "loss" in r} == pytest.approx(loss)
    assert "Trackio" not in stdout  # the libraries' prints go to stderr


def test_trackers_added_later_get_the_history_and_a_failing_one_does_not_stop_the_run(toy_dir, tmp_path):
    run_dir = tmp_path / "run"
    plain = _cli("run", str(_spec(tmp_path, toy_dir, [])), "--run-dir", str(run_dir), in_process=True)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not (run_dir / "trackers").exists()
    # MLflow cannot start on this URI; TensorBoard goes on and gets rounds 0-2
    done = _cli("run", str(_spec(tmp_path, toy_dir, ["mlflow", "tensorboard"])), "--run-dir", str(run_dir),
                "--rounds", "+1", env={"MLFLOW_TRACKING_URI": "nosuchscheme://nowhere"})
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "tracker mlflow failed" in line]
    assert len(warnings) == 1 and "off for the rest of this run" in warnings[0]
    accuracy, loss = _metrics(run_dir)
    assert _tensorboard(run_dir / "trackers" / "tensorboard", "eval_accuracy") == pytest.approx(accuracy)
    assert set(_tensorboard(run_dir / "trackers" / "tensorboard", "loss")) == set(loss) == {1, 2, 3, 4}


def test_a_missing_tracker_package_is_one_error_line(toy_dir, tmp_path):
    run_dir = tmp_path / "run"
    done = _cli("run", str(_spec(tmp_path, toy_dir, ["tensorboard", "wandb"])), "--run-dir", str(run_dir),
                prelude="sys.modules['wandb'] = None  # as if wandb were not installed")
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["error: [run] trackers lists wandb, which is not installed: pip install 'groupforge[wandb]' "
                     "(or groupforge[trackers] for all four)"]
    assert not (run_dir / "metrics.jsonl").exists()


def test_spec_rejects_an_unknown_tracker(toy_dir, tmp_path):
    from pipelines.spec import load_spec

    with pytest.raises(ValueError, match="trackers"):
        load_spec(_spec(tmp_path, toy_dir, ["comet"]))
