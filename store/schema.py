"""The table contracts: one pyarrow schema per table, and `validate` with clear errors.

Every stage reads its inputs through `read_table_file` / `validate`, so a wrong table fails
at the door with a one-line message that names the table, the file, the column, the
expected type and the type found.

Columns (every one, with its meaning: docs/ARCHITECTURE.md, "Tables"):

- prompts: prompt_id, prompt | messages, reference, metadata
- samples: one row per sampled response, with `behavior_logprobs` (one float per sampled
  token: its log-prob under the sampling distribution, i.e. after temperature/top-p); a
  multi-turn generate adds the trajectory columns (`TRAJECTORY_FIELDS`): response_mask (1 on
  the model's tokens, 0 on tool/environment tokens), turns (spans of response_token_ids: role,
  start, length), num_turns (assistant turns), messages_out (JSON), turn_rewards, tool_calls,
  tool_errors, stop_reason. A single-turn table has none of them; one that has any has all,
  and `check_trajectories` checks their per-row invariants
- scores: keys + one nullable float column per reward function + reward + scorer
- groups: keys + reward, advantage, group_mean, group_std, group_kept
- rejects: keys + stage, reason, detail (sample_idx is null when a whole prompt is dropped)
- pairs: preference pairs inside a group with soft labels and weights
- prompt_stats: the round loop's per-prompt history (`[prompts] curriculum`): one row per
  prompt a round sampled, its counts as of that round (pipelines/loop/curriculum.py)

Tables may carry extra columns (a scores table has one per reward function); the listed
ones must be there with the listed types. Types that only differ in width of the offsets
(string/large_string, list/large_list) or in integer width where no value is lost are
accepted and cast to the canonical type.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

KEYS = ("run_id", "round", "prompt_id", "sample_idx")

_KEY_FIELDS = [
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("round", pa.int32(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_idx", pa.int32(), nullable=False),
]

MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])

PROMPTS = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("messages", pa.list_(MESSAGE)),
        pa.field("reference", pa.string()),
        pa.field("metadata", pa.string()),  # a JSON object, as text
    ]
)

SAMPLES = pa.schema(
    _KEY_FIELDS
    + [
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("generator", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
    ]
)

SCORES = pa.schema(
    _KEY_FIELDS
    + [
        pa.field("reward", pa.float64()),
        pa.field("scorer", pa.string(), nullable=False),  # scorer fingerprints, JSON
    ]
)

GROUPS = pa.schema(
    _KEY_FIELDS
    + [
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("advantage", pa.float64(), nullable=False),
        pa.field("group_mean", pa.float64(), nullable=False),
        pa.field("group_std", pa.float64(), nullable=False),
        pa.field("group_kept", pa.bool_(), nullable=False),
    ]
)

REJECTS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32()),  # null: the whole prompt was dropped
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
    ]
)

PAIRS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("chosen_idx", pa.int32(), nullable=False),
        pa.field("rejected_idx", pa.int32(), nullable=False),
        pa.field("chosen_reward", pa.float64(), nullable=False),
        pa.field("rejected_reward", pa.float64(), nullable=False),
        pa.field("margin", pa.float64(), nullable=False),
        pa.field("soft_label", pa.float64(), nullable=False),
        pa.field("weight", pa.float64(), nullable=False),
    ]
)

PROMPT_STATS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("round", pa.int32(), nullable=False),  # the round that sampled it: its last round
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("rounds_seen", pa.int32(), nullable=False),  # rounds that sampled it, this one included
        pa.field("samples", pa.int64(), nullable=False),  # its scored samples (reward not null), all rounds
        pa.field("passes", pa.int64(), nullable=False),  # of those, reward >= the pass reward
        pa.field("recent_samples", pa.int64(), nullable=False),  # ... in its last `window` rounds
        pa.field("recent_passes", pa.int64(), nullable=False),
        pa.field("pass_rate", pa.float64()),  # recent_passes / recent_samples (null: none scored)
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "samples": SAMPLES,
    "scores": SCORES,
    "groups": GROUPS,
    "rejects": REJECTS,
    "pairs": PAIRS,
    "prompt_stats": PROMPT_STATS,
}

TURN = pa.struct([pa.field("role", pa.string()), pa.field("start", pa.int32()), pa.field("length", pa.int32())])
"""One span of a trajectory's response_token_ids: role (TURN_ROLES), first token, token count."""

