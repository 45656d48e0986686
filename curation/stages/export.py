"""The export stage: run tables -> datasets other trainers read (TRL formats), as Parquet.

Formats (TRL's dataset formats; `datasets.load_dataset("parquet", data_files=...)` reads all):

    preference     prompt, chosen, rejected                     (pairs)        DPO/ORPO/CPO...
    prompt_only    prompt                                       (prompts)      GRPO/Online DPO
    unpaired       prompt, completion, label (bool)             (groups)       KTO
    sft            prompt, completion                           (kept samples, advantage > 0)

`style="standard"` writes text; `style="conversational"` writes lists of {role, content}
messages (the prompt's own `messages` when it has them, else one user turn) and the
response as one assistant turn. Every row also carries prompt_id, round and, where they
apply, chosen_idx / rejected_idx / sample_idx, soft_label, weight, reward — columns TRL
ignores and a data engineer joins on.

Where it goes (`export_path`): RUN/exports/<format>-<style>.parquet by default; `out` ending in
.parquet is that file; any other `out` is a folder (an existing one, or a new name without a
suffix) and the export is <folder>/<format>-<style>.parquet. Another suffix (pairs.jsonl) is
refused: an export is always a Parquet file `datasets` reads.

The file's footer carries the export's provenance (curation/card.py), and `run_with_card`
(what `groupforge export` calls) rewrites the dataset card (README.md) of the file's folder.
With `append_to` (`export --append-to`, `[export] append_to`) the export goes to a Delta table
that grows by one version per append instead (curation/stages/dataset.py).

unpaired labels a response desirable when its advantage is > 0 (better than its group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from curation.card import provenance, with_provenance, write_card
from store.faults import fault_point
from store.run_files import EXPORTS_DIR
from store.run_store import RunStore
from store.storage import OBJECT_SCHEMES, is_object_url, write_atomic


class ExportConfig(BaseModel):
    """What to export and how."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["preference", "prompt_only", "unpaired", "sft"] = Field(
        "preference", description="Which TRL dataset format to write."
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
               c.response AS chosen, r.response AS rejected,
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
               g.advantage > 0 AS label, g.sample_idx, g.reward, g.advantage
        FROM groups g
        JOIN samples s USING (round, prompt_id, sample_idx)
        JOIN prompts pr ON pr.prompt_id = g.prompt_id
        WHERE g.group_kept
        ORDER BY g.round, g.prompt_id, g.sample_idx""",
    "sft": """
        SELECT g.prompt_id, g.round, pr.prompt, pr.messages, s.response AS completion,
               g.sample_idx, g.reward
        FROM groups g
        JOIN samples s USING (round, prompt_id, sample_idx)
        JOIN prompts pr ON pr.prompt_id = g.prompt_id
        WHERE g.advantage > 0
        ORDER BY g.round, g.prompt_id, g.sample_idx""",
}

# The run tables each format reads (prompts: every round's; the others: ExportConfig.rounds).
READS = {
    "preference": ("pairs", "samples", "prompts"),
    "prompt_only": ("prompts",),
    "unpaired": ("groups", "samples", "prompts"),
    "sft": ("groups", "samples", "prompts"),
}


def export_table(tables: dict[str, pa.Table], cfg: ExportConfig) -> pa.Table:
    """The pure part: run tables in, one TRL-format table out."""
    con = duckdb.connect()
    for name in READS[cfg.format]:
        con.register(name, tables[name])
    out = con.sql(_QUERIES[cfg.format]).to_arrow_table()
    return _styled(out, cfg)


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
        tables[name] = store.read(name, rounds=rounds)
        if tables[name].num_rows == 0 and not allow_empty:
            where = f" in rounds {cfg.rounds}" if cfg.rounds else ""
            raise ValueError(f"{store.location}: the {name} table is empty{where}; "
                             f"run the stage that writes it before exporting {cfg.format}")
    table = export_table(tables, cfg)
    return with_provenance(table, provenance(store, cfg.rounds, cfg.format, cfg.style))


def run_with_card(run_dir: str | Path, cfg: ExportConfig, out: str | Path | None = None,
                  as_of: int | None = None) -> tuple[Path, int, Path | None]:
    """`run`, then the dataset card of the export's folder (curation/card.py): (path, rows,
    the card, or None when the folder holds a README.md groupforge did not write:
    `curation.card.foreign_card` names it)."""
    path, rows = run(run_dir, cfg, out, as_of)
    return path, rows, write_card(path.parent)
