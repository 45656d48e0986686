"""The run folder's non-table files, in one place: their names, the atomic write, the
metrics log with its typed round record, and the round loop's state.

    RUN/spec.toml                         the resolved pipeline spec (written by the round loop)
    RUN/pipeline.json                     the round loop's state: target_rounds, prompt_files
    RUN/metrics.jsonl                     one JSON object per line: "round" and "step" records
    RUN/checkpoints/step-<k>/             HF folder + optimizer/state.safetensors + trainer_state.json
    RUN/checkpoints/best.json             `[run] keep_best`: the checkpoint of the best eval accuracy
    RUN/_rounds/round=<n>/prompts.parquet the prompts chosen for round n (written once)
    RUN/_train/                           the trainer's caches (recomputed old log-probs)
    RUN/report/                           plots and summary.md
    RUN/exports/                          datasets written by `groupforge export`
    RUN/logs/<command>.log                what vLLM, transformers, torch and Python warnings printed
                                          during each command (curation/library_logs.py; appended)

This module imports neither torch nor matplotlib: the spec, the report and the CLI read
these files without loading a model. The tables and their manifests are `store.run_store`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.storage import Storage, open_storage, write_atomic

SPEC_FILE = "spec.toml"
PIPELINE_FILE = "pipeline.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
BEST_FILE = f"{CHECKPOINTS_DIR}/best.json"
OPTIMIZER_FILE = "optimizer/state.safetensors"  # in a subfolder: vLLM loads every *.safetensors of the folder
ROUNDS_DIR = "_rounds"
TRAIN_CACHE_DIR = "_train"
REPORT_DIR = "report"
EXPORTS_DIR = "exports"
LOGS_DIR = "logs"


# ---- JSON files -----------------------------------------------------------------------


def to_json(obj: object) -> str:
    """Indented JSON with sorted keys (Paths as strings): what every run file holds."""
    return json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{value!r} ({type(value).__name__}) is not JSON-serialisable")


def write_json_atomic(path: str | Path, obj: object, **kwargs: Any) -> Path:
    return write_atomic(path, to_json(obj), **kwargs)


def read_json(path: str | Path) -> dict | None:
    """A JSON object from `path`; None when the file does not exist; a ValueError naming the
    file when it is not valid JSON (a run file written by hand, or damaged)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    return parse_json(data, str(path))