TURN_ROLES = ("assistant", "tool", "user")
"""A turn's role: assistant (sampled by the model), tool or user (rendered environment tokens)."""

STOP_REASONS = ("done", "max_turns", "max_tokens", "length")
"""Why a trajectory ended: the environment ended it or an assistant turn made no tool call
(done), the turn limit (max_turns), the trajectory's token limit (max_tokens), a model turn cut
by max_tokens (length)."""

TRAJECTORY_FIELDS = [
    pa.field("response_mask", pa.list_(pa.int8()), nullable=False),  # 1 model token, 0 tool/environment
    pa.field("turns", pa.list_(TURN), nullable=False),
    pa.field("num_turns", pa.int32(), nullable=False),  # assistant turns
    pa.field("messages_out", pa.string(), nullable=False),  # JSON: the messages after the prompt
    pa.field("turn_rewards", pa.list_(pa.float64()), nullable=False),  # per assistant turn, items nullable
    pa.field("tool_calls", pa.int32(), nullable=False),
    pa.field("tool_errors", pa.int32(), nullable=False),
    pa.field("stop_reason", pa.string(), nullable=False),  # STOP_REASONS
]
"""The samples table's optional trajectory columns (multi-turn generation): none or all of
them. validate checks and casts their types like the contract's, then `check_trajectories`."""

_TRAJECTORY = {field.name: field for field in TRAJECTORY_FIELDS}

# Columns a table may leave out entirely (they are added as nulls).
OPTIONAL_COLUMNS: dict[str, set[str]] = {
    "prompts": {"prompt", "messages", "reference", "metadata"},
    "rejects": {"detail"},
}

class SchemaError(ValueError):
    """A table does not meet its contract. The message is one line and names the problem."""


def _where(name: str, source: str | Path | None) -> str:
    return f"{name} table" + (f" ({source})" if source else "")


def _compatible(found: pa.DataType, expected: pa.DataType) -> bool:
    """True when `found` can be cast to `expected` without changing any value's meaning."""
    if found == expected or pa.types.is_null(found):
        return True
    if pa.types.is_string(expected):
        if pa.types.is_dictionary(found):
            found = found.value_type
        return (pa.types.is_string(found) or pa.types.is_large_string(found) or pa.types.is_string_view(found)
                or pa.types.is_binary(found) or pa.types.is_large_binary(found))  # the cast checks UTF-8
    if pa.types.is_integer(expected):
        return pa.types.is_integer(found) or pa.types.is_dictionary(found) and pa.types.is_integer(found.value_type)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(found) or pa.types.is_integer(found)
    if pa.types.is_list(expected):
        if pa.types.is_list(found) or pa.types.is_large_list(found) or pa.types.is_list_view(found):
            return _compatible(found.value_type, expected.value_type)
        return False
    if pa.types.is_struct(expected):
        if not pa.types.is_struct(found):
            return False
        found_fields = {found.field(i).name: found.field(i).type for i in range(found.num_fields)}
        return all(
            f.name in found_fields and _compatible(found_fields[f.name], f.type) for f in expected
        )
    return False


