"""What a job that starts writing a run does first, and the checks that keep its writes inside
the run: taking in tables written without `_commits`, restoring tables a killed commit left ahead, and
removing what killed jobs left (table versions no commit recorded, part files no commit lists,
local temporary files)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from curation import schema
from curation.store.layout import PART_FILE
from curation.store.storage import LocalStorage

if TYPE_CHECKING:
    from curation.store.run_store import RunStore


def tidy(store: RunStore) -> None:
    """Take in the tables of a run written without `_commits` (`curation.store.migrate`),
    restore each table to the version the newest commit recorded (a killed commit's versions
    undone), and remove what killed jobs left (`orphans`, local temporary files)."""
    from curation.store.migrate import import_unlisted

    if not store.state.manifests and not store.state.files:  # nothing committed yet
        import_unlisted(store)
    store.log.restore_tables()
    store.storage.delete_all(orphans(store))
    if isinstance(store.storage, LocalStorage):
        store.storage.remove_dead_temps()


def orphans(store: RunStore) -> list[str]:
    """Part files of killed commits: in a table folder, named `part-<part>-<sha16>.parquet`
    with bytes that hash to that name, and never listed by a commit (neither live nor
    retired). A file that only looks like one (its bytes hash to another name) is not
    touched: `verify` names it as a foreign file."""
    known = store.state.files.keys() | store.state.listed.keys()
    found = []
    for table in schema.SCHEMAS:
        for entry in store.storage.list(table):
            m = PART_FILE.fullmatch(entry.rel.rsplit("/", 1)[-1])
            if entry.rel in known or not m or not m["sha"] or "/_delta_log/" in f"/{entry.rel}":
                continue
            if hashlib.sha256(store.storage.read(entry.rel)).hexdigest()[:16] == m["sha"]:
                found.append(entry.rel)
    return found


def check_inside(store: RunStore, rel: str) -> None:
    """Refuse a write to `rel` when its folder of a local run resolves outside the run folder
    (a symlink): a RunFolderError naming it."""
    if store.root is None:
        return
    folder = (store.root / rel).parent
    while not folder.exists() and folder != store.root:
        folder = folder.parent  # the nearest folder there is: it decides where the write lands
    if not folder.resolve().is_relative_to(store.root.resolve()):
        from curation.store.verify import RunFolderError

        raise RunFolderError(f"{folder}: resolves to {folder.resolve()}, outside the run folder {store.root} "
                             "(a symlink?); groupforge writes only inside the run folder")
