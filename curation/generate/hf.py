"""The transformers generator (backend "hf"): batched `generate` with sampling — the fallback
where vLLM does not run, and the reference the vLLM generator is benchmarked against.

Prompts are left-padded into batches; each batch draws its G samples per prompt with
`num_return_sequences=G` under a torch seed derived from its first prompt's seed (the
per-prompt seeds are recorded, but unlike vLLM a prompt's samples depend on its batch).
`output_scores` are the logits after the temperature/top-p/top-k processors, so
log_softmax of them gives behavior_logprobs under the sampling distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from curation.generate.base import GENERATOR_DEFAULTS, Completion, SamplingConfig, tokenize_prompt
from curation.generate.weights import load_state_dict, weights_fingerprint


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
        scores_budget_bytes: int = 1 << 30,
        trust_remote_code: bool = False,
        policy_version: int = 0,
        max_model_len: int | None = GENERATOR_DEFAULTS.max_model_len,
    ) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.scores_budget_bytes = scores_budget_bytes
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
        from transformers import GenerationConfig

        gen_config = GenerationConfig(
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,  # 0 = off; None would let transformers apply its default top-k of 50
            max_new_tokens=cfg.max_tokens,
            num_return_sequences=cfg.group_size,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # output_scores keeps a (rows, vocab) float tensor per step until the batch ends:
        # cap the batch so those stay within scores_budget_bytes.
        vocab = self.model.config.vocab_size
        per_prompt = cfg.group_size * cfg.max_tokens * vocab * 4
        batch_size = max(1, min(self.batch_size, self.scores_budget_bytes // per_prompt))
        groups: list[list[Completion]] = []
        for start in range(0, len(prompt_token_ids), batch_size):
            batch = [list(ids) for ids in prompt_token_ids[start : start + batch_size]]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in batch], device=self.device)
            attention_mask = torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device
            )
            with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
                torch.manual_seed(int(seeds[start]) % (2**63))
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config
                )
            tokens = out.sequences[:, width:]  # (B*G, T)
            # one step at a time: the (B*G, T, V) tensor of all log-probs can be GBs
            token_logprobs = torch.stack(
                [
                    step.float().log_softmax(-1).gather(-1, tokens[:, t : t + 1]).squeeze(-1)
                    for t, step in enumerate(out.scores)
                ],
                dim=1,
            )
            for b in range(len(batch)):
                group = []
                for g in range(cfg.group_size):
                    row = b * cfg.group_size + g
                    group.append(self._completion(tokens[row].tolist(), token_logprobs[row].tolist()))
                groups.append(group)
        return groups

    @torch.no_grad()
    def greedy(self, prompt_token_ids: Sequence[list[int]], max_tokens: int) -> list[str]:
        """The greedy response text of each prompt, for evaluation (batched, left padding)."""
        texts: list[str] = []
        for start in range(0, len(prompt_token_ids), self.batch_size):
            batch = [list(ids) for ids in prompt_token_ids[start : start + self.batch_size]]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in batch], device=self.device)
            attention_mask = (torch.arange(width, device=self.device)[None, :]
                              >= torch.tensor([width - len(ids) for ids in batch], device=self.device)[:, None]).long()
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                      max_new_tokens=max_tokens, eos_token_id=sorted(self.eos_ids),
                                      pad_token_id=self.pad_id, top_k=None, top_p=None, temperature=None)
            texts.extend(self._completion(row.tolist(), [0.0] * len(row)).text for row in out[:, width:])
        return texts

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        for t, token in enumerate(tokens):
            if token in self.eos_ids:  # keep the EOS token: the trainer learns to stop
                ids = tokens[: t + 1]
                return Completion(ids, logprobs[: t + 1], self.tokenizer.decode(ids, skip_special_tokens=True), "stop")
        return Completion(tokens, logprobs, self.tokenizer.decode(tokens, skip_special_tokens=True), "length")

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


def _as_set(ids) -> set[int]:
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}
