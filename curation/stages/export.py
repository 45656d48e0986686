"""The export stage: run tables -> datasets other trainers read (TRL formats), as Parquet.

Formats (TRL's dataset formats; `datasets.load_dataset("parquet", data_files=...)` reads all):

    preference     prompt, chosen, rejected                     (pairs)        DPO/ORPO/CPO...
    prompt_only    prompt                                       (prompts)      GRPO/Online DPO
    unpaired       prompt, completion, label (bool)             (groups)       KTO
    sft            prompt, completion                           (kept samples, advantage > 0)
    messages       messages (prompt + response), tools          (as sft)       SFT, conversational only

`style="standard"` writes text; `style="conversational"` writes lists of {role, content}
messages (the prompt's own `messages` when it has them, else one user turn) and the
response as one assistant turn. Every row also carries prompt_id, round and, where they
apply, chosen_idx / rejected_idx / sample_idx, soft_label, weight, reward — columns TRL
ignores and a data engineer joins on.

Where it goes (`export_path`): RUN/exports/<format>-<style>.parquet by default; `out` ending in
.parquet is that file; any other `out` is a folder (an existing one, or a new name without a
suffix) and the export is <folder>/<format>-<style>.parquet. Another suffix (pairs.jsonl) is
refused: an export is always a Parquet file `datasets` reads.

Trajectories (multi-turn samples: the samples table's trajectory columns) export in TRL's
conversational tool-calling form, style "conversational" only (a standard export of them is a
ValueError): a response is the trajectory's messages after the prompt (messages_out: assistant
turns with OpenAI-style `tool_calls`, `role: "tool"` messages, environment `user` turns), so
a preference pair is two whole trajectories of one group, `prompt` + `chosen` and `prompt` +
`rejected` message lists. Each message is one JSON object (a `list<arrow.json>` column: tool
calls and their arguments keep their own keys, with no nulls added for other messages' keys;
`datasets` >= 4.7 reads them as dicts, its Json feature), and the export gets a `tools` column
(arrow.json): the JSON schemas of the tools the round's generate gave the chat template,
`curation.env.environments.tool_schemas` of its manifest's [env] tools, made at export time
(null for an environment without tools). TRL's SFT and DPO trainers pass `tools` to the chat
template (a JSON string they decode). A run whose samples are all single-turn exports as above.

The file's footer carries the export's provenance (curation/card.py), and `run_with_card`
(what `groupforge export` calls) rewrites the dataset card (README.md) of the file's folder.
With `append_to` (`export --append-to`, `[export] append_to`) the export goes to a Delta table
that grows by one version per append instead (curation/stages/dataset.py).

unpaired labels a response desirable when its advantage is > 0 (better than its group).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Sequence

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from curation.card import provenance, with_provenance, write_card
from curation.env.environments import tool_schemas
from store.faults import fault_point
from store.run_files import EXPORTS_DIR
from store.run_store import RunStore
from store.storage import OBJECT_SCHEMES, is_object_url, write_atomic


class ExportConfig(BaseModel):
    """What to export and how."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["preference", "prompt_only", "unpaired", "sft", "messages"] = Field(
        "preference", description="Which TRL dataset format to write (messages: the conversation of each sft "
                                  "row, prompt and response, as one message list; conversational only)."
    )
    style: Literal["standard", "conversational"] = Field(
        "standard", description="Plain text columns, or lists of {role, content} messages."
    )
    rounds: list[int] | None = Field(None, description="Rounds to export; None = all rounds.")
    append_to: str | None = Field(
        None, description="A Delta table (a folder or an object-store URL, e.g. s3://bucket/datasets/pairs) that "
                          "the export of the run's finished rounds not in it yet is appended to, as one new version "
                          "with its provenance (curation/stages/dataset.py); `groupforge run` appends at its end.")

    @field_validator("append_to")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        scheme, sep, rest = (value or "").partition("://")
        if sep and scheme != "file" and not (is_object_url(value) and rest.partition("/")[0]):
            raise ValueError(f"{value!r} is not a folder or an object-store URL with a bucket (s3://BUCKET/path; "
                             f"also {', '.join(s + '://' for s in OBJECT_SCHEMES if s != 's3')})")
        return value


