"""Experiment trackers: a run's metrics mirrored to TensorBoard, MLflow, trackio and W&B.

    [run]
    trackers = ["tensorboard", "mlflow", "trackio", "wandb"]   # any subset; default none

metrics.jsonl stays the source of truth. The trackers get its records as the loop appends
them (a round's step records, then its round record), under the same names: a number field
keeps its name, a nested one is joined with "/" (phase_seconds.generate ->
"phase_seconds/generate"); round records are logged against `round`, step records against
`step`. Text and list fields (objective, rounds) and nulls (eval_accuracy in a round that
does not evaluate) are left out. The resolved spec goes in as parameters ("section.key"), and
at the end of the run the report's plots (progress.png, training.png) and summary.md as
artifacts.

Everything is offline and under RUN/trackers/ unless the user points a tracker elsewhere
with its own environment variable:

    tensorboard  RUN/trackers/tensorboard/ (event files; `tensorboard --logdir` it)
    mlflow       a local file store at RUN/trackers/mlruns/ (or MLFLOW_TRACKING_URI),
                 experiment "groupforge", one MLflow run per groupforge run
    trackio      trackio's local SQLite at RUN/trackers/trackio/ (or TRACKIO_DIR),
                 project "groupforge" (`trackio show --project groupforge`)
    wandb        offline files at RUN/trackers/wandb/ (WANDB_MODE=online to upload;
                 `wandb sync` them later), project WANDB_PROJECT or "groupforge"

A tracker that raises is turned off for the rest of the run with one warning; the run goes
on. RUN/trackers/state.json keeps the last round logged and the MLflow/W&B run ids, so a
resumed run continues the same tracker runs and first logs what a kill left unlogged; a
tracker added to a finished run's spec gets the whole history on the next invocation.
Each tracker is an optional extra of its own name (`pip install 'groupforge[wandb]'`;
`groupforge[trackers]` installs all four); a missing one is one error line before the run
starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from store.errors import JobError
from store.run_files import read_json, write_json_atomic

TRACKERS_DIR = "trackers"
STATE_FILE = "state.json"
PROJECT = "groupforge"
EXTRA = "trackers"
EVENTS = ("round", "step")
"""The metrics.jsonl events the trackers get; each record is logged against its own number
(a round record against `round`, a step record against `step`)."""
ARTIFACTS = ("progress.png", "training.png", "summary.md")
"""The report's files each tracker gets at the end of a run."""


