"""What every generator shares: its settings, the `Generator` protocol, prompt loading and seeds.

A generator (`Generator`, started by `curation.generate.stage.make_generator`; its backend is
"vllm" or "hf") turns token-id prompts into G completions each, with one log-prob per
sampled token under the *sampling* distribution (logits / temperature, after top-p/top-k),
so the trainer can use them as `old_logp` directly:

    behavior_logprobs[t] = log softmax(processed_logits_t)[y_t]

Both backends return the EOS token (when the response stopped on it) as the last
response token, with its log-prob: the trainer must learn to stop too.

The settings are written once, here: `SamplingConfig` (how to sample, recorded in the
generate manifest) and `GeneratorConfig` (which backend, dtype, memory, chunking). A spec's
[generator] section (`pipelines.spec.GeneratorSection`) is both but the seed, and the
`groupforge generate` flags are built from these fields.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Protocol, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from curation.generate.prompt_files import JSON_SUFFIXES, read_prompt_table, require_chat_template
from store.schema import SchemaError, validate
from store.storage import StorageError, is_object_url


class SamplingSettings(BaseModel):
    """How responses are sampled, but for the seed (a spec's seed is run.seed)."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, description="G: responses sampled per prompt.")
    max_tokens: int = Field(64, description="Longest response in tokens; longer ones end with finish_reason "
                                            "'length'.")
    temperature: float = Field(1.0, description="Logits are divided by this before sampling and before "
                                                "behavior_logprobs (the trainer uses the same).")
    top_p: float = Field(1.0, description="Nucleus sampling mass (1.0 = off).")
    top_k: int = Field(0, description="Keep the k most likely tokens (0 = off).")

    @field_validator("group_size", "max_tokens")
    @classmethod
    def _positive(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {value}")
        return value

    @field_validator("temperature")
    @classmethod
    def _sampling_temperature(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"temperature must be > 0, got {value} (greedy decoding is not sampling)")
        return value

    @field_validator("top_p")
    @classmethod
    def _nucleus(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"top_k must be >= 0, got {value}")
        return value


class SamplingConfig(SamplingSettings):
    """How responses are sampled, with the seed. Recorded in the generate manifest."""

    model_config = ConfigDict(frozen=True)

    seed: int = Field(0, description="Base seed; each prompt's seed is derived from (seed, round, prompt_id).")

    def as_dict(self) -> dict:
        return self.model_dump()


class GeneratorConfig(BaseModel):
    """Which generator runs and how: what a spec's [generator] section holds besides sampling."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["vllm", "hf", "auto"] = Field(
        "vllm", description="vllm (a live engine kept across rounds), hf (transformers), or auto: vllm on a GPU "
                            "and for models of 5M weights or more, hf for smaller models on CPU.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and activations "
                                                                                    "of the generator.")
    max_model_len: int | None = Field(None, ge=1, description="Context length (default: the model's).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM on CUDA: share of GPU memory for "
                                                                       "the engine (the trainer needs the rest).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism.")
    chunk_prompts: int = Field(256, ge=1, description="Prompts per sampling call; finished chunks survive a kill.")
    engines: int = Field(1, ge=1, description="Engines sampling at once, each a Ray actor kept across rounds "
                                              "(more than 1 needs Ray: the 'ray' extra); prompts are split "
                                              "between them by a hash of their tokens.")
    ray_address: str | None = Field(None, description="Ray cluster to run the engines on: unset starts a private "
                                                      "local one, 'auto' joins the cluster `ray start` runs here, "
                                                      "or a cluster address. Set, it uses Ray even for 1 engine.")
    engine_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each engine (and its torch threads "
                                                      "on CPU).")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each engine (tensor_parallel_size "
                                                      "for a tensor-parallel engine).")

    @property
    def uses_ray(self) -> bool:
        """Engines run as Ray actors (engines > 1, or a ray_address)."""
        return self.engines > 1 or self.ray_address is not None

    def generator_kwargs(self, backend: str | None = None) -> dict:
        """The keyword arguments of the generator class of `backend` (default: this config's;
        pass the one `resolve_backend` picked for "auto") for `make_generator`, with the Ray
        settings when the engines run on Ray."""
        kwargs: dict = {"dtype": self.dtype, "max_model_len": self.max_model_len}
        if (backend or self.backend) == "vllm":
            kwargs.update(gpu_memory_utilization=self.gpu_memory_utilization,
                          tensor_parallel_size=self.tensor_parallel_size)
        if self.uses_ray:
            kwargs.update(engines=self.engines, ray_address=self.ray_address, engine_cpus=self.engine_cpus,
                          engine_gpus=self.engine_gpus)
        return kwargs


GENERATOR_DEFAULTS = GeneratorConfig()
"""The defaults the generators and `generate()` take when not told otherwise."""


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"


class Generator(Protocol):
    """A live generator: a model loaded once and sampled many times (kept across rounds;
    `update_weights` loads a new policy in place). `sample` returns, per prompt,
    `cfg.group_size` completions; `greedy` the greedy response text, for evaluation."""

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
        require_chat_template(tokenizer)
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
    """Read a user's prompt file (Parquet, or JSON Lines with .jsonl), a local path or an
    object-store URL (`curation.generate.prompt_files`), into the prompts table.

    Needs a `prompt` (string) or `messages` (list of {role, content}) column; `reference`
    and `metadata` are optional (metadata may be a JSON string or a struct, stored as JSON
    text). `prompt_id` is computed when absent. Duplicate prompts are kept once.
    """
    remote = is_object_url(path)
    path = str(path) if remote else Path(path)
    where = f"prompts file ({path})"
    if not remote and not path.is_file():
        raise SchemaError(f"{where}: file not found")
    if not remote and path.stat().st_size == 0:
        raise SchemaError(f"{where}: file is empty (0 bytes)")
    json_lines = str(path).lower().endswith(JSON_SUFFIXES)
    try:
        table = read_prompt_table(path)
    except FileNotFoundError:
        raise SchemaError(f"{where}: file not found") from None
    except StorageError as exc:
        raise SchemaError(f"{where}: {str(exc).splitlines()[0]}") from None
    except (pa.ArrowInvalid, OSError) as exc:
        kind = "JSON Lines" if json_lines else "Parquet"
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
    computed = "prompt_id" not in table.column_names
    if computed:  # typed and checked first: the ids are computed from validated columns
        table = table.append_column("prompt_id", pa.array([""] * table.num_rows, pa.string()))
    table = validate(table, "prompts", path)
    if computed:
        ids = [prompt_id_of(p, m) for p, m in zip(table.column("prompt").to_pylist(),
                                                   table.column("messages").to_pylist())]
        table = table.set_column(table.column_names.index("prompt_id"), "prompt_id", pa.array(ids, pa.string()))
    return first_of_each_prompt(table)


def first_of_each_prompt(table: pa.Table) -> pa.Table:
    """The rows of a prompts table whose prompt_id has not come before (a prompt listed twice,
    or in two files, counts once), in table order."""
    first = pc.equal(pc.index_in(table.column("prompt_id"), table.column("prompt_id")),
                     pa.array(range(table.num_rows), pa.int32()))
    return table.filter(first)
