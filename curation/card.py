"""Dataset cards for exports: a Hugging Face dataset card (README.md) next to the Parquet files.

    groupforge export RUN --format sft            RUN/exports/sft-standard.parquet
                                                  RUN/exports/README.md   (this module)
    groupforge export RUN --out pairs             pairs/preference-standard.parquet
                                                  pairs/README.md
    groupforge export RUN --out data/p.parquet    data/p.parquet, data/README.md

Each export carries its provenance in its own Parquet footer (schema metadata key
`groupforge.provenance`, JSON: see `provenance`), so the card is rebuilt from the files in
the folder every time one is written: one `configs` entry per export (its file as the train
split), `dataset_info` with each one's features and row count, and a provenance section per
export, all generated from the run's manifests. `datasets.load_dataset(folder)` reads the
default (newest) export and the card; `load_dataset(folder, "<format>-<style>")` another.

A README.md that groupforge did not write (no CARD_MARKER) is never replaced: the card is
skipped with a warning. The license field is left for the user to fill in.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from store.errors import JobError
from store.fingerprints import code_version
from store.run_store import RunStore
from store.storage import write_atomic

CARD_FILE = "README.md"
CARD_MARKER = "<!-- written by groupforge export: rewritten on every export into this folder -->"
METADATA_KEY = b"groupforge.provenance"
CURATION = ("score", "filter", "label", "pair")


def provenance(store: RunStore, rounds: list[int] | None, fmt: str, style: str) -> dict[str, Any]:
    """Where an export of `rounds` (None: all) of the run comes from, from its manifests: the
    source model and its fingerprint, policy versions, sampling settings, reward functions and
    their versions, filter/label/pair settings, drops by reason and groupforge's version (and "env",
    the [env] settings of a multi-turn run's generate; absent for a single-turn run). Nothing
    about the export call itself (no command line, no time): an export of the same data by the
    same groupforge gives the same bytes (`export --as-of`)."""
    manifests = {key: m for key, m in sorted(store.state.manifests.items()) if rounds is None or key[1] in rounds}
    used = sorted({r for _, r in manifests})
    generate = [m for (stage, _), m in sorted(manifests.items()) if stage == "generate"]
    by_stage = {stage: [m for (s, _), m in sorted(manifests.items()) if s == stage] for stage in CURATION}
    drops: Counter[str] = Counter()
    for m in manifests.values():
        drops.update(m.get("drops") or {})
    return {
        "format": fmt, "style": style, "rounds": used,
        "source_model": _source_model(store, generate),
        "generators": _distinct(m.get("generator") for m in generate),
        "weights_sha256": _distinct((m.get("inputs") or {}).get("weights") for m in generate),
        "policy_versions": sorted({(m.get("config") or {}).get("policy_version", 0) for m in generate}),
        "sampling": _distinct((m.get("config") or {}).get("sampling") for m in generate),
        "rewards": _distinct(m.get("scorer") for m in by_stage["score"]),
        "reward_settings": _distinct((m.get("config") or {}).get("rewards") for m in by_stage["score"]),
        "filter": _distinct(m.get("config") for m in by_stage["filter"]),
        "label": _distinct(m.get("config") for m in by_stage["label"]),
        "pair": _distinct(m.get("config") for m in by_stage["pair"]),
        "drops": dict(sorted(drops.items())),
        "code_versions": _distinct(m.get("code_version") for m in manifests.values()),
        "exported_by": code_version(),
        **({"env": envs} if (envs := _distinct((m.get("config") or {}).get("env") for m in generate)) else {}),
    }


def with_provenance(table: pa.Table, record: dict[str, Any]) -> pa.Table:
    """`table` with `record` in its schema metadata (written into the Parquet footer)."""
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = json.dumps(record, sort_keys=True).encode()
    return table.replace_schema_metadata(metadata)


def foreign_card(folder: str | Path) -> Path | None:
    """`folder`/README.md when it exists and groupforge did not write it (no CARD_MARKER), else None."""
    card = Path(folder) / CARD_FILE
    if card.exists() and CARD_MARKER not in card.read_text(errors="replace"):
        return card
    return None


def write_card(folder: str | Path) -> Path | None:
    """(Re)write `folder`/README.md from the groupforge exports in `folder`; None (and nothing
    written) when a README.md that groupforge did not write is there (`foreign_card`), or when
    the folder holds no groupforge export."""
    folder = Path(folder)
    card = folder / CARD_FILE
    if foreign_card(folder) is not None:
        return None
    exports = []
    for path in sorted(folder.glob("*.parquet")):
        try:
            metadata = pq.read_schema(path).metadata or {}
            if METADATA_KEY in metadata:
                exports.append((path, json.loads(metadata[METADATA_KEY]), pq.read_metadata(path).num_rows))
        except (OSError, pa.ArrowException):  # a folder, or not a Parquet file: not an export
            continue
    if not exports:
        return None
    newest = max(exports, key=lambda e: e[0].stat().st_mtime_ns)[0]
    write_atomic(card, render(exports, default=newest))
    return card


def render(exports: list[tuple[Path, dict[str, Any], int]], default: Path) -> str:
    """The card's text: YAML front matter (configs, dataset_info, tags) and the sections."""
    import yaml
    from datasets import Features

    configs, infos = [], []
    for path, _, rows in exports:
        name = path.stem
        entry = {"config_name": name, "data_files": [{"split": "train", "path": path.name}]}
        configs.append({**entry, "default": True} if path == default else entry)
        features = Features.from_arrow_schema(pq.read_schema(path).remove_metadata())
        meta = pq.read_metadata(path)
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        infos.append({"config_name": name, "features": features._to_yaml_list(),
                      "splits": [{"name": "train", "num_bytes": size, "num_examples": rows}],
                      "download_size": path.stat().st_size, "dataset_size": size})
    formats = sorted({record["format"] for _, record, _ in exports})
    header = {"license": None, "configs": configs, "dataset_info": infos,
              "tags": ["groupforge", "synthetic", *formats]}
    front = yaml.safe_dump(header, sort_keys=False, allow_unicode=True).replace(
        "license: null", "license: null  # fill in the license of the prompts and the model outputs")
    lines = ["---", front.rstrip(), "---", "", CARD_MARKER, "", "# Dataset card", "",
             "Datasets exported by groupforge from one run: responses sampled by a "
             "policy, scored, filtered and labelled by its curation stages. Each file is one configuration "
             "with a single `train` split:", ""]
    lines += [f"- `{path.stem}` ({path.name}): {rows:,} rows, format `{record['format']}`, "
              f"style `{record['style']}`" + (" (default)" if path == default else "")
              for path, record, rows in exports]
    lines += ["", "```python", "from datasets import load_dataset", "",
              f'ds = load_dataset("path/to/this/folder")                 # {default.stem}',
              f'ds = load_dataset("path/to/this/folder", "{exports[0][0].stem}")', "```", ""]
    if any("env" in record for _, record, _ in exports):
        lines += TRAJECTORY_SECTION
    for path, record, _ in exports:
        lines += [f"## Provenance: {path.stem}", "", *_provenance_lines(record), ""]
    return "\n".join(lines)