def parse_json(data: bytes, where: str) -> dict:
    """The JSON object in `data` (the file or object `where`); a ValueError naming it when it is
    not one."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


# ---- the metrics log ----------------------------------------------------------------------


PHASES = ("startup", "generate", "score", "filter", "label", "pair", "train", "checkpoint", "reload", "eval",
          "other")
"""Where a round's wall seconds go (RoundRecord.phase_seconds): engine start-up (once per
process), the generate stage (refills included), each curation stage (reruns after a refill
included), the trainer but its checkpoint writes, checkpoint writes, loading new weights into
the engine, evaluation, and other = wall - the rest (prompt choice, bookkeeping; never < 0)."""


TRAJECTORY_KEYS = ("tool_use_rate", "tool_calls", "tool_errors", "mean_turns", "stop_reasons")
"""The round record's keys of a multi-turn round, from its samples' trajectory columns."""


@dataclass
class RoundRecord:
    """One line `{"event": "round", ...}` of metrics.jsonl: what a round of the loop did.
    Round 0 evaluates the starting model and trains nothing."""

    round: int
    eval_accuracy: float | None
    """Mean of the eval metric over greedy responses to the eval prompts; None in a round
    that does not evaluate (`[eval] every`)."""
    reward_mean: float | None = None
    """Mean `reward` of the round's scored samples (None: round 0)."""
    samples: int = 0
    groups: int = 0
    kept_groups: int = 0
    """Groups with group_kept (rewards not all equal)."""
    pairs: int | None = 0
    """Pairs the round's pair stage wrote; None when the loop ran none (`[run] pairs`)."""
    samples_total: int = 0
    """Samples generated by this and every earlier round."""
    policy_version: int = 0
    """Optimizer step of the weights evaluated at the end of the round."""
    steps: int = 0
    """Optimizer steps taken in this round."""
    objective: str | None = None
    wall_seconds: float = 0.0
    elapsed_seconds: float = 0.0
    """Wall seconds of this and every earlier round."""
    gen_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall seconds per phase (PHASES); they sum to wall_seconds."""
    model_seconds: float = 0.0
    """Seconds of model work: inside the engine's sampling and greedy calls and the trainer's
    optimizer steps (forward, backward, update). wall - model_seconds is the loop's overhead."""
    refill_prompts: int = 0
    """Extra prompts sampled because filtering left too few kept groups ([run] refill)."""
    decay_steps: int | None = None
    """The cosine horizon the round trained with (a replay after a kill uses it again)."""
    peak_rss_mib: float | None = None
    """The loop process's peak resident memory so far (ru_maxrss), MiB: engine, trainer and all."""
    # A multi-turn round's (`[env]`; a single-turn record has none of these keys):
    tool_use_rate: float | None = None
    """Share of the round's trajectories with at least one tool call."""
    tool_calls: int | None = None
    """Tool calls of the round's trajectories."""
    tool_errors: int | None = None
    """Those that failed (raised, timed out, an unknown tool, a call that could not be parsed)."""
    mean_turns: float | None = None
    """Assistant (model) turns per trajectory, on average."""
    stop_reasons: dict[str, int] | None = None
    """Trajectories per stop_reason (done, max_turns, max_tokens, length)."""

    def to_dict(self) -> dict[str, Any]:
        """The metrics.jsonl line: every field, but a multi-turn field that is None."""
        fields = dataclasses.asdict(self)
        return {"event": "round", **{key: value for key, value in fields.items()
                                     if not (key in TRAJECTORY_KEYS and value is None)}}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> RoundRecord:
        """A record read back from metrics.jsonl; keys it does not know are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


def _parse_line(line: str) -> dict | None:
    """One metrics.jsonl line as a record, or None when it is not a JSON object (a line cut by a kill)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class MetricsLog:
    """RUN/metrics.jsonl: one JSON object per line, appended (and fsynced, see `append`).

    `"event": "round"` records come from the round loop, `"event": "step"` records from the
    trainer. A killed process can leave a cut last line, so unparsable lines are skipped
    and counted; a resumed run can write a round or step twice, so the last record of a
    number wins. `run`: the run folder, URL or Storage (an object store rewrites the object
    on each append: it has no append)."""

    def __init__(self, run: str | Path | Storage):
        self.storage = run if isinstance(run, Storage) else open_storage(run)
        self.path: Path | str = self.storage.local_path(METRICS_FILE) or self.storage.where(METRICS_FILE)
        """The file (a Path on local disk, a URL on an object store)."""

    def exists(self) -> bool:
        return self.storage.exists(METRICS_FILE)

    def append(self, record: dict[str, Any] | RoundRecord, sync: bool = True) -> None:
        """Append one line; readers see it at once. `sync=False` leaves the fsync to a later
        `sync()` (the trainer's step lines: one fsync per call and checkpoint, not per step).
        A last line cut by a kill gets its newline first, so the new line is not glued to it."""
        line = json.dumps(record.to_dict() if isinstance(record, RoundRecord) else record, sort_keys=True)
        size = self.storage.size(METRICS_FILE) or 0
        cut = size > 0 and not self._ends_with_newline()
        self.storage.append(METRICS_FILE, ((b"\n" if cut else b"") + line.encode("utf-8") + b"\n"), sync)

    def _ends_with_newline(self) -> bool:
        local = self.storage.local_path(METRICS_FILE)
        if local is not None:
            with open(local, "rb") as f:
                f.seek(-1, os.SEEK_END)
                return f.read(1) == b"\n"
        return (self.storage.read_if_exists(METRICS_FILE) or b"\n").endswith(b"\n")

    def sync(self) -> None:
        """Make every line appended so far durable (fsync; an object store's writes are)."""
        local = self.storage.local_path(METRICS_FILE)
        if local is not None and local.is_file():
            with open(local, "rb") as f:
                os.fsync(f.fileno())

    def _text(self, start: int = 0) -> str:
        # errors="replace": a kill can cut a multi-byte character in half, too.
        local = self.storage.local_path(METRICS_FILE)
        if local is not None:
            with open(local, "rb") as f:
                f.seek(start)
                return f.read().decode("utf-8", errors="replace")
        return (self.storage.read_if_exists(METRICS_FILE) or b"")[start:].decode("utf-8", errors="replace")

    def _lines(self) -> Iterator[str]:
        yield from self._text().splitlines()

    def position(self) -> tuple[int, int]:
        """(a mark of the file's identity, its size) now ((0, 0) without one): where
        `records_since` starts. Locally the mark is the inode (`drop_steps_after` replaces the
        file: a new inode); on an object store it is 0."""
        size = self.storage.size(METRICS_FILE)
        if size is None:
            return (0, 0)
        local = self.storage.local_path(METRICS_FILE)
        return (local.stat().st_ino if local is not None else 0, size)

    def records_since(self, position: tuple[int, int]) -> list[dict]:
        """The records appended after `position` (from `position()`), in file order. A file
        replaced since (another inode, or shorter than the mark) is read whole. Unparsable
        lines are skipped."""
        mark, offset = position
        now_mark, size = self.position()
        if size == 0:
            return []
        if now_mark != mark or size < offset:
            offset = 0
        return [record for record in map(_parse_line, self._text(offset).splitlines()) if record is not None]

    def read(self) -> tuple[list[dict], list[dict], int]:
        """(round records, step records, lines skipped): one record per number (the last
        written), sorted by number. A missing file raises ValueError naming it."""
        if not self.exists():
            raise ValueError(f"{self.path}: no metrics file (is {self.storage.where()} a groupforge run folder?)")
        by_number: dict[str, dict[int, dict]] = {"round": {}, "step": {}}
        skipped = 0
        for line in self._lines():
            if not line.strip():
                continue
            record = _parse_line(line)
            if record is None:
                skipped += 1
                continue
            event = record.get("event")
            if event not in by_number:
                continue  # other events are not ours to read
            number = record.get(event)
            if isinstance(number, bool) or not isinstance(number, int):
                skipped += 1
                continue
            by_number[event][number] = record
        return ([by_number["round"][n] for n in sorted(by_number["round"])],
                [by_number["step"][n] for n in sorted(by_number["step"])], skipped)

    def rounds(self) -> list[dict]:
        """The round records, sorted ([] when there is no file yet)."""
        return self.read()[0] if self.exists() else []

    def steps(self) -> list[dict]:
        """The step records, sorted ([] when there is no file yet)."""
        return self.read()[1] if self.exists() else []

    def round_record(self, round: int) -> dict | None:
        return next((r for r in self.rounds() if r["round"] == round), None)

    def drop_steps_after(self, step: int) -> None:
        """Remove step records after `step` (written by a run killed before its next
        checkpoint; the resumed run recomputes them identically), and cut lines. Other
        records are kept, in order."""
        if not self.exists():
            return
        lines = [line for line in self._lines() if line.strip()]
        kept = [line for line in lines if not _is_step_after(line, step)]
        if len(kept) < len(lines):
            self.storage.write(METRICS_FILE, "".join(line + "\n" for line in kept).encode("utf-8"))