def validate(table: pa.Table, name: str, source: str | Path | None = None) -> pa.Table:
    """Check `table` against the `name` contract and return it with canonical column types.

    Raises SchemaError naming the table, the source, the column, the expected and the found
    type. Extra columns are kept as they are.

    >>> validate(pa.table({"prompt_id": ["a"], "prompt": ["1+1="]}), "prompts").schema.names
    ['prompt_id', 'prompt', 'messages', 'reference', 'metadata']
    """
    if name not in SCHEMAS:
        raise SchemaError(f"unknown table name {name!r}; known: {', '.join(SCHEMAS)}")
    schema = SCHEMAS[name]
    where = _where(name, source)
    if _has_contract_schema(table, schema):  # the usual case (a stage's output, a file we wrote): nothing to cast
        for i, field in enumerate(schema):
            if not field.nullable and table.column(i).null_count:
                raise SchemaError(f"{where}: column {field.name!r} has {table.column(i).null_count} null value(s)")
        if name == "prompts" and table.num_rows:
            _check_prompts({field.name: table.column(i) for i, field in enumerate(schema)}, where)
        return _with_trajectories(table, where) if name == "samples" else table
    optional = OPTIONAL_COLUMNS.get(name, set())
    columns: dict[str, pa.ChunkedArray] = {}
    for field in schema:
        if field.name not in table.column_names:
            if field.name in optional:
                columns[field.name] = pa.nulls(table.num_rows, field.type)
                continue
            raise SchemaError(
                f"{where}: missing column {field.name!r} (expected {field.type}); "
                f"found columns: {', '.join(table.column_names) or 'none'}"
            )
        column = table.column(field.name)
        if not _compatible(column.type, field.type):
            raise SchemaError(
                f"{where}: column {field.name!r} has type {column.type}, expected {field.type}"
            )
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(
                    f"{where}: column {field.name!r} cannot be read as {field.type}: {exc}"
                ) from None
        if not field.nullable and column.null_count:
            raise SchemaError(f"{where}: column {field.name!r} has {column.null_count} null value(s)")
        columns[field.name] = column
    if name == "prompts" and table.num_rows:
        _check_prompts(columns, where)
    extras = [c for c in table.column_names if c not in columns]
    arrays = list(columns.values()) + [table.column(c) for c in extras]
    fields = list(schema) + [table.schema.field(c) for c in extras]
    out = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
    return _with_trajectories(out, where) if name == "samples" else out


def field_of(name: str, column: str) -> pa.Field:
    """The field of `column` in the `name` contract, or a samples trajectory column's
    (TRAJECTORY_FIELDS); KeyError for any other."""
    schema = SCHEMAS[name]
    index = schema.get_field_index(column)
    if index >= 0:
        return schema.field(index)
    if name == "samples" and column in _TRAJECTORY:
        return _TRAJECTORY[column]
    raise KeyError(f"the {name} table has no column {column!r}")


def _with_trajectories(table: pa.Table, where: str) -> pa.Table:
    """A samples table whose trajectory columns (none, or all of TRAJECTORY_FIELDS) have
    their types (cast when compatible) and hold no nulls, their per-row invariants checked;
    a table without them is returned as it is."""
    present = [name for name in table.column_names if name in _TRAJECTORY]
    if not present:
        return table
    missing = [field.name for field in TRAJECTORY_FIELDS if field.name not in present]
    if missing:
        raise SchemaError(f"{where}: has trajectory column(s) {', '.join(present)} but not "
                          f"{', '.join(missing)}; a multi-turn samples table has all of them")
    for name in present:
        field, index = _TRAJECTORY[name], table.schema.get_field_index(name)
        column = table.column(index)
        if not _compatible(column.type, field.type):
            raise SchemaError(f"{where}: column {name!r} has type {column.type}, expected {field.type}")
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(f"{where}: column {name!r} cannot be read as {field.type}: {exc}") from None
        if column.null_count:
            raise SchemaError(f"{where}: column {name!r} has {column.null_count} null value(s)")
        if column.type != table.column(index).type or not table.schema.field(index).equals(field):
            table = table.set_column(index, field, column)
    if table.num_rows:
        check_trajectories(table, where=where)
    return table


