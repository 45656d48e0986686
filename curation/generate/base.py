"""What every generator backend shares: sampling settings, prompt loading and seeds.

A backend turns token-id prompts into G completions each, with one log-prob per sampled
token under the *sampling* distribution (logits / temperature, after top-p/top-k), so the
trainer can use them as `old_logp` directly:

    behavior_logprobs[t] = log softmax(processed_logits_t)[y_t]

Both backends return the EOS token (when the response stopped on it) as the last
response token, with its log-prob: the trainer must learn to stop too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from curation.schema import SchemaError, validate


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled. Recorded in the generate manifest."""

    group_size: int = 8
    """G: responses sampled per prompt."""
    max_tokens: int = 64
    """Longest response in tokens; longer ones end with finish_reason = 'length'."""
    temperature: float = 1.0
    """Logits are divided by this before sampling (and before behavior_logprobs)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    seed: int = 0
    """Base seed; each prompt's seed is derived from (seed, round, prompt_id)."""

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (greedy decoding is not sampling)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"


class Generator(Protocol):
    """A live generator. `sample` returns, per prompt, `group_size` completions."""

    name: str
    max_model_len: int
    policy_version: int
    weights_sha256: str

    @property
    def fingerprint(self) -> str: ...

    def tokenize(self, prompt: str | None, messages: list[dict] | None) -> list[int]: ...

    def sample(
        self, prompt_token_ids: Sequence[list[int]], seeds: Sequence[int], cfg: SamplingConfig
    ) -> list[list[Completion]]: ...

    def greedy(self, prompt_token_ids: Sequence[list[int]], max_tokens: int) -> list[str]: ...

    def update_weights(self, weights: "dict | str | Path", policy_version: int) -> None: ...

    def close(self) -> None: ...


def tokenize_prompt(tokenizer, prompt: str | None, messages: list[dict] | None) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS) or of a
    conversation rendered with the tokenizer's chat template, ready for the answer."""
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return list(tokenizer(prompt).input_ids)


def prompt_id_of(prompt: str | None, messages: list[dict] | None) -> str:
    """sha256 (hex) of the canonical prompt: the same text or conversation -> the same id."""
    canonical = (
        json.dumps({"prompt": prompt}, ensure_ascii=False)
        if prompt is not None
        else json.dumps(
            {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]},
            ensure_ascii=False,
            sort_keys=True,
        )
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def prompt_seed(seed: int, round: int, prompt_id: str) -> int:
    """The seed of one prompt's group in one round (fits in int63; vLLM adds 0..G-1)."""
    digest = hashlib.sha256(f"{seed}:{round}:{prompt_id}".encode()).hexdigest()
    return int(digest[:15], 16)


def load_prompts(path: str | Path) -> pa.Table:
    """Read a user's prompt file (Parquet, or JSON Lines with .jsonl) into the prompts table.

    Needs a `prompt` (string) or `messages` (list of {role, content}) column; `reference`
    and `metadata` are optional (metadata may be a JSON string or a struct, stored as JSON
    text). `prompt_id` is computed when absent. Duplicate prompts are kept once.
    """
    path = Path(path)
    where = f"prompts file ({path})"
    if not path.is_file():
        raise SchemaError(f"{where}: file not found")
    if path.stat().st_size == 0:
        raise SchemaError(f"{where}: file is empty (0 bytes)")
    try:
        if path.suffix in {".jsonl", ".json", ".ndjson"}:
            table = pa_json.read_json(path)
        else:
            table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "JSON Lines" if path.suffix in {".jsonl", ".json", ".ndjson"} else "Parquet"
        raise SchemaError(f"{where}: not a readable {kind} file ({str(exc).splitlines()[0]})") from None
    if table.num_rows == 0:
        raise SchemaError(f"{where}: has no rows")
    if "prompt" not in table.column_names and "messages" not in table.column_names:
        raise SchemaError(
            f"{where}: missing column 'prompt' (string) or 'messages' (list of role/content); "
            f"found columns: {', '.join(table.column_names)}"
        )
    if "reference" in table.column_names and not pa.types.is_string(table.column("reference").type):
        if pa.types.is_integer(table.column("reference").type) or pa.types.is_floating(table.column("reference").type):
            table = table.set_column(
                table.column_names.index("reference"), "reference", table.column("reference").cast(pa.string())
            )
    if "metadata" in table.column_names and pa.types.is_struct(table.column("metadata").type):
        as_json = [None if m is None else json.dumps(m, sort_keys=True) for m in table.column("metadata").to_pylist()]
        table = table.set_column(table.column_names.index("metadata"), "metadata", pa.array(as_json, pa.string()))
    if "prompt_id" not in table.column_names:
        n = table.num_rows
        prompts = table.column("prompt").to_pylist() if "prompt" in table.column_names else [None] * n
        messages = table.column("messages").to_pylist() if "messages" in table.column_names else [None] * n
        ids = [None if p is None and m is None else prompt_id_of(p, m) for p, m in zip(prompts, messages)]
        table = table.append_column("prompt_id", pa.array(["" if i is None else i for i in ids], pa.string()))
    table = validate(table, "prompts", path)
    first = pc.equal(pc.index_in(table.column("prompt_id"), table.column("prompt_id")),
                     pa.array(range(table.num_rows), pa.int32()))
    return table.filter(first)