def check_installed(names: Iterable[str]) -> None:
    """A JobError naming the extra to install when a listed tracker's package (of the tracker's
    name) is missing."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise JobError(f"[run] trackers lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                       f"not installed: pip install 'groupforge[{','.join(missing)}]' (or groupforge[{EXTRA}] "
                       "for all four)")


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The number fields of a metrics record, nested ones joined with "/" (bools as 0/1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def spec_params(spec_dict: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A spec dict (JSON types) as flat parameters {"train.lr": 2e-4, ...}; lists as text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in spec_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(spec_params(value, f"{name}."))
        elif value is not None:
            out[name] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return out


# -- the trackers ------------------------------------------------------------------------------
# Each has start(params, run_id) -> the id to keep for a resume (or None), log(axis, index,
# values), log_files(paths) and close(). They import their library only when started.


class TensorBoard:
    name = "tensorboard"

    def __init__(self, folder: Path, run_name: str):
        self.folder = folder / "tensorboard"

    def start(self, params: dict, run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.folder))
        lines = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("spec", f"| key | value |\n|---|---|\n{lines}", 0)

    def log(self, axis: str, index: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            if name != axis:
                self.writer.add_scalar(name, value, index)
        self.writer.flush()

    def log_files(self, paths: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in paths:
            if path.suffix == ".png":
                self.writer.add_image(f"report/{path.stem}", np.asarray(Image.open(path).convert("RGB")),
                                      dataformats="HWC")
            else:
                self.writer.add_text(f"report/{path.name}", path.read_text())
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow:
    name = "mlflow"

    def __init__(self, folder: Path, run_name: str):
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or (folder / "mlruns").absolute().as_uri()
        self.run_name = run_name

    def start(self, params: dict, run_id: str | None) -> str:
        if self.uri.startswith("file:"):  # MLflow 3 keeps the file store behind an opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(PROJECT)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
            run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # log_batch takes at most 100 params a call
                self.client.log_batch(run_id, params=items[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return run_id

    def log(self, axis: str, index: int, values: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(name, value, now, index) for name, value in values.items() if name != axis]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), artifact_path="report")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackio:
    name = "trackio"

    def __init__(self, folder: Path, run_name: str):
        self.folder = folder / "trackio"
        self.run_name = run_name

    def start(self, params: dict, run_id: str | None) -> None:
        # trackio reads TRACKIO_DIR once, when it is first imported
        os.environ.setdefault("TRACKIO_DIR", str(self.folder.absolute()))
        with _quiet():
            import trackio

            self.trackio = trackio
            trackio.init(project=PROJECT, name=self.run_name, config=params, resume="allow", embed=False,
                         auto_log_cpu=False, auto_log_gpu=False)

    def log(self, axis: str, index: int, values: dict[str, float]) -> None:
        # "step" is a reserved name in trackio: the step is trackio's own step
        with _quiet():
            self.trackio.log({k: v for k, v in values.items() if k != axis}, step=index)

    def log_files(self, paths: list[Path]) -> None:
        with _quiet():
            for path in paths:
                self.trackio.log_artifact(path, name=f"report-{path.stem}", type="report", overwrite=True)

    def close(self) -> None:
        with _quiet():
            self.trackio.finish()


class WandB:
    name = "wandb"

    def __init__(self, folder: Path, run_name: str):
        self.folder = folder
        self.run_name = run_name
        self.defined: set[str] = set()

    def start(self, params: dict, run_id: str | None) -> str:
        import wandb

        run_id = run_id or uuid.uuid4().hex[:12]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=self.run_name, id=run_id,
                              resume="allow", dir=str(self.folder), config=params,
                              settings=wandb.Settings(mode=os.environ.get("WANDB_MODE", "offline"), console="off",
                                                      silent=True, x_disable_stats=True))
        self.wandb = wandb
        return run_id

    def log(self, axis: str, index: int, values: dict[str, float]) -> None:
        if axis not in self.defined:
            self.run.define_metric(axis)
            self.defined.add(axis)
        for name in values.keys() - self.defined:  # each metric against its record's axis
            self.run.define_metric(name, step_metric=axis)
            self.defined.add(name)
        self.run.log({**values, axis: index})

    def log_files(self, paths: list[Path]) -> None:
        artifact = self.wandb.Artifact(f"report-{self.run.id}", type="report")
        for path in paths:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()


_CLASSES = {cls.name: cls for cls in (TensorBoard, MLflow, Trackio, WandB)}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A library's prints go to stderr: the CLI's stdout is the run's own lines."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


# -- the run's set of trackers -----------------------------------------------------------------


class Trackers:
    """The trackers of one invocation of the round loop: `log_records` after each round,
    `finish` at the end. With no trackers configured every method does nothing."""

    def __init__(self, names: Iterable[str], run_dir: str | Path, params: dict[str, Any],
                 warn: Callable[[str], None] = print):
        names = list(dict.fromkeys(names))  # the caller has run check_installed(names)
        self.folder = Path(run_dir) / TRACKERS_DIR
        self.warn = warn
        self.state = (read_json(self.folder / STATE_FILE) or {}) if names else {}
        self.round_mark = int(self.state.get("round", -1))
        self.step_mark = int(self.state.get("step", 0))
        self.logged = False  # whether this invocation logged a round
        self.live: list[Any] = []
        ids = self.state.setdefault("ids", {})
        for name in names:
            tracker = _CLASSES[name](self.folder, Path(run_dir).name)
            run_id = self._call(tracker, "start", params, ids.get(name))
            if run_id is not _FAILED:
                self.live.append(tracker)
                if run_id is not None:
                    ids[name] = run_id
        if self.live:
            self._save()

    def __bool__(self) -> bool:
        return bool(self.live)

    def _call(self, tracker: Any, method: str, *args: Any) -> Any:
        try:
            return getattr(tracker, method)(*args)
        except Exception as exc:  # a tracker never stops a run
            self.warn(f"warning: tracker {tracker.name} failed in {method} ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); it is off for the rest of this run, "
                      "metrics.jsonl has every record")
            if tracker in self.live:
                self.live.remove(tracker)
            return _FAILED

    def _save(self) -> None:
        self.state.update(round=self.round_mark, step=self.step_mark)
        try:
            write_json_atomic(self.folder / STATE_FILE, self.state)
        except OSError as exc:  # a full disk stops the run at its next table write, not here
            self.warn(f"warning: could not write {self.folder / STATE_FILE}: {exc}")

    def log_records(self, records: Iterable[dict]) -> None:
        """Log metrics.jsonl records (file order) the trackers have not had yet: step records
        after the last logged step, round records after the last logged round."""
        if not self.live:
            return
        for record in records:
            event = record.get("event")
            index = record.get(event) if event in EVENTS else None
            if not isinstance(index, int) or index <= (self.step_mark if event == "step" else self.round_mark):
                continue
            values = flatten({k: v for k, v in record.items() if k != "event"})
            for tracker in list(self.live):
                self._call(tracker, "log", event, index, values)
            if event == "step":
                self.step_mark = index
            else:
                self.round_mark = index
                self.step_mark = max(self.step_mark, int(record.get("policy_version") or 0))
                self.logged = True
                self._save()

    def catch_up(self, rounds: list[dict], steps: list[dict]) -> None:
        """Log the rounds in metrics.jsonl after the last logged one, each after its steps
        (a kill between a round's record and its logging, or trackers added to a run)."""
        if not self.live:
            return
        ordered: list[dict] = []
        previous = 0
        for record in rounds:
            version = int(record.get("policy_version") or 0)
            ordered += [s for s in steps if previous < s["step"] <= version]
            ordered.append(record)
            previous = version
        self.log_records(ordered)

    def finish(self, report_dir: Path | None) -> None:
        """The report's files as artifacts (when this invocation logged a round), then close."""
        if report_dir is not None and self.logged:
            paths = [report_dir / name for name in ARTIFACTS if (report_dir / name).is_file()]
            for tracker in list(self.live):
                self._call(tracker, "log_files", paths)
        self.close()

    def close(self) -> None:
        for tracker in list(self.live):
            self._call(tracker, "close")
        self.live.clear()


_FAILED = object()
