"""The toy's model side: a character-level tokenizer, a tiny Llama, decoding and accuracy,
and the supervised warm start (see pipelines/toy/build.py for the task and the cached build).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.toy.families import CHARACTERS
from training.supervised import SeededBatches, supervised_step

if TYPE_CHECKING:
    from pipelines.toy.task import ToyConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


# ---------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------


def make_tokenizer(model_max_length: int, characters: str = CHARACTERS):
    """A character-level tokenizer over `characters` (a task's: `Family.characters`, which start with
    CHARACTERS) after the special tokens: one token per character (a space too), BOS prepended,
    decode() fuses characters without adding spaces. Saved as tokenizer.json (loads as
    `TokenizersBackend`, the transformers 5 name of PreTrainedTokenizerFast)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *characters])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
    )


def make_model(config: ToyConfig, tokenizer):
    """A fresh Llama with untied embeddings; initialised from torch's global RNG."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


# ---------------------------------------------------------------------------------------
# Decoding and accuracy
# ---------------------------------------------------------------------------------------

MAX_NEW_TOKENS = 8  # answers are at most 3 characters + EOS; room to see a non-stopping model


def max_new_tokens(config: ToyConfig | None) -> int:
    """Greedy/eval response length: MAX_NEW_TOKENS for addition; for another task its longest
    response + EOS + 7 tokens of room, within max_position_embeddings."""
    from pipelines.toy.task import longest_prompt, longest_response

    if config is None or config.task == "addition":
        return MAX_NEW_TOKENS
    return min(longest_response(config) + 8, config.max_position_embeddings - longest_prompt(config))


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: list[str],
    *,
    num_samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 512,
    generator_seed: int = 0,
) -> list[list[str]]:
    """Decode `num_samples` responses per prompt with transformers `generate` (greedy when
    temperature == 0). Prompts are batched by token length, so nothing is ever padded."""
    was_training = model.training
    model.eval()
    encoded = [tokenizer(p).input_ids for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    responses: list[list[str]] = [[] for _ in prompts]
    sampling = temperature > 0
    with torch.random.fork_rng(devices=[]):  # sampling leaves the caller's RNG untouched
        torch.manual_seed(generator_seed)
        for length in sorted(by_length):
            for chunk in _chunks(by_length[length], batch_size):
                input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=sampling,
                    temperature=temperature if sampling else None,
                    top_p=None,
                    top_k=None,
                    num_return_sequences=num_samples,
                )
                texts = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
                for j, i in enumerate(chunk):
                    responses[i] = texts[j * num_samples : (j + 1) * num_samples]
    model.train(was_training)
    return responses


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _read_prompts(prompts_parquet: str | Path, limit: int | None) -> tuple[list[str], list[str]]:
    table = pq.read_table(prompts_parquet, columns=["prompt", "reference"])
    if limit is not None:
        table = table.slice(0, limit)
    return table.column("prompt").to_pylist(), table.column("reference").to_pylist()


def _accuracy(responses: list[list[str]], references: list[str], config: ToyConfig | None = None
              ) -> tuple[float, float]:
    """(mean exact match of the first response's answer, fraction with any exact match)."""
    from pipelines.toy.task import ToyConfig, response_answer

    config = config or ToyConfig()
    first = [response_answer(config, r[0]) == ref for r, ref in zip(responses, references)]
    any_ = [any(response_answer(config, x) == ref for x in r) for r, ref in zip(responses, references)]
    return float(np.mean(first)), float(np.mean(any_))


def _load(model_dir: str | Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def greedy_responses(
    model_dir: str | Path, prompts_parquet: str | Path, limit: int | None = None, config: ToyConfig | None = None
) -> tuple[list[str], list[str]]:
    """(greedy response, reference) of the first `limit` rows of a prompt/reference Parquet
    file (transformers, fp32); `config` sets the response length (default: addition's)."""
    model, tokenizer = _load(model_dir)
    prompts, references = _read_prompts(prompts_parquet, limit)
    responses = generate_responses(model, tokenizer, prompts, max_new_tokens=max_new_tokens(config))
    return [r[0] for r in responses], references


def eval_greedy_accuracy(
    model_dir: str | Path, prompts_parquet: str | Path, limit: int | None = None, config: ToyConfig | None = None
) -> float:
    """Exact-match accuracy of the answers of greedy decoding (transformers, fp32) on the first
    `limit` rows of a prompt/reference Parquet file; `config` gives the task (default: addition)."""
    responses, references = greedy_responses(model_dir, prompts_parquet, limit, config)
    return _accuracy([[r] for r in responses], references, config)[0]


def pass_at_k(
    model_dir: str | Path,
    prompts_parquet: str | Path,
    k: int = 8,
    temperature: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
    config: ToyConfig | None = None,
) -> float:
    """Fraction of prompts with at least one exact match among k samples at `temperature`."""
    model, tokenizer = _load(model_dir)
    prompts, references = _read_prompts(prompts_parquet, limit)
    responses = generate_responses(
        model, tokenizer, prompts, num_samples=k, temperature=temperature, generator_seed=seed,
        max_new_tokens=max_new_tokens(config),
    )
    return _accuracy(responses, references, config)[1]


# ---------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------


def _supervised_batch(tokenizer, prompts: list[str], references: list[str]):
    """input_ids (right-padded) and labels that are -100 except on answer + EOS tokens."""
    rows, labels = [], []
    encoded_prompts = tokenizer(prompts).input_ids  # batched: one call, not one per row
    encoded_answers = tokenizer(references, add_special_tokens=False).input_ids
    for prompt_ids, answer_ids in zip(encoded_prompts, encoded_answers):
        ids = prompt_ids + answer_ids + [tokenizer.eos_token_id]
        rows.append(ids)
        labels.append([-100] * len(prompt_ids) + answer_ids + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([ids + [-100] * (width - len(ids)) for ids in labels])
    return input_ids, (input_ids != pad).long(), label_ids


def warm_start(
    model, tokenizer, train: pa.Table, eval_: pa.Table, config: ToyConfig, seed: int, progress: bool
) -> dict:
    """Teacher-forced SFT on response + EOS tokens (train's `reference` column holds the
    supervised responses) until greedy eval accuracy, checked every `eval_every` steps,
    reaches `target_accuracy`. Deterministic given the seed: fixed data
    order, no dropout, fixed thread count (set by the caller)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    input_ids, attention_mask, labels = _supervised_batch(
        tokenizer, train.column("prompt").to_pylist(), train.column("reference").to_pylist()
    )
    eval_prompts = eval_.column("prompt").to_pylist()
    eval_references = eval_.column("reference").to_pylist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, config.warmup_steps))
    )
    batches = SeededBatches(len(input_ids), config.batch_size, seed)
    history: list[dict] = []
    accuracy, step, loss = 0.0, 0, float("nan")

    model.train()
    with Progress(
        TextColumn("[bold]toy warm start"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total}  {task.fields[status]}"),
        TimeElapsedColumn(),
        disable=not progress,
    ) as bar:
        task = bar.add_task("warm", total=config.max_steps, status="")
        while step < config.max_steps:
            rows = batches.next()
            loss = supervised_step(model, optimizer, schedule, input_ids[rows], attention_mask[rows], labels[rows])
            step += 1
            bar.update(task, completed=step)
            if step % config.eval_every and step < config.max_steps:
                continue

            responses = generate_responses(model, tokenizer, eval_prompts, max_new_tokens=max_new_tokens(config))
            accuracy = _accuracy(responses, eval_references, config)[0]
            history.append({"step": step, "loss": round(loss, 4), "eval_accuracy": accuracy})
            bar.update(task, status=f"loss {loss:.3f}  eval acc {accuracy:.3f}")
            if accuracy >= config.target_accuracy:
                break
    return {"steps": step, "final_loss": round(loss, 4), "eval_accuracy": accuracy, "history": history}
