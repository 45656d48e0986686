"""Table contracts: what validate accepts, casts and rejects, and how it says so."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store.schema import SCHEMAS, SchemaError, empty, read_table_file, validate


def one_row(name: str) -> dict:
    """A valid one-row table of every contract, built from the schema itself."""
    values = {
        pa.string(): "x", pa.int32(): 1, pa.int64(): 1, pa.float64(): 0.5, pa.float32(): -0.5, pa.bool_(): True,
        pa.list_(pa.int32()): [1, 2], pa.list_(pa.float32()): [-0.1, -0.2],
    }
    row = {}
    for field in SCHEMAS[name]:
        if field.name == "messages":
            row[field.name] = pa.array([[{"role": "user", "content": "hi"}]], field.type)
        else:
            row[field.name] = pa.array([values[field.type]], field.type)
    return row


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_contract_accepts_a_valid_row_and_keeps_extra_columns(name):
    table = pa.table({**one_row(name), "extra_reward": pa.array([1.0])})
    out = validate(table, name)
    assert out.schema.names[: len(SCHEMAS[name])] == SCHEMAS[name].names
    assert "extra_reward" in out.column_names
    assert empty(name).num_rows == 0 and empty(name).schema == SCHEMAS[name]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_missing_required_column_is_named(name):
    row = one_row(name)
    optional = {"prompt", "messages", "reference", "metadata", "detail"}
    required = [f.name for f in SCHEMAS[name] if f.name not in optional]
    dropped = required[-1]
    del row[dropped]
    with pytest.raises(SchemaError, match=rf"^{name} table \(f.parquet\): missing column '{dropped}'"):
        validate(pa.table(row), name, "f.parquet")


def test_wrong_type_names_column_expected_and_found():
    row = one_row("samples")
    row["behavior_logprobs"] = pa.array(["nope"])
    with pytest.raises(SchemaError) as err:
        validate(pa.table(row), "samples", "s.parquet")
    assert str(err.value) == (
        "samples table (s.parquet): column 'behavior_logprobs' has type string, expected list<item: float>"
    )
    assert "\n" not in str(err.value)


def test_compatible_types_are_cast_to_canonical():
    row = one_row("samples")
    row["round"] = pa.array([3], pa.int64())
    row["response"] = pa.array(["7"], pa.large_string())
    row["response_token_ids"] = pa.array([[5, 2]], pa.large_list(pa.int64()))
    row["behavior_logprobs"] = pa.array([[-0.5, -1.0]], pa.list_(pa.float64()))
    out = validate(pa.table(row), "samples")
    assert out.schema.field("round").type == pa.int32()
    assert out.schema.field("response").type == pa.string()
    assert out.schema.field("response_token_ids").type == pa.list_(pa.int32())
    assert out.column("behavior_logprobs").to_pylist() == [[-0.5, -1.0]]


def test_lossy_cast_and_nulls_are_rejected():
    row = one_row("samples")
    row["round"] = pa.array([2**40], pa.int64())
    with pytest.raises(SchemaError, match="column 'round' cannot be read as int32"):
        validate(pa.table(row), "samples")
    row = one_row("groups")
    row["advantage"] = pa.array([None], pa.float64())
    with pytest.raises(SchemaError, match="column 'advantage' has 1 null value"):
        validate(pa.table(row), "groups")


def test_prompts_need_prompt_or_messages_and_optional_columns_are_filled():
    out = validate(pa.table({"prompt_id": ["a"], "prompt": ["1+1="]}), "prompts")
    assert out.column("reference").to_pylist() == [None]
    with pytest.raises(SchemaError, match="1 row\\(s\\) have neither 'prompt' nor 'messages'"):
        validate(pa.table({"prompt_id": ["a", "b"], "prompt": ["1+1=", None]}), "prompts")


def test_read_table_file_errors(tmp_path):
    assert "file not found" in _error(lambda: read_table_file(tmp_path / "nope.parquet", "pairs"))
    (tmp_path / "empty.parquet").write_bytes(b"")
    assert "file is empty" in _error(lambda: read_table_file(tmp_path / "empty.parquet", "pairs"))
    (tmp_path / "text.parquet").write_text("a,b\n1,2\n")
    assert "not a readable Parquet file" in _error(lambda: read_table_file(tmp_path / "text.parquet", "pairs"))
    pq.write_table(pa.table(one_row("pairs")), tmp_path / "ok.parquet")
    assert read_table_file(tmp_path / "ok.parquet", "pairs").num_rows == 1
    with pytest.raises(SchemaError, match="unknown table name 'pair'"):
        validate(pa.table(one_row("pairs")), "pair")


def _error(fn) -> str:
    with pytest.raises(SchemaError) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_table_with_the_contract_schema_is_returned_as_it_is_and_still_checked(name):
    exact = pa.Table.from_pydict(one_row(name), schema=SCHEMAS[name])
    assert validate(exact, name) is exact  # nothing to cast: no copy
    with_extra = exact.append_column("extra_reward", pa.array([1.0]))
    assert validate(with_extra, name) is with_extra
    first = SCHEMAS[name].field(0)  # non-nullable in every contract: nulls are still found
    with_null = exact.set_column(0, first, pa.nulls(1, first.type))
    with pytest.raises(SchemaError, match=f"column '{first.name}' has 1 null value"):
        validate(with_null, name)


def test_the_slow_path_gives_what_the_fast_path_would():
    exact = pa.Table.from_pydict(one_row("groups"), schema=SCHEMAS["groups"])
    tagged = exact.replace_schema_metadata({b"k": b"v"})  # metadata: rebuilt, without it
    assert validate(tagged, "groups").schema.equals(exact.schema, check_metadata=True)
    loose = pa.table({f.name: exact.column(f.name) for f in SCHEMAS["groups"]})  # nullable fields
    out = validate(loose, "groups")
    assert out.equals(exact) and out.schema.equals(exact.schema, check_metadata=True)


def test_prompts_with_the_contract_schema_are_still_checked():
    row = one_row("prompts")
    row["prompt"], row["messages"] = pa.array([""]), pa.nulls(1, SCHEMAS["prompts"].field("messages").type)
    with pytest.raises(SchemaError, match="column 'prompt': row 0 is an empty string"):
        validate(pa.Table.from_pydict(row, schema=SCHEMAS["prompts"]), "prompts")


def test_as_contract_uses_the_contract_schema_only_when_every_type_is_its_own():
    from store.schema import as_contract

    columns = [pa.array(["r"]), pa.array([0], pa.int32()), pa.array(["p"]), pa.array([1], pa.int32()),
               pa.array(["filter"]), pa.array(["duplicate"]), pa.array([None], pa.string())]
    assert as_contract(columns, "rejects").schema == SCHEMAS["rejects"]
    wide = as_contract([columns[0], pa.array([0], pa.int64()), *columns[2:]], "rejects")  # round as int64
    assert wide.schema.names == SCHEMAS["rejects"].names and validate(wide, "rejects").schema == SCHEMAS["rejects"]


# ---- the samples table's trajectory columns (multi-turn) ---------------------------------

def _trajectories() -> list[dict]:
    """Two rows by hand: a one-turn trajectory, and assistant / tool / assistant (mask 0 on the
    tool span in the middle)."""
    from tests.helpers import trajectory_row

    return [trajectory_row([("assistant", [4, 5])], sample_idx=0),
            trajectory_row([("assistant", [4, 5, 6]), ("tool", [7, 8]), ("assistant", [9, 2])], sample_idx=1,
                           reward=1.0)]


def test_a_multi_turn_table_validates_as_it_is_and_compatible_types_are_cast():
    from store.schema import TRAJECTORY_FIELDS
    from tests.helpers import TRAJECTORY_SCHEMA, trajectory_table

    table = trajectory_table(_trajectories())
    assert validate(table, "samples", "t.parquet") is table
    loose = pa.table({name: table.column(name).to_pylist() for name in table.column_names})  # int64, no struct order
    out = validate(loose, "samples", "t.parquet")
    assert out.schema.equals(TRAJECTORY_SCHEMA) and out.equals(table)
    assert [f.name for f in TRAJECTORY_FIELDS] == TRAJECTORY_SCHEMA.names[len(SCHEMAS["samples"]):]


def test_a_single_turn_table_gets_no_trajectory_column():
    exact = pa.Table.from_pydict(one_row("samples"), schema=SCHEMAS["samples"])
    assert validate(exact, "samples") is exact
    loose = pa.table({name: exact.column(name).to_pylist() for name in exact.column_names})
    assert validate(loose, "samples").schema == SCHEMAS["samples"]


KEYS_OF_ROW_1 = "sample (run_id='r', round=0, prompt_id='p0', sample_idx=1)"


def _with(rows: list[dict], **changes) -> list[dict]:
    return [rows[0], {**rows[1], **changes}]


def _turns(*spans: tuple[str, int, int]) -> list[dict]:
    return [{"role": role, "start": start, "length": length} for role, start, length in spans]


@pytest.mark.parametrize("edit,column,problem", [
    (lambda r: _with(r, response_mask=[1, 1, 1, 0, 0, 1]), "response_mask",
     "has 6 values but response_token_ids has 7 tokens; they must match one to one"),
    (lambda r: _with(r, behavior_logprobs=[-0.5] * 3 + [0.0] * 2 + [-0.5]), "behavior_logprobs",
     "has 6 values but response_token_ids has 7 tokens; they must match one to one"),
    (lambda r: _with(r, response_mask=[1, 1, 1, 0, 2, 1, 1]), "response_mask",
     "has value 2 at token 4 (expected 0: tool/environment or 1: model)"),
    (lambda r: _with(r, behavior_logprobs=[-0.5] * 3 + [0.0, -0.25] + [-0.5] * 2), "behavior_logprobs",
     "is -0.25 at token 4, where response_mask is 0 (expected 0.0 at tool/environment tokens)"),
    (lambda r: _with(r, turns=_turns(("assistant", 0, 3), ("system", 3, 2), ("assistant", 5, 2))), "turns",
     "has a turn with role 'system' (expected one of assistant, tool, user)"),
    (lambda r: _with(r, turns=_turns(("assistant", 0, 3), ("tool", 3, 0), ("assistant", 3, 4))), "turns",
     "turn 1 has length 0 (a turn is at least one token)"),
    (lambda r: _with(r, turns=_turns(("assistant", 0, 3), ("tool", 4, 2), ("assistant", 6, 1))), "turns",
     "turn 1 starts at 4, expected 3 (the turns cover response_token_ids in order, without gaps)"),
    (lambda r: _with(r, turns=_turns(("assistant", 0, 3), ("tool", 3, 2), ("assistant", 5, 1))), "turns",
     "cover 6 tokens but response_token_ids has 7"),
    (lambda r: _with(r, turns=_turns(("assistant", 0, 2), ("tool", 2, 3), ("assistant", 5, 2))), "response_mask",
     "is 1 at token 2, which turns puts in a non-assistant turn (the mask is 1 exactly on the assistant turns)"),
    (lambda r: _with(r, num_turns=3), "num_turns", "is 3 but turns has 2 assistant turn(s)"),
    (lambda r: _with(r, turn_rewards=[1.0]), "turn_rewards",
     "has 1 value(s) but num_turns is 2 (one per assistant turn)"),
    (lambda r: _with(r, tool_errors=-1), "tool_errors", "is -1 (a count, >= 0)"),
    (lambda r: _with(r, stop_reason="stop"), "stop_reason",
     "is 'stop' (expected one of done, max_turns, max_tokens, length)"),
])
def test_each_broken_trajectory_invariant_is_one_line_naming_column_keys_and_problem(edit, column, problem):
    from tests.helpers import trajectory_table

    table = trajectory_table(edit(_trajectories()))
    assert _error(lambda: validate(table, "samples", "t.parquet")) == \
        f"samples table (t.parquet): column {column!r}: {KEYS_OF_ROW_1} {problem}"


def test_more_rows_with_the_same_problem_are_counted():
    from tests.helpers import trajectory_table

    rows = [{**row, "stop_reason": "stop"} for row in _trajectories()]
    assert _error(lambda: validate(trajectory_table(rows), "samples")).endswith("(1 more row(s) like it)")


def test_trajectory_columns_come_all_together_with_their_types_and_no_nulls():
    from tests.helpers import trajectory_table

    table = trajectory_table(_trajectories())
    assert _error(lambda: validate(table.drop_columns(["turns", "stop_reason"]), "samples", "t.parquet")) == (
        "samples table (t.parquet): has trajectory column(s) response_mask, num_turns, messages_out, turn_rewards, "
        "tool_calls, tool_errors but not turns, stop_reason; a multi-turn samples table has all of them")
    turns = table.schema.get_field_index("turns")
    as_text = table.set_column(turns, "turns", pa.array(["[]", "[]"]))
    assert _error(lambda: validate(as_text, "samples", "t.parquet")) == (
        "samples table (t.parquet): column 'turns' has type string, expected "
        "list<item: struct<role: string, start: int32, length: int32>>")
    num_turns = table.schema.get_field_index("num_turns")
    with_null = table.set_column(num_turns, "num_turns", pa.array([1, None], pa.int32()))
    assert _error(lambda: validate(with_null, "samples", "t.parquet")) == \
        "samples table (t.parquet): column 'num_turns' has 1 null value(s)"