TRAJECTORY_SECTION = [
    "## Trajectories", "",
    "The responses are multi-turn trajectories: the model called tools and read their results between its "
    "turns. Each response column (`chosen`, `rejected`, `completion`; `messages` holds the prompt too) is a "
    "list of messages in TRL's conversational tool-calling form, each message one JSON object (Parquet "
    "`list<arrow.json>`, the `Json` feature of `datasets` >= 4.7):", "",
    "| message | keys |", "|---|---|",
    "| model turn | `role: \"assistant\"`, `content` (its text, tool-call blocks included), `tool_calls`: "
    "`[{id, type: \"function\", function: {name, arguments}}]` when it called tools |",
    "| tool result | `role: \"tool\"`, `tool_call_id`, `name`, `content` (`error: ...` for a failed call) |",
    "| environment turn | `role: \"user\"`, `content` |", "",
    "The last message is the model's final turn. Only the model's turns were trained on; tool results and "
    "environment turns were context. `tools` holds the JSON schemas of the tools the chat template was "
    "given (pass it to `apply_chat_template(..., tools=...)`; TRL's trainers do). The [env] settings (the "
    "tools, max_turns, max_tokens) are in the provenance below.", ""]
"""The card's section for exports of multi-turn runs."""


def _provenance_lines(record: dict[str, Any]) -> list[str]:
    def value(v: Any) -> str:
        if isinstance(v, list) and not v:
            return "none"
        if isinstance(v, list) and len(v) > 3:  # e.g. a policy per round: first and last
            return f"{len(v)} distinct, from {value([v[0]])} to {value([v[-1]])}"
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        return "`" + (json.dumps(v, sort_keys=True) if not isinstance(v, str) else v) + "`"

    rounds = record["rounds"]
    span = "none" if not rounds else str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
    span += f" ({len(rounds)} round{'s' if len(rounds) != 1 else ''})" if rounds else ""
    rows = [("rounds", f"{span}"), ("source model", value(record["source_model"])),
            ("generator", value(record["generators"])), ("model weights (sha256)", value(record["weights_sha256"])),
            ("policy versions", value(record["policy_versions"])), ("sampling", value(record["sampling"])),
            ("reward functions (name@version#code)", value(record["rewards"])),
            ("reward settings", value(record["reward_settings"])), ("filter", value(record["filter"])),
            ("label", value(record["label"])), ("pair", value(record["pair"])),
            ("rows dropped, by reason", value(record["drops"]) if record["drops"] else "none"),
            ("written by", value(record["code_versions"])), ("exported by", value(record["exported_by"]))]
    if "env" in record:
        rows.insert(6, ("environment ([env])", value(record["env"])))
    return ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _distinct(values) -> list:
    """The distinct non-null values, in first-seen order (JSON-equal values once)."""
    seen, out = set(), []
    for v in values:
        key = json.dumps(v, sort_keys=True)
        if v is not None and key not in seen:
            seen.add(key)
            out.append(v)
    return out


