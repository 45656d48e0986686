"""The vLLM generator (backend "vllm"): one in-process vLLM engine kept alive across calls and rounds.

- `SamplingParams(n=G, logprobs=0, seed=prompt_seed)` per prompt: the sampled token's
  log-prob comes back with every token; vLLM gives child i of a group seed + i.
- `logprobs_mode="processed_logprobs"`: log-probs after temperature and top-p/top-k, i.e.
  under the distribution that was actually sampled (the default, raw, ignores temperature).
- On CPU chunked prefill is off: vLLM rewinds the seeded generator of a prefill it splits, which a
  CPU generator cannot do. The scheduler then waits until a whole prompt fits in a step (its
  token budget is then at least max_model_len: vLLM refuses a smaller one).
- An error the engine raises while it samples or loads weights is an `EngineFailure` ("the vllm
  engine failed: <type>: <first line>", the original chained): one line at the CLI, whose log
  file (curation/library_logs.py) gets the traceback; what C++ code prints while the engine
  starts goes to that log too.
- `update_weights` loads new weights into the live engine from a state dict or a folder of
  safetensors, always through vLLM's weights-iterator path (the `weights_path` path leaves a
  tied or separately stored LM head stale), then resets the prefix cache: cached KV blocks
  were computed by the old weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from curation.generate.base import GENERATOR_DEFAULTS, Completion, SamplingConfig, tokenize_prompt
from store.errors import engine_failures
from store.weights import load_state_dict, weights_fingerprint


def _set_cpu_defaults() -> None:
    # In-process engine (~2 s start instead of ~15 s) and a small KV cache on CPU machines.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class VLLMGenerator:
    """A `Generator` on a live vLLM engine for one model (defaults: `GENERATOR_DEFAULTS`;
    `seed` is the engine's, each prompt's group gets its own from `prompt_seed`)."""

    name = "vllm"

    def __init__(
        self,
        model: str | Path,
        dtype: str = GENERATOR_DEFAULTS.dtype,
        max_model_len: int | None = GENERATOR_DEFAULTS.max_model_len,
        seed: int = 0,
        tensor_parallel_size: int = GENERATOR_DEFAULTS.tensor_parallel_size,
        gpu_memory_utilization: float = GENERATOR_DEFAULTS.gpu_memory_utilization,
        trust_remote_code: bool = False,
        policy_version: int = 0,
        enforce_eager: bool = False,
    ) -> None:
        _set_cpu_defaults()
        import vllm  # heavy import: only when this generator is used
        from vllm.platforms import current_platform

        from curation.library_logs import native_output_to_log
        from store.location import local_folder

        self.model_path = local_folder(model)  # an object-store URL: this machine's copy
        kwargs = dict(
            model=str(self.model_path),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=False,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
        )
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if current_platform.is_cpu():  # a split prefill rewinds its seeded generator (set_offset): CPU ones cannot
            kwargs["enable_chunked_prefill"] = False
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enforce_eager"] = enforce_eager  # CUDA graphs are most of vLLM's GPU speed
        self._vllm = vllm
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the rest of the
        # process; put it back so a trainer in the same process can still set its threads.
        set_num_threads = torch.set_num_threads
        try:
            with native_output_to_log():
                self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.policy_version = policy_version
        self._version = vllm.__version__
        self.weights_sha256 = weights_fingerprint(self.model_path)

    @property
    def fingerprint(self) -> str:
        return f"vllm-{self._version}:{self.model_path.name}@{self.weights_sha256[:16]}"

    def tokenize(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, messages)

    def sample(
        self, prompt_token_ids: Sequence[list[int]], seeds: Sequence[int], cfg: SamplingConfig
    ) -> list[list[Completion]]:
        SamplingParams = self._vllm.SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=cfg.group_size,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k if cfg.top_k > 0 else -1,
                max_tokens=cfg.max_tokens,
                logprobs=0,
                seed=int(seed),
            )
            for seed in seeds
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        with engine_failures(self.name):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        groups: list[list[Completion]] = []
        for out in outputs:
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                token_ids = list(o.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, o.logprobs)]
                finish = "stop" if o.finish_reason == "stop" else "length"
                group.append(Completion(token_ids, logprobs, o.text, finish))
            groups.append(group)
        return groups

    def greedy(self, prompt_token_ids: Sequence[list[int]], max_tokens: int) -> list[str]:
        """The greedy (temperature 0) response text of each prompt, for evaluation."""
        from vllm.inputs import TokensPrompt

        params = self._vllm.SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        with engine_failures(self.name):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    def update_weights(self, weights: "dict | str | Path", policy_version: int) -> None:
        state_dict = load_state_dict(weights) if isinstance(weights, (str, Path)) else weights
        items = [(name, tensor.detach().to("cpu")) for name, tensor in state_dict.items()]
        # The in-place reload warns once per rotary embedding, which has no weights to load.
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = reload_log.level
        reload_log.setLevel(logging.ERROR)
        try:
            with engine_failures(self.name):
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            self.llm.collective_rpc(_refresh_tied_head)
        finally:
            reload_log.setLevel(level)
        self.llm.reset_prefix_cache()
        self.policy_version = policy_version
        self.weights_sha256 = weights_fingerprint(weights)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm
            import gc

            gc.collect()


def _refresh_tied_head(worker) -> None:
    """Run on each vLLM worker after an in-place reload. A tied LM head is the embedding tensor,
    which the reload refreshed, but the loader skips lm_head.weight, so the head's
    post-load step never reruns: on CPU it keeps a packed copy of the old weights
    (`cpu_linear`) and samples from the old head. Rerun that step for a tied head."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)