def one_turn_trajectories(samples: pa.Table) -> pa.Table:
    """A single-turn samples table with the trajectory columns of what each row is, a
    trajectory of one assistant turn: every token the model's, `messages_out` its response,
    no tool call, stop_reason "done" (finish_reason stop) or "length". Used where single-turn
    and multi-turn parts meet in one table (a run's rounds read together)."""
    if samples.schema.get_field_index("response_mask") >= 0:
        return samples
    lengths = pc.list_value_length(samples.column("response_token_ids")).to_numpy(zero_copy_only=False)
    responses = samples.column("response").to_pylist()
    finished = samples.column("finish_reason").to_pylist()
    columns = {
        "response_mask": [[1] * int(n) for n in lengths],
        "turns": [[{"role": "assistant", "start": 0, "length": int(n)}] if n else [] for n in lengths],
        "num_turns": [1 if n else 0 for n in lengths],
        "messages_out": [json.dumps([{"content": text, "role": "assistant"}], ensure_ascii=False)
                         for text in responses],
        "turn_rewards": [[None] if n else [] for n in lengths],
        "tool_calls": [0] * samples.num_rows,
        "tool_errors": [0] * samples.num_rows,
        "stop_reason": ["done" if reason == "stop" else "length" for reason in finished],
    }
    for field in TRAJECTORY_FIELDS:
        samples = samples.append_column(field, pa.array(columns[field.name], field.type))
    return samples


