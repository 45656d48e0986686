"""Bad prompts files through the CLI (`groupforge generate`, run in this process): each case gets
one error line naming the file, the column and the problem (`error: ...`; model loading may print
its progress bars before it), exit code 2, no traceback, and no table written. The corpus is
built here, from the toy's prompts, so it needs nothing checked in."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import groupforge_in_process

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _parquet(table: pa.Table):
    return lambda path: pq.write_table(table, path)


def _bytes(data: bytes):
    return lambda path: path.write_bytes(data)


def _truncated(path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="]}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 12])  # the footer cut


# (case id, file name, writer, fragments the one error line must hold)
CASES = [
    ("prompt-int", "p.parquet", _parquet(pa.table({"prompt": [1, 2]})),
     ["column 'prompt' has type int64, expected string"]),
    ("prompt-list", "p.parquet", _parquet(pa.table({"prompt": [["a"], ["b"]]})),
     ["column 'prompt' has type list<", "expected string"]),
    ("prompt-struct", "p.parquet", _parquet(pa.table({"prompt": [{"text": "a"}]})),
     ["column 'prompt' has type struct<text: string>, expected string"]),
    ("prompt-float", "p.parquet", _parquet(pa.table({"prompt": [1.5]})), ["column 'prompt' has type double"]),
    ("prompt-bool", "p.parquet", _parquet(pa.table({"prompt": [True]})), ["column 'prompt' has type bool"]),
    ("prompt-timestamp", "p.parquet", _parquet(pa.table({"prompt": pa.array([0], pa.timestamp("s"))})),
     ["column 'prompt' has type timestamp["]),
    ("prompt-nulls", "p.parquet", _parquet(pa.table({"prompt": ["1+1=", None]})),
     ["1 row(s) have neither 'prompt' nor 'messages'"]),
    ("prompt-empty-string", "p.parquet", _parquet(pa.table({"prompt": ["1+1=", ""]})),
     ["column 'prompt': row 1 is an empty string"]),
    ("prompt-not-utf8", "p.parquet", _parquet(pa.table({"prompt": pa.array([b"1+1=", b"\xff\xfe"], pa.binary())})),
     ["column 'prompt' cannot be read as string", "Invalid UTF8"]),
    ("no-prompt-column", "p.parquet", _parquet(pa.table({"question": ["1+1="]})),
     ["missing column 'prompt' (string) or 'messages'", "found columns: question"]),
    ("reference-struct", "p.parquet", _parquet(pa.table({"prompt": ["1+1="], "reference": [{"a": 1}]})),
     ["column 'reference' has type struct<a: int64>, expected string"]),
    ("messages-strings", "p.parquet", _parquet(pa.table({"messages": [["hi"]]})),
     ["column 'messages' has type list<", ": string>, expected list<item: struct<role: string, content: string>>"]),
    ("messages-no-role", "p.parquet", _parquet(pa.table({"messages": [[{"content": "hi"}]]})),
     ["column 'messages' has type list<", "struct<content: string>>, expected"]),
    ("messages-unknown-role", "p.parquet",
     _parquet(pa.table({"messages": pa.array([[{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]],
                                             MESSAGES)})),
     ["column 'messages': row 0 has a message whose role is 'wizard' (expected one of system, user"]),
    ("messages-null-content", "p.parquet",
     _parquet(pa.table({"messages": pa.array([[{"role": "user", "content": None}]], MESSAGES)})),
     ["column 'messages': row 0 has a message whose content is None"]),
    ("messages-empty-list", "p.parquet", _parquet(pa.table({"messages": pa.array([[]], MESSAGES)})),
     ["column 'messages': row 0 is an empty list of messages"]),
    ("messages-without-chat-template", "p.parquet",
     _parquet(pa.table({"messages": pa.array([[{"role": "user", "content": "1+1="}]], MESSAGES)})),
     ["has no chat template, so prompts given as 'messages' cannot be rendered"]),
    ("csv-named-parquet", "p.parquet", _bytes(b"prompt,reference\n1+1=,2\n"), ["not a readable Parquet file"]),
    ("json-named-parquet", "p.parquet", _bytes(json.dumps({"prompt": "1+1="}).encode()),
     ["not a readable Parquet file"]),
    ("zero-bytes", "p.parquet", _bytes(b""), ["file is empty (0 bytes)"]),
    ("truncated-footer", "p.parquet", _truncated, ["not a readable Parquet file"]),
    ("no-rows", "p.parquet", _parquet(pa.table({"prompt": pa.array([], pa.string())})), ["has no rows"]),
    ("jsonl-broken", "p.jsonl", _bytes(b'{"prompt": "1+1="}\n{"prompt": \n'), ["not a readable JSON Lines file"]),
    ("jsonl-prompt-int", "p.jsonl", _bytes(b'{"prompt": 1}\n'), ["column 'prompt' has type int64"]),
    ("missing-file", "absent.parquet", None, ["file not found"]),
]


@pytest.mark.parametrize("name,file,writer,fragments", CASES, ids=[c[0] for c in CASES])
def test_a_bad_prompts_file_gets_one_line_naming_it(name, file, writer, fragments, toy_dir, tmp_path):
    prompts = tmp_path / file
    if writer is not None:
        writer(prompts)
    run = tmp_path / "run"
    done = groupforge_in_process("generate", "--model", toy_dir / "model", "--prompts", prompts, "--out", run,
                                 "--backend", "hf", "--max-tokens", 4)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]  # not progress bars
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-2000:]
    assert str(prompts) in lines[0] and all(f in lines[0] for f in fragments), lines[0]
    tables = [p for p in run.rglob("*.parquet")] if run.exists() else []
    assert tables == []  # nothing written


def test_dictionary_encoded_and_binary_utf8_prompts_are_read(toy_dir, tmp_path):
    """Not bad: a dictionary-encoded or binary (valid UTF-8) prompt column reads as strings,
    with the same prompt ids as plain strings; duplicate prompts are kept once."""
    from curation.generate.base import load_prompts

    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2=", "1+1="]}), plain)
    want = load_prompts(plain).column("prompt_id").to_pylist()
    assert len(want) == 2
    for k, column in enumerate([pa.array(["1+1=", "2+2=", "1+1="]).dictionary_encode(),
                                pa.array([b"1+1=", b"2+2=", b"1+1="], pa.binary())]):
        path = tmp_path / f"other-{k}.parquet"
        pq.write_table(pa.table({"prompt": column}), path)
        assert load_prompts(path).column("prompt_id").to_pylist() == want


# Every Arrow type in the two columns a prompts file is read for: the text types read as strings,
# integers and floats are fine references (answers like 12), the rest is one error naming the type.
ARROW_TYPES = {
    "int8": (pa.array([1], pa.int8()), "int8", "string"), "uint64": (pa.array([1], pa.uint64()), "uint64", "string"),
    "float16": (pa.array([1.0], pa.float16()), "halffloat", "string"),
    "date32": (pa.array([1], pa.date32()), "date32[day]", None),
    "decimal": (pa.array([1], pa.decimal128(5, 2)), "decimal128(5, 2)", None),
    "large_string": (pa.array(["1+1="], pa.large_string()), "string", "string"),
    "string_view": (pa.array(["1+1="], pa.string_view()), "string", "string"),
    "large_binary": (pa.array([b"1+1="], pa.large_binary()), "string", "string"),
    "map": (pa.array([[("a", 1)]], pa.map_(pa.string(), pa.int64())), "map<string, int64", None),
    "dictionary-int": (pa.array([1]).dictionary_encode(), "int64", "string"),
    "fixed_binary": (pa.array([b"ab"], pa.binary(2)), "fixed_size_binary[2]", None),
}


@pytest.mark.parametrize("column", ["prompt", "reference"])
@pytest.mark.parametrize("kind", list(ARROW_TYPES))
def test_every_arrow_type_in_the_prompt_and_reference_columns(kind, column, tmp_path):
    from curation.generate.base import load_prompts

    array, shown, as_reference = ARROW_TYPES[kind]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({column: array} if column == "prompt" else {"prompt": ["1+1="], column: array}), path)
    text_type = shown == "string"
    if text_type or (column == "reference" and as_reference):
        assert load_prompts(path).schema.field(column).type == pa.string()
    else:
        with pytest.raises(ValueError) as err:
            load_prompts(path)
        assert str(path) in str(err.value) and f"column '{column}' has type {shown}" in str(err.value)


def test_a_huge_prompt_is_rejected_as_too_long_not_a_crash(toy_dir, tmp_path):
    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "1+" * 200_000 + "1="]}), prompts)  # ~400k characters
    run = tmp_path / "run"
    done = groupforge_in_process("generate", "--model", toy_dir / "model", "--prompts", prompts, "--out", run,
                                 "--backend", "hf", "--max-tokens", "4", "-G", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    from collections import Counter

    from store.run_store import RunStore

    store = RunStore(run)  # the live files of the run's log
    reasons = Counter(store.read("rejects").column("reason").to_pylist())
    samples = store.read("samples").num_rows
    assert reasons == {"prompt_too_long": 1} and samples == 2  # one reject row for the prompt, its group unsampled
