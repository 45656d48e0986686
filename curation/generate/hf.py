"""The transformers generator (backend "hf"): the model's own forward with a KV cache and a
short decode loop of ours — the fallback where vLLM does not run, the faster engine for tiny
models on CPU, and the reference the vLLM generator is benchmarked against.

Prompts are left-padded into batches. Each prompt is computed once (one prefill), its cache
copied to its G samples, and a sample leaves the batch at its EOS, so a step costs only the
samples still running: next to transformers `generate` (prefill repeated G times, every row
decoded until the longest ends) that is ~3x fewer forward tokens on the toy. A batch samples
under a torch generator seeded from its first prompt's seed (the per-prompt seeds are
recorded, but unlike vLLM a prompt's samples depend on its batch). behavior_logprobs are
log_softmax of the logits after temperature, top-k and top-p: the sampling distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from curation.generate.base import GENERATOR_DEFAULTS, Completion, SamplingConfig, tokenize_prompt
from store.weights import load_state_dict, weights_fingerprint


class HFGenerator:
    """A `Generator` on a transformers AutoModelForCausalLM, sampling in batches of prompts
    (defaults: `GENERATOR_DEFAULTS`)."""

    name = "hf"

    def __init__(
        self,
        model: str | Path,
        dtype: str = GENERATOR_DEFAULTS.dtype,
        device: str | None = None,
        batch_size: int = 64,
        trust_remote_code: bool = False,
        policy_version: int = 0,
        max_model_len: int | None = GENERATOR_DEFAULTS.max_model_len,
    ) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from store.location import local_folder

        self.model_path = local_folder(model)  # an object-store URL: this machine's copy
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        config_len = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = int(max_model_len or config_len)
        self.policy_version = policy_version
        self._version = transformers.__version__
        self.weights_sha256 = weights_fingerprint(self.model_path)
        gen = self.model.generation_config
        self.eos_ids = _as_set(gen.eos_token_id) or _as_set(self.tokenizer.eos_token_id)
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

    @property
    def fingerprint(self) -> str:
        return f"hf-{self._version}:{self.model_path.name}@{self.weights_sha256[:16]}"

    def tokenize(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, messages)

    @torch.no_grad()
    def sample(
        self, prompt_token_ids: Sequence[list[int]], seeds: Sequence[int], cfg: SamplingConfig
    ) -> list[list[Completion]]:
        groups: list[list[Completion]] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            batch = prompt_token_ids[start : start + self.batch_size]
            generator = torch.Generator(self.device).manual_seed(int(seeds[start]) % (2**63))
            rows = self._decode(batch, cfg.group_size, cfg.max_tokens, _Sampler(cfg, generator))
            for b in range(len(batch)):
                group = rows[b * cfg.group_size : (b + 1) * cfg.group_size]
                groups.append([self._completion(tokens, logprobs) for tokens, logprobs in group])
        return groups

    @torch.no_grad()
    def greedy(self, prompt_token_ids: Sequence[list[int]], max_tokens: int) -> list[str]:
        """The greedy response text of each prompt, for evaluation (batched, left padding)."""
        texts: list[str] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            rows = self._decode(prompt_token_ids[start : start + self.batch_size], 1, max_tokens, _argmax)
            texts.extend(self._completion(tokens, logprobs).text for tokens, logprobs in rows)
        return texts

    def _decode(self, batch: Sequence[list[int]], group_size: int, max_tokens: int,
                choose) -> list[tuple[list[int], list[float]]]:
        """(tokens, logprobs) of `group_size` responses to each prompt of `batch`, prompt-major.
        `choose(logits) -> (token, logprob)` picks each step's tokens of the running rows.

        One prefill over the left-padded prompts; the cache is repeated for the group; a row
        stops at EOS or `max_tokens`, and a stopped row leaves the cache (the batch shrinks)."""
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + list(ids) for ids in batch],
                                 device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :]
                >= torch.tensor([width - len(ids) for ids in batch], device=self.device)[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: the prompt starts at position 0
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(group_size)
        logits = out.logits[:, -1].float().repeat_interleave(group_size, 0)
        mask = mask.repeat_interleave(group_size, 0)
        position = positions[:, -1:].repeat_interleave(group_size, 0)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        running = torch.arange(len(batch) * group_size, device=self.device)  # row of each cache entry
        tokens: list[list[int]] = [[] for _ in range(len(running))]
        logprobs: list[list[float]] = [[] for _ in range(len(running))]
        for step in range(max_tokens):
            token, logprob = choose(logits)
            for row, t, lp in zip(running.tolist(), token.tolist(), logprob.tolist()):
                tokens[row].append(t)
                logprobs[row].append(lp)
            going = ~torch.isin(token, eos)
            if step == max_tokens - 1 or not going.any():
                break
            if not going.all():
                keep = going.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                running, token, mask, position = running[keep], token[keep], mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(len(running), 1)], dim=1)
            position = position + 1
            out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
        return list(zip(tokens, logprobs))

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        for t, token in enumerate(tokens):
            if token in self.eos_ids:  # keep the EOS token: the trainer learns to stop
                ids = tokens[: t + 1]
                return Completion(ids, logprobs[: t + 1], self._decode_text(ids), "stop")
        return Completion(tokens, logprobs, self._decode_text(tokens), "length")

    def _decode_text(self, ids: list[int]) -> str:
        """The response text of `ids` (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update_weights(self, weights: "dict | str | Path", policy_version: int) -> None:
        state_dict = load_state_dict(weights) if isinstance(weights, (str, Path)) else weights
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # A tied LM head is the embedding (one tensor): loading the embedding loaded it.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        shared = {name for name in missing if name in params
                  and any(params[name] is params[other] for other in state_dict if other in params)}
        if unexpected or [m for m in missing if "rotary" not in m and m not in shared]:
            raise ValueError(f"update_weights: missing {missing[:5]}, unexpected {unexpected[:5]} parameter names")
        self.policy_version = policy_version
        self.weights_sha256 = weights_fingerprint(weights)

    def close(self) -> None:
        self.model = None


class _Sampler:
    """Draws a token per row from the logits after temperature, top-k and top-p; its logprob is
    under that distribution (what vLLM reports as the sampled token's logprob, and what the
    trainer recomputes at the same temperature)."""

    def __init__(self, cfg: SamplingConfig, generator: torch.Generator) -> None:
        self.temperature, self.top_k, self.top_p = cfg.temperature, cfg.top_k, cfg.top_p
        self.generator = generator

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:  # the smallest set of most likely tokens with mass >= top_p
            probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
            outside = probs.cumsum(-1) - probs >= self.top_p
            logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
        logprobs = logits.log_softmax(-1)
        token = torch.multinomial(logprobs.exp(), 1, generator=self.generator)
        return token.squeeze(1), logprobs.gather(1, token).squeeze(1)


def _argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    token = logits.argmax(-1)
    return token, torch.zeros_like(token, dtype=torch.float)


def _as_set(ids) -> set[int]:
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}