def _source_model(store: RunStore, generate: list[dict]) -> str | None:
    """The model the run sampled from: its spec's [model] path, else the generator's name."""
    spec = store.storage.read_if_exists("spec.toml")
    if spec is not None:
        import tomllib

        try:
            path = tomllib.loads(spec.decode()).get("model", {}).get("path")
        except tomllib.TOMLDecodeError:
            path = None
        if path:
            return str(path)
    names = _distinct((m.get("generator") or "").partition(":")[2].partition("@")[0] or None for m in generate)
    return names[0] if names else None


def push(export: str | Path, repo: str, private: bool = True) -> str:
    """Push one export to the Hugging Face dataset repo `repo` with datasets' own push_to_hub
    (its file as config `<format>-<style>`, split train; private by default), and its
    provenance section as `provenance/<config>.md` (datasets writes the repo's README). Needs
    the network and a token (`hf auth login` or HF_TOKEN); offline, one error that says so."""
    import datasets
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    datasets.disable_progress_bars()
    export = Path(export)
    metadata = pq.read_schema(export).metadata or {}
    record = json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else None
    data = datasets.load_dataset("parquet", data_files={"train": str(export)})
    try:
        data.push_to_hub(repo, config_name=export.stem, private=private)
        if record is not None:
            text = "\n".join([f"# Provenance: {export.stem}", "", *_provenance_lines(record), ""])
            HfApi().upload_file(path_or_fileobj=text.encode(), path_in_repo=f"provenance/{export.stem}.md",
                                repo_id=repo, repo_type="dataset")
    except OfflineModeIsEnabled:
        raise JobError(f"--push-to-hub {repo}: the Hugging Face Hub is in offline mode (HF_HUB_OFFLINE=1); "
                       "unset it, log in (hf auth login or HF_TOKEN) and rerun") from None
    return f"https://huggingface.co/datasets/{repo}"
