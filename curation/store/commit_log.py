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
writes it, the older one stops at its next commit with nothing half-written. On an object store
the job's other writes (metrics, checkpoints, the loop's state) are fenced too
(`check_writer`): before each, one listing of the log's new entries, so the older job stops at
its next write of any kind and never overwrites a file of the newer one's.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Mapping
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
    """The files this commit lists (path relative to the run): its manifest's outputs, or the
    files an "import" entry takes in."""
    tables: tuple[str, ...] = ()
    """The tables whose live files this commit changed (their Delta logs follow it)."""

    def to_json(self) -> dict:
        return {"seq": self.seq, "kind": self.kind, "writer": self.writer, "at": self.at, "stage": self.stage,
                "round": self.round, "manifest": dict(self.manifest),
                "add": {rel: f.to_json() for rel, f in sorted(self.add.items())}, "tables": sorted(self.tables)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        return cls(seq=int(data["seq"]), kind=str(data["kind"]), writer=str(data["writer"]), at=str(data["at"]),
                   stage=data.get("stage"), round=data.get("round"), manifest=data.get("manifest") or {},
                   add={rel: LoggedFile(**f) for rel, f in (data.get("add") or {}).items()},
                   tables=tuple(data.get("tables") or ()))


@dataclass
class RunState:
    """The run after entry `seq` (-1: no entry yet). A file is live while the newest commit of
    some (stage, round) lists it (a prompts part can be listed by several) or an "import" took
    it in (tables written by other tools, old runs)."""

    seq: int = -1
    files: dict[str, LoggedFile] = field(default_factory=dict)
    """The live files."""
    refs: dict[str, int] = field(default_factory=dict)
    """How many commits (and imports) list each live file."""
    manifests: dict[tuple[str, int], dict] = field(default_factory=dict)
    """(stage, round) -> the manifest of that stage's newest commit for the round."""
    commits: dict[tuple[str, int], int] = field(default_factory=dict)
    """(stage, round) -> the seq of that commit."""
    writer: str | None = None
    """The job that opened the run last."""
    retired: dict[str, int] = field(default_factory=dict)
    """Files that were live and are not any more -> the entry that retired them. They are kept
    (earlier versions of the run read them: `export --as-of`, Delta time travel) until vacuumed."""

    def apply(self, entry: Entry) -> list[str]:
        """Bring the state to `entry`; the files no longer live after it."""
        if entry.seq != self.seq + 1:
            raise ValueError(f"commit log entry {entry.seq} applied after {self.seq}")
        self.seq = entry.seq
        if entry.kind == "open":
            self.writer = entry.writer
            return []
        for rel, meta in entry.add.items():
            self.refs[rel] = self.refs.get(rel, 0) + 1
            self.files[rel] = meta
            self.retired.pop(rel, None)
        if entry.kind != "commit" or entry.stage is None or entry.round is None:
            return []
        key = (entry.stage, entry.round)
        gone = []
        for rel in (self.manifests.get(key) or {}).get("outputs", []):
            self.refs[rel] = self.refs.get(rel, 1) - 1
            if self.refs[rel] <= 0:
                del self.refs[rel]
                self.files.pop(rel, None)
                self.retired[rel] = entry.seq
                gone.append(rel)
        self.manifests[key] = dict(entry.manifest)
        self.commits[key] = entry.seq
        return sorted(gone)

    def copy(self) -> RunState:
        return RunState(self.seq, dict(self.files), dict(self.refs), dict(self.manifests), dict(self.commits),
                        self.writer, dict(self.retired))

    def to_json(self) -> dict:
        return {"seq": self.seq, "writer": self.writer,
                "files": {rel: {**f.to_json(), "refs": self.refs[rel]} for rel, f in sorted(self.files.items())},
                "manifests": [{"stage": s, "round": r, "seq": self.commits[(s, r)], "manifest": m}
                              for (s, r), m in sorted(self.manifests.items())],
                "retired": dict(sorted(self.retired.items()))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunState:
        state = cls(seq=int(data["seq"]), writer=data.get("writer"),
                    retired={rel: int(seq) for rel, seq in (data.get("retired") or {}).items()})
        for rel, f in data["files"].items():
            state.refs[rel] = int(f.pop("refs"))
            state.files[rel] = LoggedFile(**f)
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
        self.checked = -1
        """The newest entry `check_writer` has found to be this job's."""

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

    def catch_up(self, seq: int) -> RunState:
        """Read the entries up to `seq` that this object has not read (another store of this job
        wrote them: `RunStore.sibling`), without listing the log."""
        for n in range(self.state.seq + 1, seq + 1):
            self.state.apply(self._read_entry(n))
        return self.state

    def state_as_of(self, seq: int) -> RunState:
        """The run after entry `seq` (an earlier version of the run)."""
        entries, states = self._listing()
        base = self.state.copy() if self.state.seq <= seq else RunState()
        return self._replay(base, seq, entries, states)

    def entries(self) -> list[Entry]:
        """Every entry, oldest first."""
        entries, _ = self._listing()
        return [self._read_entry(seq) for seq in entries]

    def open(self) -> None:
        """Start writing: read the log, then append an "open" entry naming this job."""
        self.refresh()
        self.writer = self.writer or new_writer_id()
        self._append(Entry(self.state.seq + 1, "open", self.writer, _now()))
        self.checked = self.state.seq

    def check_writer(self) -> None:
        """Raise RunTakenOver when another job has written to the log since this job opened the
        run (its "open" entry: a newer job took the run over). One listing that starts after the
        newest entry checked, so it costs the same however long the log is."""
        if self.writer is None:
            return
        for e in self.storage.list(LOG_DIR, after=_entry_name(self.checked)):
            name = e.rel.rsplit("/", 1)[-1]
            if not name[:20].isdigit() or name != f"{name[:20]}.json":
                continue
            seq = int(name[:20])
            if self._read_entry(seq).writer != self.writer:
                raise self._taken_over(seq)
            self.checked = max(self.checked, seq)

    def commit(self, stage: str, round: int, manifest: Mapping[str, Any],
               files: Mapping[str, LoggedFile], tables: tuple[str, ...] = ()) -> list[str]:
        """Append a stage's commit for `round` (after its files are written): the commit point.
        `manifest["outputs"]` lists its files, `files` their sha256, size and rows. Returns the
        files no longer live (the stage's earlier outputs for the round), for the caller to delete."""
        if self.writer is None:
            raise RuntimeError("CommitLog.commit before open(): a writer opens the run first")
        missing = [rel for rel in manifest.get("outputs", []) if rel not in files]
        if missing:
            raise ValueError(f"commit of {stage} round {round}: no file record for outputs {missing}")
        return self._append(Entry(self.state.seq + 1, "commit", self.writer, _now(), stage, round, dict(manifest),
                                  {rel: files[rel] for rel in manifest.get("outputs", [])}, tuple(tables)))

    def last_commit(self) -> Entry | None:
        """The newest "commit" entry (read again from the log), None when there is none."""
        for seq in sorted(self.state.commits.values(), reverse=True)[:1]:
            return self._read_entry(seq)
        return None

    def take_in(self, files: Mapping[str, LoggedFile]) -> None:
        """Append an "import" entry: `files` (written by other tools, or by an older run format)
        become live for good."""
        if self.writer is None:
            raise RuntimeError("CommitLog.take_in before open(): a writer opens the run first")
        self._append(Entry(self.state.seq + 1, "import", self.writer, _now(), add=dict(files)))

    def _append(self, entry: Entry) -> list[str]:
        if not self.storage.create(_entry_name(entry.seq), _dump(entry.to_json())):
            raise self._taken_over(entry.seq)
        if entry.seq == self.checked + 1:
            self.checked = entry.seq  # this job's own entry: `check_writer` need not read it
        gone = self.state.apply(entry)
        if entry.seq and entry.seq % self.state_every == 0:
            self.storage.create(_state_name(entry.seq), _dump(self.state.to_json()))
        return gone

    def _taken_over(self, seq: int) -> RunTakenOver:
        try:
            other = self._read_entry(seq)
            who = f"job {other.writer} ({other.kind} at {other.at})"
        except (FileNotFoundError, ValueError):
            who = "another job"
        return RunTakenOver(f"{self.storage.where()}: run taken over: {who} wrote to this run's log after this job "
                            f"(entry {seq}); this job stops without writing more. Only one job may write a run: "
                            "the newer one goes on.")
