"""Prompt files by name, glob or folder, on local disk or an object store: one place that
turns a spec's `[prompts] train` entries into files and reads one of them.

    data/prompts/train.parquet              that file
    data/prompts/                           every *.parquet and *.jsonl file under the folder
    data/prompts/date=*/*.parquet           a glob (`*`, `?`, `[..]` within a path segment,
                                            `**` any number of segments)
    s3://bucket/prompts/date=2031-01-05/a.parquet   an object
    s3://bucket/prompts/date=*/             a glob over an object store: every prompt file under
                                            each matching folder (also gs://, az://, ...)

`expand_prompt_files` lists what each entry names now, so a run started later (a scheduled
refresh) sees the partitions added since. A glob is split at its first segment with a
wildcard: the part before it is listed (a folder, or a prefix of the bucket) through
`store.storage.Storage`, and each object below it is matched segment by segment.
An object is taken when the pattern matches its whole path, or a folder above it; in a
folder or a glob, only *.parquet and *.jsonl files are taken, and none below the listed root
whose path has a name starting with `_` or `.` (Spark's `_SUCCESS`, a `_delta_log/`, hidden
files). Each entry's files come sorted by path; a file named twice counts once, where it
first came.

An entry that names nothing, or a malformed URL, is a ValueError of one line naming the
entry. `read_prompt_table` reads a file by path or URL (an object whole, through Storage);
`check_chat_template` refuses files of conversations for a model without a chat template.
"""

from __future__ import annotations

import fnmatch
import io
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from store.errors import JobError, first_line
from store.storage import Storage, is_object_url, open_storage

PROMPT_SUFFIXES = (".parquet", ".jsonl")
"""The files a folder or a glob contributes."""
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
"""Read as JSON Lines (any other name as Parquet)."""
_WILDCARDS = "*?["


def expand_prompt_files(entries: Sequence[str | Path], key: str = "prompts.train") -> list[str]:
    """The prompt files that `entries` name now, in entry order (see the module docstring);
    `key` names the entries in errors."""
    files: dict[str, None] = {}  # ordered, each file once
    for entry in entries:
        files.update(dict.fromkeys(expand_entry(str(entry), key)))
    return list(files)


def expand_entry(entry: str, key: str = "prompts.train") -> list[str]:
    """The files one entry names: itself when it is a file, else the prompt files of the folder
    or glob, sorted; a ValueError naming the entry when there is none."""
    where = f"{key} entry {entry!r}"
    root, pattern = _split(entry, where)
    try:
        storage = open_storage(root)
        if not pattern and _is_file(storage, root):
            return [entry]
        found = [e.rel for e in storage.list()]
    except (ValueError, JobError, OSError) as exc:
        raise ValueError(f"{where}: {first_line(exc)}") from None
    taken = [rel for rel in found if _takes(pattern, rel)]
    if not taken:
        if not pattern and not is_object_url(root) and not Path(root).exists():
            raise ValueError(f"{where}: file not found")
        what = "matches no prompt file" if pattern else "is neither a file nor a folder with prompt files"
        raise ValueError(f"{where}: {what} ({', '.join('*' + s for s in PROMPT_SUFFIXES)})")
    return [rel if root == "." else storage.where(rel) for rel in taken]


def check_prompt_file(entry: str, key: str) -> None:
    """A ValueError naming `key` and `entry` unless it is one existing file (local or an object)."""
    where = f"{key} {entry!r}"
    root, pattern = _split(entry, where)
    if pattern:
        raise ValueError(f"{where}: must name one file, not a glob")
    try:
        if _is_file(open_storage(root), root):
            return
    except (ValueError, JobError) as exc:
        raise ValueError(f"{where}: {first_line(exc)}") from None
    raise ValueError(f"{where}: file not found")


def read_prompt_table(location: str | Path) -> pa.Table:
    """The rows of one prompt file, a local path or an object URL (read whole through Storage):
    JSON Lines for .jsonl/.json/.ndjson, Parquet otherwise. OSError or pyarrow's errors as
    they come (`load_prompts` turns them into one line naming the file)."""
    text = str(location)
    json_lines = text.lower().endswith(JSON_SUFFIXES)
    if is_object_url(text):
        parent, _, name = text.rstrip("/").rpartition("/")
        data = open_storage(parent).read(name)
        return pa_json.read_json(io.BytesIO(data)) if json_lines else pq.read_table(pa.BufferReader(data))
    return pa_json.read_json(text) if json_lines else pq.read_table(text)