def check_trajectories(table: pa.Table, where: str = "samples table") -> None:
    """The per-row invariants of a samples table's trajectory columns (with the types validate
    gives them; validate calls this): response_mask and behavior_logprobs have one value per
    response token; the mask holds 0 and 1 only, and behavior_logprobs are 0.0 where it is 0;
    the turns cover response_token_ids in order without gaps, each at least one token with a
    role of TURN_ROLES, the assistant turns exactly where the mask is 1; num_turns is the
    number of assistant turns and turn_rewards has one value per assistant turn; tool_calls
    and tool_errors are >= 0; stop_reason is one of STOP_REASONS. Raises SchemaError naming
    `where`, the column, the first bad row's keys and the problem (and how many rows have it).
    Vectorised over the rows (pyarrow.compute and numpy)."""
    column = {name: table.column(name).combine_chunks() for name in
              ["response_token_ids", "behavior_logprobs", *_TRAJECTORY] + [k for k in KEYS]}

    def fail(name: str, rows: np.ndarray, problem) -> None:
        bad = np.flatnonzero(rows) if rows.dtype == bool else np.unique(rows)
        if not bad.size:
            return
        row = int(bad[0])
        keys = ", ".join(f"{k}={column[k][row].as_py()!r}" for k in KEYS)
        more = f" ({bad.size - 1} more row(s) like it)" if bad.size > 1 else ""
        raise SchemaError(f"{where}: column {name!r}: sample ({keys}) {problem(row)}{more}")

    def lengths(name: str) -> np.ndarray:
        return pc.list_value_length(column[name]).to_numpy(zero_copy_only=False).astype(np.int64)

    def flat(name: str) -> np.ndarray:
        return pc.list_flatten(column[name]).to_numpy(zero_copy_only=False)

    tokens = lengths("response_token_ids")
    for name in ("response_mask", "behavior_logprobs"):
        found = lengths(name)
        fail(name, found != tokens, lambda r, found=found: (
            f"has {found[r]} values but response_token_ids has {tokens[r]} tokens; they must match one to one"))
    starts = np.concatenate([[0], np.cumsum(tokens)])  # each row's first token in the flat arrays
    token_row = np.repeat(np.arange(table.num_rows), tokens)
    mask = flat("response_mask").astype(np.int64)
    at = np.flatnonzero((mask != 0) & (mask != 1))
    fail("response_mask", token_row[at], lambda r: (
        f"has value {mask[at[token_row[at] == r][0]]} at token {at[token_row[at] == r][0] - starts[r]} "
        "(expected 0: tool/environment or 1: model)"))
    logprobs = flat("behavior_logprobs")
    at = np.flatnonzero((mask == 0) & (logprobs != 0))
    fail("behavior_logprobs", token_row[at], lambda r: (
        f"is {logprobs[at[token_row[at] == r][0]]} at token {at[token_row[at] == r][0] - starts[r]}, "
        "where response_mask is 0 (expected 0.0 at tool/environment tokens)"))

    turns = pc.list_flatten(column["turns"])
    per_row = lengths("turns")
    turn_row = np.repeat(np.arange(table.num_rows), per_row)
    first_turn = np.concatenate([[0], np.cumsum(per_row)])
    role, start, length = (pc.struct_field(turns, f) for f in ("role", "start", "length"))
    for name, values in (("role", role), ("start", start), ("length", length)):
        nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
        fail("turns", turn_row[nulls], lambda r, name=name: f"has a turn whose {name} is null")
    roles = role.to_numpy(zero_copy_only=False)
    unknown = np.flatnonzero(~np.isin(roles, TURN_ROLES))
    fail("turns", turn_row[unknown], lambda r: (
        f"has a turn with role {roles[unknown[turn_row[unknown] == r][0]]!r} "
        f"(expected one of {', '.join(TURN_ROLES)})"))
    start, length = start.to_numpy().astype(np.int64), length.to_numpy().astype(np.int64)
    empty_turn = np.flatnonzero(length < 1)
    fail("turns", turn_row[empty_turn], lambda r: (
        f"turn {empty_turn[turn_row[empty_turn] == r][0] - first_turn[r]} has length "
        f"{length[empty_turn[turn_row[empty_turn] == r][0]]} (a turn is at least one token)"))
    ends = np.concatenate([[0], np.cumsum(length)])
    expected = ends[:-1] - ends[first_turn[turn_row]]  # where each turn starts if its row's turns abut
    gap = np.flatnonzero(start != expected)
    fail("turns", turn_row[gap], lambda r: (
        f"turn {gap[turn_row[gap] == r][0] - first_turn[r]} starts at {start[gap[turn_row[gap] == r][0]]}, "
        f"expected {expected[gap[turn_row[gap] == r][0]]} (the turns cover response_token_ids in order, "
        "without gaps)"))
    covered = ends[first_turn[1:]] - ends[first_turn[:-1]]
    fail("turns", covered != tokens, lambda r: (
        f"cover {covered[r]} tokens but response_token_ids has {tokens[r]}"))
    assistant = roles == "assistant"
    differs = np.flatnonzero(np.repeat(assistant, length).astype(np.int64) != mask)
    fail("response_mask", token_row[differs], lambda r: (
        f"is {mask[differs[token_row[differs] == r][0]]} at token {differs[token_row[differs] == r][0] - starts[r]}"
        f", which turns puts in a {'non-' if mask[differs[token_row[differs] == r][0]] else ''}assistant turn "
        "(the mask is 1 exactly on the assistant turns)"))

    counted = np.bincount(turn_row, weights=assistant, minlength=table.num_rows).astype(np.int64)
    num_turns = column["num_turns"].to_numpy().astype(np.int64)
    fail("num_turns", num_turns != counted, lambda r: f"is {num_turns[r]} but turns has {counted[r]} assistant turn(s)")
    rewards = lengths("turn_rewards")
    fail("turn_rewards", rewards != num_turns, lambda r: (
        f"has {rewards[r]} value(s) but num_turns is {num_turns[r]} (one per assistant turn)"))
    for name in ("tool_calls", "tool_errors"):
        values = column[name].to_numpy().astype(np.int64)
        fail(name, values < 0, lambda r, values=values: f"is {values[r]} (a count, >= 0)")
    reasons = column["stop_reason"]
    fail("stop_reason", ~pc.is_in(reasons, pa.array(STOP_REASONS)).to_numpy(zero_copy_only=False),
         lambda r: f"is {reasons[r].as_py()!r} (expected one of {', '.join(STOP_REASONS)})")


def _has_contract_schema(table: pa.Table, schema: pa.Schema) -> bool:
    """True when `table` starts with exactly the contract's fields (names, types, nullability, no
    metadata), has no schema metadata and no repeated names: what `validate` would return is
    then `table` itself, once its non-nullable columns are checked for nulls (~5 us instead of
    ~90 us for rebuilding it column by column)."""
    found = table.schema
    if found.metadata or len(found) < len(schema):
        return False
    if len(found) == len(schema):
        return found.equals(schema, check_metadata=True)
    names = found.names
    return (len(set(names)) == len(names)
            and all(found.field(i).equals(field, check_metadata=True) for i, field in enumerate(schema)))