def _is_step_after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return True  # a line cut by a kill
    return isinstance(record, dict) and record.get("event") == "step" and int(record.get("step", 0)) > step


# ---- the round loop's state -----------------------------------------------------------------


def load_pipeline_state(run: str | Path | Storage) -> dict[str, Any]:
    """RUN/pipeline.json: `target_rounds` (the last round to run) and `prompt_files` (train
    prompt files the run has seen); {} for a new run."""
    storage = run if isinstance(run, Storage) else open_storage(run)
    data = storage.read_if_exists(PIPELINE_FILE)
    return {} if data is None else parse_json(data, storage.where(PIPELINE_FILE))


def save_pipeline_state(run: str | Path | Storage, state: dict[str, Any]) -> None:
    storage = run if isinstance(run, Storage) else open_storage(run)
    storage.write(PIPELINE_FILE, to_json(state).encode("utf-8"))


def round_prompts_rel(round: int, name: str = "prompts.parquet") -> str:
    """Where the prompts chosen for `round` are kept, relative to the run (written once, reused
    on resume); `name`: another prompt file of the round (a refill's)."""
    return f"{ROUNDS_DIR}/round={round}/{name}"


# ---- the best checkpoint ([run] keep_best) ---------------------------------------------------


@dataclass(frozen=True)
class BestCheckpoint:
    """RUN/checkpoints/best.json: the checkpoint of the best eval accuracy so far (`[run] keep_best`)."""

    round: int
    """The round whose evaluation it won (the earliest among equal accuracies)."""
    policy_version: int
    eval_accuracy: float
    checkpoint: str
    """Its folder, relative to the run: checkpoints/step-<policy_version>."""


def load_best(run: str | Path | Storage) -> BestCheckpoint | None:
    """The run's best checkpoint record (None: the run keeps none)."""
    storage = run if isinstance(run, Storage) else open_storage(run)
    data = storage.read_if_exists(BEST_FILE)
    if data is None:
        return None
    record = parse_json(data, storage.where(BEST_FILE))
    return BestCheckpoint(**{f.name: record[f.name] for f in dataclasses.fields(BestCheckpoint)})


def save_best(run: str | Path | Storage, best: BestCheckpoint) -> None:
    """Write RUN/checkpoints/best.json (one atomic write: the old record or the new one)."""
    storage = run if isinstance(run, Storage) else open_storage(run)
    storage.write(BEST_FILE, to_json(dataclasses.asdict(best)).encode("utf-8"))