def has_messages(location: str | Path) -> bool:
    """Whether a prompt file holds conversations: a `messages` column with a value (a local
    Parquet file reads that column only). Unreadable files are `load_prompts`' to report: False."""
    text = str(location)
    try:
        if not is_object_url(text) and not text.lower().endswith(JSON_SUFFIXES):
            if "messages" not in pq.read_schema(text).names:
                return False
            column = pq.read_table(text, columns=["messages"]).column(0)
        else:
            table = read_prompt_table(text)
            if "messages" not in table.column_names:
                return False
            column = table.column("messages")
    except (pa.ArrowException, OSError, ValueError, JobError):
        return False
    return column.null_count < len(column)


def require_chat_template(tokenizer, name: str | None = None) -> None:
    """A ValueError unless the tokenizer has a chat template to render `messages` prompts with;
    `name` names it (default: its folder)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {name or getattr(tokenizer, 'name_or_path', 'the model')} has no chat "
                         "template, so prompts given as 'messages' cannot be rendered: give a 'prompt' column, or "
                         "a model whose tokenizer has one")


def check_chat_template(files: Sequence[str], model: str | Path, trust_remote_code: bool = False) -> None:
    """A ValueError naming the first of `files` that gives prompts as `messages` when the
    tokenizer of the model folder `model` has no chat template to render them (the tokenizer
    is loaded only when a file has conversations)."""
    with_messages = next((f for f in files if has_messages(f)), None)
    if with_messages is None:
        return
    from transformers import AutoTokenizer

    from store.location import local_folder

    tokenizer = AutoTokenizer.from_pretrained(local_folder(model), trust_remote_code=trust_remote_code)
    try:
        require_chat_template(tokenizer, f"model folder {model}")
    except ValueError as exc:
        raise ValueError(f"prompts file {with_messages}: {exc}") from None


def _split(entry: str, where: str) -> tuple[str, str]:
    """(the listable root: the entry up to its first segment with a wildcard, the pattern after it)."""
    entry = entry.removeprefix("file://")
    scheme, sep, rest = entry.partition("://")
    if sep and not is_object_url(entry):
        raise ValueError(f"{where}: unknown scheme {scheme!r}: use a local path or an object-store URL "
                         "(s3://, gs://, az://)")
    if sep:
        bucket, _, path = rest.partition("/")
        if not bucket or any(c in bucket for c in _WILDCARDS):
            raise ValueError(f"{where}: not an object-store URL with a bucket ({scheme}://BUCKET/path)")
        head = f"{scheme}://{bucket}/"
    else:
        head, path = ("/", entry) if entry.startswith("/") else ("", entry)
    segments = [s for s in path.split("/") if s]
    at = next((i for i, s in enumerate(segments) if any(c in s for c in _WILDCARDS)), len(segments))
    root = (head + "/".join(segments[:at])).rstrip("/") if sep else head + "/".join(segments[:at])
    return root or ".", "/".join(segments[at:])


def _is_file(storage: Storage, root: str) -> bool:
    local = storage.local_path()
    if local is not None:
        return local.is_file()
    parent, _, name = root.rpartition("/")
    return "://" in parent and open_storage(parent).exists(name)


def _takes(pattern: str, rel: str) -> bool:
    """Whether the object `rel` (relative to the listed root) is a prompt file that `pattern`
    names: the pattern matches its path or a folder above it, its name has a prompt-file
    suffix, and no name on its path starts with `_` or `.`."""
    segments = rel.split("/")
    if not rel.lower().endswith(PROMPT_SUFFIXES) or any(s.startswith(("_", ".")) for s in segments):
        return False
    parts = [p for p in pattern.split("/") if p]
    return bool(_match_lengths(parts, segments, 0))


def _match_lengths(parts: list[str], segments: list[str], at: int) -> set[int]:
    """How many leading path segments (counted from `at`) the pattern segments `parts` match."""
    if not parts:
        return {at}
    head, rest = parts[0], parts[1:]
    if head == "**":
        return set().union(*(_match_lengths(rest, segments, i) for i in range(at, len(segments) + 1)))
    if at < len(segments) and fnmatch.fnmatchcase(segments[at], head):
        return _match_lengths(rest, segments, at + 1)
    return set()
