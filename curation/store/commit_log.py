"""The run's commit log: what makes a commit atomic without a rename, on local disk and on
object storage alike, and what stops two writers from both winning.

    RUN/_log/<seq:020d>.json          one entry per commit, never rewritten
    RUN/_log/<seq:020d>.state.json    the state after entry seq, every `state_every` entries

An entry is written with `Storage.create` (If-None-Match: *): entry n exists once, written by
one writer. A commit writes its data files under new names first (invisible: no entry lists
them), then its entry: the commit point. A kill before it leaves files nobody lists (swept
later); a kill after it leaves a whole commit. Readers fold the entries into a `RunState`
(the live files and each stage's manifest per round) and read only the files it lists, so a
round appears whole or not at all.

Two writers: a job starts writing with an "open" entry, and each commit writes entry
last_seen + 1. When another job has written an entry since (its own "open", or a commit), the
create fails and this job stops with `RunTakenOver` (exit 3): the newest job to open the run
writes it, the older one stops at its next commit with nothing half-written.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from curation.store.lock import RunLockedError
from curation.store.storage import Storage

LOG_DIR = "_log"
STATE_EVERY = 100


class RunTakenOver(RunLockedError):
    """Another job wrote to the run's log since this job last did (exit 3, as a locked run)."""


@dataclass(frozen=True)
class LoggedFile:
    """A live file of the run, as its commit recorded it."""

    sha256: str
    size: int
    rows: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "size": self.size, "rows": self.rows}


