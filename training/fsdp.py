"""FSDP2 for the trainer (`[train] strategy = "fsdp2"`, under torchrun like "ddp"): every
decoder layer and the whole model are `fully_shard`ed over the ranks, so each rank holds
1/N of the weights, gradients and AdamW state.

What differs from ddp (training/distributed.py has the rest: row shards, the step's global
counts, rank 0 writes):

- the log-probs go through `groupforge_logprobs`, a method registered as an FSDP forward
  method: token_logprobs runs the decoder body and reads the LM head's weight itself, which
  FSDP would otherwise not unshard (it only hooks `forward`);
- FSDP sums the gradients (divide factor 1): each rank's loss is already its share of the
  global step loss;
- checkpoints stay plain HF folders: the full model and optimizer state are gathered
  (collective), and rank 0 writes them through an unsharded copy, so any world size resumes;
  a resume loads the plain checkpoint on every rank, then shards it.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

__all__ = ["full_state", "shard", "unsharded"]

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _logprobs(self, input_ids, attention_mask, target_mask, **kwargs):
    from training.logprobs import token_logprobs

    return token_logprobs(self, input_ids, attention_mask, target_mask, **kwargs)


def shard(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, make_optimizer, device: torch.device,
          world: int, resumed: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`policy` fully sharded over `world` ranks, with a new optimizer (`make_optimizer(params)`)
    holding the state of `optimizer` when `resumed` (from a checkpoint)."""
    state = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True)) \
        if resumed else None
    mesh = init_device_mesh(device.type, (world,))
    for layer in policy.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the losses are shares of the global step loss
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    policy.groupforge_logprobs = types.MethodType(_logprobs, policy)
    register_fsdp_forward_method(policy, "groupforge_logprobs")
    sharded = make_optimizer(policy.parameters())
    if state is not None:
        set_optimizer_state_dict(policy, sharded, state, options=StateDictOptions(full_state_dict=True))
    return policy, sharded


def full_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state dicts on the CPU (collective: every rank calls it;
    rank 0 gets them, the others empty dicts)."""
    return get_model_state_dict(policy, options=FULL), get_optimizer_state_dict(policy, optimizer, options=FULL)


def unsharded(policy: torch.nn.Module, model_state: dict, optimizer_state: dict, make_optimizer,
              dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain copy of the sharded `policy` and its optimizer from full state dicts (rank 0,
    to write a checkpoint)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(policy.config).to(dtype)
    plain.load_state_dict(model_state)
    optimizer = make_optimizer(plain.parameters())
    set_optimizer_state_dict(plain, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
    return plain, optimizer
