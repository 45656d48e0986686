"""The trainer's models: the trainable policy, its optimizer, the frozen reference, and what
a call hands back (the weights for the engine, the recomputed old log-probs).

    policy      the newest checkpoint, else the base model; with [train] lora the base model
                with the checkpoint's adapter (or fresh adapters)
    optimizer   AdamW over the trainable parameters, its state restored from the checkpoint
    reference   [train] ref_model, else the base model; a LoRA policy's reference is the
                policy with its adapters disabled (ADAPTERS_OFF), not a second copy
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from store.run_files import TRAIN_CACHE_DIR
from store.storage import Storage
from training import checkpoint as ckpt
from training import lora
from training.batching import policy_batches
from training.config import TrainConfig
from training.step import StepContext

__all__ = ["ADAPTERS_OFF", "cpu_state_dict", "final_weights", "load_policy", "load_reference",
           "reference_source",
           "longest_prompt_tokens", "longest_response_tokens", "optimizer_factory", "with_recomputed_logprobs"]

ADAPTERS_OFF = "<the policy with its LoRA adapters disabled>"
"""TrainSession.reference_from of a LoRA policy's reference (training/lora.py)."""

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(cfg: TrainConfig) -> OptimizerFactory:
    """AdamW with the config's lr, betas and weight decay, for a list of parameters (FSDP2
    builds its sharded optimizer with it too)."""
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)

    return make


def load_policy(latest: Path | None, base_model: str, cfg: TrainConfig, device: torch.device,
                dtype: torch.dtype) -> torch.nn.Module:
    """The trainable policy: the newest checkpoint, else the base model; with [train] lora, the
    base model with the checkpoint's adapter (or fresh adapters)."""
    adapter = latest is not None and lora.is_adapter_folder(latest)
    if cfg.lora is None:
        if adapter:
            raise ValueError(f"checkpoint {latest} holds a LoRA adapter: keep [train] lora set to resume this run")
        return ckpt.load_model(latest or base_model, device, trainable=True, dtype=dtype,
                               trust_remote_code=cfg.trust_remote_code)
    if latest is not None and not adapter:
        raise ValueError(f"checkpoint {latest} is a full model (this run trained without LoRA): to train adapters "
                         f"on it, start a new run with [model] path = \"{latest}\"")
    base = ckpt.load_model(base_model, device, trainable=True, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    if not adapter:
        return lora.wrap(base, cfg.lora)
    policy = lora.load(base, latest, trainable=True)
    saved = policy.peft_config[lora.ADAPTER]
    if (saved.r, float(saved.lora_alpha)) != (cfg.lora.r, float(cfg.lora.alpha)):
        raise ValueError(f"checkpoint {latest}: its adapter has r={saved.r}, alpha={saved.lora_alpha}, but [train] "
                         f"lora asks r={cfg.lora.r}, alpha={cfg.lora.alpha}: keep the run's adapter settings")
    return policy


def reference_source(cfg: TrainConfig, base_model: str, sharded: bool) -> str | None:
    """Where the reference comes from: [train] ref_model, else the base model folder; a LoRA
    policy's own base (ADAPTERS_OFF) when ref_model is unset; None when the objective uses none."""
    if cfg.lora is not None and sharded:
        raise ValueError("[train] lora with strategy fsdp2 is not supported: use single or ddp")
    if not cfg.uses_reference():
        return None
    if cfg.lora is not None and cfg.ref_model is None:
        return ADAPTERS_OFF  # the policy with its adapters disabled: no second copy
    return str(cfg.ref_model or base_model)


def load_reference(reference_from: str | None, policy: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                   dtype: torch.dtype) -> torch.nn.Module | None:
    """The frozen reference named by `reference_from` (a model folder, ADAPTERS_OFF, or None:
    the objective uses none)."""
    if reference_from == ADAPTERS_OFF:
        return lora.AdaptersOff(policy)
    if not reference_from:
        return None
    return ckpt.load_model(reference_from, device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)


def final_weights(policy: torch.nn.Module, optimizer, sharded: bool) -> dict[str, torch.Tensor]:
    """The weights for TrainResult.state_dict: FSDP2's gathered on rank 0 (a collective)."""
    if sharded:
        from training import fsdp

        return fsdp.full_state(policy, optimizer)[0]
    return cpu_state_dict(policy)


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights on the CPU (the live ones keep changing in a session); a
    LoRA policy's merged weights under the base model's names (what an engine loads)."""
    if lora.is_peft(model):
        return lora.merged_state_dict(model)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def with_recomputed_logprobs(storage: Storage, table: pa.Table, segment: dict, start_step: int, ctx: StepContext,
                             token_budget: int, write: bool = True) -> pa.Table:
    """`table` with an old_logprobs column: the log-probs of the policy at the start of this
    segment (behavior_logprobs stay: decoupled mode reads both), 0.0 at the tokens a
    response_mask leaves out. Computed once (the model's tokens only) and cached
    under RUN/_train/ in the run's `storage`, so a resumed run uses the same values rather than
    those of its (already updated) weights."""
    from safetensors.torch import load, save

    cache = f"{TRAIN_CACHE_DIR}/old_logprobs-{segment['fingerprint'][:16]}-step{segment['start_step']}.safetensors"
    saved = storage.read_if_exists(cache)
    if saved is not None:
        flat = load(saved)["logprobs"]
    elif segment["start_step"] != start_step:
        raise ValueError(f"{storage.where(cache)} is missing: the recomputed old log-probs of a segment started "
                         f"at step {segment['start_step']} cannot be rebuilt from step {start_step}'s weights")
    else:
        flat_parts = [None] * table.num_rows
        ctx.policy.eval()
        with torch.no_grad():
            for mb in policy_batches(table, token_budget, pad_id=ctx.pad_id):
                mb = mb.to(ctx.device)
                logp = ctx.logprobs(ctx.policy, mb)
                for i, row in enumerate(mb.rows.tolist()):
                    flat_parts[row] = logp[i][mb.target_mask[i]].float().cpu()
        ctx.policy.train()
        flat = torch.cat(flat_parts)
        if write:  # rank 0 of a ddp run; every rank computed the same values
            storage.write(cache, save({"logprobs": flat.contiguous()}))
    lengths = [len(x) for x in table.column("response_token_ids").to_pylist()]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = flat.numpy()
    if "response_mask" in table.column_names:  # computed at the model's tokens only: 0.0 at the others
        model_tokens = pc.list_flatten(table.column("response_mask")).to_numpy(zero_copy_only=False) == 1
        values = np.zeros(model_tokens.size, dtype=np.float32)
        values[model_tokens] = flat.numpy()
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))
    return table.append_column("old_logprobs", column)


def longest_prompt_tokens(table: pa.Table) -> int:
    """The longest prompt of a samples-like or pairs table, in tokens."""
    return int(pc.max(pc.list_value_length(table.column("prompt_token_ids"))).as_py() or 0)


def longest_response_tokens(table: pa.Table) -> int:
    """The longest response of a samples-like or pairs table, in tokens (at least 1)."""
    columns = ["chosen_token_ids", "rejected_token_ids"] if "chosen_token_ids" in table.column_names \
        else ["response_token_ids"]
    return max(int(pc.max(pc.list_value_length(table.column(c))).as_py() or 1) for c in columns)