@dataclass(frozen=True)
class Entry:
    """One commit (kind "commit": a stage's outputs for a round) or a job starting to write
    (kind "open")."""

    seq: int
    kind: str
    writer: str
    at: str
    stage: str | None = None
    round: int | None = None
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """The stage's manifest: inputs, config and its hash, outputs, rows, drops, code version."""
    add: Mapping[str, LoggedFile] = field(default_factory=dict)
    """Files that join the run (path relative to the run)."""
    remove: tuple[str, ...] = ()
    """Files that leave it (a stage's earlier outputs for the round)."""

    def to_json(self) -> dict:
        return {"seq": self.seq, "kind": self.kind, "writer": self.writer, "at": self.at, "stage": self.stage,
                "round": self.round, "manifest": dict(self.manifest),
                "add": {rel: f.to_json() for rel, f in sorted(self.add.items())}, "remove": sorted(self.remove)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        return cls(seq=int(data["seq"]), kind=str(data["kind"]), writer=str(data["writer"]), at=str(data["at"]),
                   stage=data.get("stage"), round=data.get("round"), manifest=data.get("manifest") or {},
                   add={rel: LoggedFile(**f) for rel, f in (data.get("add") or {}).items()},
                   remove=tuple(data.get("remove") or ()))


@dataclass
class RunState:
    """The run after entry `seq` (-1: no entry yet)."""

    seq: int = -1
    files: dict[str, LoggedFile] = field(default_factory=dict)
    manifests: dict[tuple[str, int], dict] = field(default_factory=dict)
    """(stage, round) -> the manifest of that stage's newest commit for the round."""
    commits: dict[tuple[str, int], int] = field(default_factory=dict)
    """(stage, round) -> the seq of that commit."""
    writer: str | None = None
    """The job that opened the run last."""

    def apply(self, entry: Entry) -> None:
        if entry.seq != self.seq + 1:
            raise ValueError(f"commit log entry {entry.seq} applied after {self.seq}")
        self.seq = entry.seq
        if entry.kind == "open":
            self.writer = entry.writer
            return
        for rel in entry.remove:
            self.files.pop(rel, None)
        self.files.update(entry.add)
        if entry.stage is not None and entry.round is not None:
            self.manifests[(entry.stage, entry.round)] = dict(entry.manifest)
            self.commits[(entry.stage, entry.round)] = entry.seq

    def copy(self) -> RunState:
        return RunState(self.seq, dict(self.files), dict(self.manifests), dict(self.commits), self.writer)

    def rounds(self) -> list[int]:
        return sorted({r for _, r in self.manifests})

    def to_json(self) -> dict:
        return {"seq": self.seq, "writer": self.writer,
                "files": {rel: f.to_json() for rel, f in sorted(self.files.items())},
                "manifests": [{"stage": s, "round": r, "seq": self.commits[(s, r)], "manifest": m}
                              for (s, r), m in sorted(self.manifests.items())]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunState:
        state = cls(seq=int(data["seq"]), writer=data.get("writer"),
                    files={rel: LoggedFile(**f) for rel, f in data["files"].items()})
        for item in data["manifests"]:
            key = (item["stage"], int(item["round"]))
            state.manifests[key] = item["manifest"]
            state.commits[key] = int(item["seq"])
        return state


def _entry_name(seq: int) -> str:
    return f"{LOG_DIR}/{seq:020d}.json"


def _state_name(seq: int) -> str:
    return f"{LOG_DIR}/{seq:020d}.state.json"


def _dump(data: Mapping) -> bytes:
    return (json.dumps(data, sort_keys=True, separators=(",", ":"), default=str) + "\n").encode()


def new_writer_id() -> str:
    """host:pid:random, naming a writing job in the log."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class CommitLog:
    """The commit log of the run at `storage`, and the state this object has read of it."""

    def __init__(self, storage: Storage, state_every: int = STATE_EVERY):
        self.storage = storage
        self.state_every = state_every
        self.state = RunState()
        self.writer: str | None = None
        """This job's id once it has opened the run (`open`)."""

    def _listing(self) -> tuple[list[int], list[int]]:
        """(entry seqs, state seqs) present, ascending."""
        entries, states = [], []
        for e in self.storage.list(LOG_DIR):
            name = e.rel.rsplit("/", 1)[-1]
            stem = name[:20]
            if not stem.isdigit():
                continue
            if name == f"{stem}.json":
                entries.append(int(stem))
            elif name == f"{stem}.state.json":
                states.append(int(stem))
        return sorted(entries), sorted(states)

    def _read_entry(self, seq: int) -> Entry:
        raw = self.storage.read(_entry_name(seq))
        try:
            return Entry.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.storage.where(_entry_name(seq))}: not a commit log entry ({exc})") from None

    def _replay(self, state: RunState, upto: int | None, entries: list[int], states: list[int]) -> RunState:
        """`state` brought forward to entry `upto` (None: the newest), from a state file when that
        skips entries."""
        last = entries[-1] if entries else -1
        target = last if upto is None else min(upto, last)
        usable = [s for s in states if state.seq < s <= target]
        if usable:
            raw = self.storage.read(_state_name(usable[-1]))
            state = RunState.from_json(json.loads(raw))
        for seq in range(state.seq + 1, target + 1):
            state.apply(self._read_entry(seq))
        return state

    def refresh(self) -> RunState:
        """Read the entries written since this object last looked; the state after the newest."""
        entries, states = self._listing()
        self.state = self._replay(self.state, None, entries, states)
        return self.state

    def state_as_of(self, seq: int) -> RunState:
        """The run after entry `seq` (an earlier version of the run)."""
        entries, states = self._listing()
        base = self.state.copy() if self.state.seq <= seq else RunState()
        return self._replay(base, seq, entries, states)

    def entries(self) -> list[Entry]:
        """Every entry, oldest first (for `inspect` and `export --as-of`)."""
        entries, _ = self._listing()
        return [self._read_entry(seq) for seq in entries]

    def open(self) -> Entry:
        """Start writing: read the log, then append an "open" entry naming this job."""
        self.refresh()
        self.writer = self.writer or new_writer_id()
        return self._append(Entry(self.state.seq + 1, "open", self.writer, _now()))

    def commit(self, stage: str, round: int, manifest: Mapping[str, Any], add: Mapping[str, LoggedFile],
               remove: Sequence[str]) -> Entry:
        """Append a stage's commit for `round` (after its files are written): the commit point."""
        if self.writer is None:
            raise RuntimeError("CommitLog.commit before open(): a writer opens the run first")
        entry = Entry(self.state.seq + 1, "commit", self.writer, _now(), stage, round, dict(manifest),
                      dict(add), tuple(remove))
        return self._append(entry)

    def _append(self, entry: Entry) -> Entry:
        if not self.storage.create(_entry_name(entry.seq), _dump(entry.to_json())):
            raise self._taken_over(entry.seq)
        self.state.apply(entry)
        if entry.seq and entry.seq % self.state_every == 0:
            self.storage.create(_state_name(entry.seq), _dump(self.state.to_json()))
        return entry

    def _taken_over(self, seq: int) -> RunTakenOver:
        try:
            other = self._read_entry(seq)
            who = f"{other.writer} ({other.kind} at {other.at})"
        except (FileNotFoundError, ValueError):
            who = "another job"
        return RunTakenOver(f"{self.storage.where()}: {who} wrote to this run's log after this job "
                            f"(entry {seq}); this job stops without writing more. Only one job may write a run: "
                            "the newer one goes on.")