_QUERIES = {
    "preference": """
        SELECT p.prompt_id, p.round, pr.prompt, pr.messages,
               c.response AS chosen, r.response AS rejected, c.messages_out AS chosen_out,
               r.messages_out AS rejected_out,
               p.chosen_idx, p.rejected_idx, p.chosen_reward, p.rejected_reward, p.soft_label, p.weight
        FROM pairs p
        JOIN samples c ON c.round = p.round AND c.prompt_id = p.prompt_id AND c.sample_idx = p.chosen_idx
        JOIN samples r ON r.round = p.round AND r.prompt_id = p.prompt_id AND r.sample_idx = p.rejected_idx
        JOIN prompts pr ON pr.prompt_id = p.prompt_id
        ORDER BY p.round, p.prompt_id, p.chosen_idx, p.rejected_idx""",
    "prompt_only": """
        SELECT pr.prompt_id, pr.prompt, pr.messages, pr.reference FROM prompts pr ORDER BY pr.prompt_id""",
    "unpaired": """
        SELECT g.prompt_id, g.round, pr.prompt, pr.messages, s.response AS completion,
               s.messages_out AS completion_out, g.advantage > 0 AS label, g.sample_idx, g.reward, g.advantage
        FROM groups g
        JOIN samples s USING (round, prompt_id, sample_idx)
        JOIN prompts pr ON pr.prompt_id = g.prompt_id
        WHERE g.group_kept
        ORDER BY g.round, g.prompt_id, g.sample_idx""",
    "sft": """
        SELECT g.prompt_id, g.round, pr.prompt, pr.messages, s.response AS completion,
               s.messages_out AS completion_out, g.sample_idx, g.reward
        FROM groups g
        JOIN samples s USING (round, prompt_id, sample_idx)
        JOIN prompts pr ON pr.prompt_id = g.prompt_id
        WHERE g.advantage > 0
        ORDER BY g.round, g.prompt_id, g.sample_idx""",
}
_QUERIES["messages"] = _QUERIES["sft"]

SAMPLE_COLUMNS = ["run_id", "round", "prompt_id", "sample_idx", "response", "messages_out"]
"""The samples columns an export reads (messages_out: a trajectory's messages, null when single-turn)."""

_OUT = {"chosen": "chosen_out", "rejected": "rejected_out", "completion": "completion_out"}
"""A response column and the trajectory messages column the queries give beside it."""

# The run tables each format reads (prompts: every round's; the others: ExportConfig.rounds).
READS = {
    "preference": ("pairs", "samples", "prompts"),
    "prompt_only": ("prompts",),
    "unpaired": ("groups", "samples", "prompts"),
    "sft": ("groups", "samples", "prompts"),
    "messages": ("groups", "samples", "prompts"),
}


def export_table(tables: dict[str, pa.Table], cfg: ExportConfig, tools: dict[int, str | None] | None = None
                 ) -> pa.Table:
    """The pure part: run tables in, one TRL-format table out. `tools`: per round, the JSON of
    its tools' schemas (a trajectory export's `tools` column; a round not in it: null)."""
    if cfg.format == "messages" and cfg.style != "conversational":
        raise ValueError("format messages is conversational: export it with style='conversational'")
    con = duckdb.connect()
    for name in READS[cfg.format]:
        table = tables[name]
        if name == "samples" and "messages_out" not in table.column_names:
            table = table.append_column("messages_out", pa.nulls(table.num_rows, pa.string()))
        con.register(name, table)
    out = con.sql(_QUERIES[cfg.format]).to_arrow_table()
    outs = {column: out.column(name).to_pylist() for column, name in _OUT.items() if name in out.column_names}
    out = out.drop([name for name in _OUT.values() if name in out.column_names])
    if any(m is not None for ms in outs.values() for m in ms):
        return _trajectories(out, outs, cfg, tools or {})
    table = _styled(out, cfg)
    if cfg.format == "messages":
        conversation = [p + c for p, c in zip(table.column("prompt").to_pylist(),
                                               table.column("completion").to_pylist())]
        table = table.drop(["prompt", "completion"]).add_column(1, "messages", pa.array(conversation))
    return table