def as_contract(columns: list[pa.Array | pa.ChunkedArray], name: str) -> pa.Table:
    """A table of the `name` contract's columns, in its order: with the contract's schema when
    every column has its contract type (validate then returns it as is), else with its names
    only (validate casts). For stages building an output table."""
    schema = SCHEMAS[name]
    if all(column.type == field.type for column, field in zip(columns, schema)):
        return pa.Table.from_arrays(columns, schema=schema)
    return pa.Table.from_arrays(columns, names=schema.names)


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a prompt's messages may have."""


def _check_prompts(columns: dict[str, pa.ChunkedArray], where: str) -> None:
    prompt, messages = columns["prompt"], columns["messages"]
    if prompt.null_count and messages.null_count:  # else no row can have both null
        both_null = pc.and_(prompt.is_null(), messages.is_null())
        missing = pc.sum(both_null).as_py() or 0
        if missing:
            raise SchemaError(f"{where}: {missing} row(s) have neither 'prompt' nor 'messages'")
    if prompt.null_count < len(prompt) and pc.min(pc.binary_length(prompt)).as_py() == 0:
        raise SchemaError(f"{where}: column 'prompt': {_rows(pc.equal(pc.utf8_length(prompt), 0))} an empty string")
    if messages.null_count == len(messages):  # every prompt is text (no empty lists, no messages to check)
        return
    no_messages = pc.equal(pc.list_value_length(messages), 0)
    if pc.any(no_messages).as_py():
        raise SchemaError(f"{where}: column 'messages': {_rows(no_messages)} an empty list of messages")
    parents = pc.list_parent_indices(messages)
    flat = pc.list_flatten(messages)
    for field in ("role", "content"):
        values = pc.struct_field(flat, field)
        bad = pc.invert(pc.is_valid(values)) if field == "content" else pc.invert(
            pc.fill_null(pc.is_in(values, pa.array(CHAT_ROLES)), False))
        if pc.any(bad).as_py():
            at = pc.indices_nonzero(bad)[0].as_py()
            row = parents[at].as_py()
            found = values[at].as_py()
            expected = f"one of {', '.join(CHAT_ROLES)}" if field == "role" else "a string"
            raise SchemaError(f"{where}: column 'messages': row {row} has a message whose {field} is {found!r} "
                              f"(expected {expected})")


def _rows(mask: pa.ChunkedArray) -> str:
    """'row 3 is' / '2 rows (first: row 3) are': the rows where `mask` is true, for a message."""
    found = pc.indices_nonzero(pa.chunked_array(mask.chunks) if isinstance(mask, pa.ChunkedArray) else mask)
    first = found[0].as_py()
    return f"row {first} is" if len(found) == 1 else f"{len(found)} rows (first: row {first}) are"


def read_table_file(path: str | Path, name: str) -> pa.Table:
    """Read one Parquet file and validate it as table `name`, with one-line errors for files
    that are missing, empty or not Parquet at all."""
    path = Path(path)
    if not path.exists():
        raise SchemaError(f"{_where(name, path)}: file not found")
    if path.is_dir():
        raise SchemaError(f"{_where(name, path)}: is a folder, expected a Parquet file")
    if path.stat().st_size == 0:
        raise SchemaError(f"{_where(name, path)}: file is empty (0 bytes), expected Parquet")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SchemaError(f"{_where(name, path)}: not a readable Parquet file ({first_line})") from None
    return validate(table, name, path)


def empty(name: str) -> pa.Table:
    """An empty table with the `name` schema (one per name, made once: tables are immutable,
    and making one costs ~60 us, a stage with no rejects pays it every round)."""
    if name not in _EMPTY:
        _EMPTY[name] = SCHEMAS[name].empty_table()
    return _EMPTY[name]


_EMPTY: dict[str, pa.Table] = {}