def _trajectories(table: pa.Table, outs: dict[str, list[str | None]], cfg: ExportConfig,
                  tools: dict[int, str | None]) -> pa.Table:
    """An export with trajectories in TRL's conversational tool-calling form (the module): the
    prompt and each response column (`outs`: a row's messages_out, null for a single-turn one)
    as lists of JSON messages, and the `tools` column."""
    if cfg.style == "standard":
        raise ValueError("trajectories (multi-turn samples) export with style='conversational' only: their "
                         "turns are messages")
    prompts = table.column("prompt").to_pylist()
    messages = table.column("messages").to_pylist()
    table = table.drop(["prompt", "messages"])
    opening = [_json_messages(m if m is not None else [{"role": "user", "content": p}])
               for p, m in zip(prompts, messages)]
    replies = {column: [_json_messages(json.loads(out) if out is not None else [{"role": "assistant", "content": r}])
                        for out, r in zip(outs[column], table.column(column).to_pylist())]
               for column in outs}
    if cfg.format == "messages":
        table = table.drop(["completion"]).add_column(1, "messages", _message_lists(
            [p + c for p, c in zip(opening, replies["completion"])]))
    else:
        table = table.add_column(1, "prompt", _message_lists(opening))
        for column, lists in replies.items():
            table = table.set_column(table.column_names.index(column), column, _message_lists(lists))
    per_round = [tools.get(r) for r in table.column("round").to_pylist()]
    return table.add_column(2, "tools", pa.array(per_round, pa.string()).cast(pa.json_()))


def _json_messages(messages: list[dict]) -> list[str]:
    return [json.dumps(message, ensure_ascii=False) for message in messages]


def _message_lists(lists: list[list[str]]) -> pa.Array:
    """Message lists as list<arrow.json>: each message one JSON object."""
    return pa.array(lists, pa.list_(pa.string())).cast(pa.list_(pa.json_()))


def round_tools(store: RunStore, rounds: Sequence[int] | None = None) -> dict[int, str | None]:
    """{round: the JSON of its tools' schemas} for each multi-turn round (a generate manifest
    with config["env"]): tool_schemas of its [env] tools (null JSON for none), made now, so the
    tools must import (a one-line ValueError naming the round otherwise)."""
    out: dict[int, str | None] = {}
    for (stage, round), manifest in sorted(store.state.manifests.items()):
        env = (manifest.get("config") or {}).get("env")
        if stage != "generate" or env is None or (rounds is not None and round not in rounds):
            continue
        try:
            schemas = tool_schemas(env.get("tools") or [])
        except ValueError as exc:
            raise ValueError(f"round {round}: the tools of its [env] cannot be described for the export: {exc}"
                             ) from None
        out[round] = json.dumps(schemas, ensure_ascii=False) if schemas else None
    return out


def plain_json(table: pa.Table) -> pa.Table:
    """`table` with its arrow.json columns (a trajectory export's) as plain strings: for writers
    without a JSON type (Delta Lake)."""
    def plain(type_: pa.DataType) -> pa.DataType:
        if isinstance(type_, pa.JsonType):
            return pa.string()
        if pa.types.is_list(type_):
            return pa.list_(plain(type_.value_type))
        return type_

    schema = pa.schema([field.with_type(plain(field.type)) for field in table.schema], metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)


def _styled(table: pa.Table, cfg: ExportConfig) -> pa.Table:
    prompts = table.column("prompt").to_pylist()
    messages = table.column("messages").to_pylist()
    table = table.drop(["prompt", "messages"])
    if cfg.style == "standard":
        if any(p is None for p in prompts):
            raise ValueError("prompts with 'messages' only can be exported with style='conversational' alone")
        return table.add_column(1, "prompt", pa.array(prompts, pa.string()))
    turns = [m if m is not None else [{"role": "user", "content": p}] for p, m in zip(prompts, messages)]
    table = table.add_column(1, "prompt", pa.array(turns))
    for column in ("chosen", "rejected", "completion"):
        if column in table.column_names:
            i = table.column_names.index(column)
            replies = [[{"role": "assistant", "content": text}] for text in table.column(column).to_pylist()]
            table = table.set_column(i, column, pa.array(replies))
    return table


def export_path(run_dir: str | Path, cfg: ExportConfig, out: str | Path | None = None) -> Path:
    """The Parquet file an export of `run_dir` with `cfg` is written to: `out` when it ends in
    .parquet; <out>/<format>-<style>.parquet when `out` is a folder (an existing one, or a new
    name without a suffix); RUN/exports/<format>-<style>.parquet when `out` is None. Any other
    `out` is a ValueError (one line, naming it), raised before anything is read or written."""
    name = f"{cfg.format}-{cfg.style}.parquet"
    if out is None:
        return Path(run_dir) / EXPORTS_DIR / name
    out = Path(out)
    if ".." in out.parts:
        raise ValueError(f"export path {out}: '..' is refused in an export path; give it without '..'")
    accepts = (f"--out accepts a path ending in .parquet, or a folder (an existing one, or a new name "
               f"without a suffix) to write {name} and its README.md into")
    if out.suffix == ".parquet":
        if out.is_dir():
            raise ValueError(f"--out {out}: is a folder, not a Parquet file; {accepts}")
        path = out
    elif out.is_dir():
        return out / name
    elif out.exists():
        raise ValueError(f"--out {out}: is a file without the .parquet suffix; {accepts}")
    elif out.suffix:
        raise ValueError(f"--out {out}: exports are Parquet, not {out.suffix}; {accepts}")
    else:
        path = out / name
    for parent in path.parents:  # the nearest one that exists must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {out}: {parent} is a file, not a folder; {accepts}")
            break
    return path


def run(run_dir: str | Path, cfg: ExportConfig, out: str | Path | None = None,
        as_of: int | None = None) -> tuple[Path, int]:
    """Write the export of `run_dir` to `export_path(run_dir, cfg, out)`, atomically. Returns
    the path and the row count. `as_of`: the run as it was when that round was done
    (RunStore.as_of_round): the same bytes as an export taken then, by the same groupforge."""
    path = export_path(run_dir, cfg, out)
    store = RunStore(run_dir)
    table = export_rows(store.snapshot() if as_of is None else store.as_of_round(as_of), cfg)  # whole commits

    def write(f) -> None:
        pq.write_table(table, f, compression="zstd")
        fault_point("export.before_rename")

    write_atomic(path, write)
    return path, table.num_rows


def export_rows(store: RunStore, cfg: ExportConfig, allow_empty: bool = False) -> pa.Table:
    """The export of `store` (a snapshot) with `cfg`, its provenance in the schema metadata. An
    input table without rows for `cfg.rounds` is a ValueError naming it, unless `allow_empty`
    (then the export has no rows)."""
    tables = {}
    for name in READS[cfg.format]:
        rounds: Sequence[int] | None = None if name == "prompts" else cfg.rounds
        columns = SAMPLE_COLUMNS if name == "samples" else None
        tables[name] = store.read(name, rounds=rounds, columns=columns)
        if tables[name].num_rows == 0 and not allow_empty:
            where = f" in rounds {cfg.rounds}" if cfg.rounds else ""
            raise ValueError(f"{store.location}: the {name} table is empty{where}; "
                             f"run the stage that writes it before exporting {cfg.format}")
    table = export_table(tables, cfg, round_tools(store, cfg.rounds))
    return with_provenance(table, provenance(store, cfg.rounds, cfg.format, cfg.style))


def run_with_card(run_dir: str | Path, cfg: ExportConfig, out: str | Path | None = None,
                  as_of: int | None = None) -> tuple[Path, int, Path | None]:
    """`run`, then the dataset card of the export's folder (curation/card.py): (path, rows,
    the card, or None when the folder holds a README.md groupforge did not write:
    `curation.card.foreign_card` names it)."""
    path, rows = run(run_dir, cfg, out, as_of)
    return path, rows, write_card(path.parent)
