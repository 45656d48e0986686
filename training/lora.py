"""LoRA adapters (`[train] lora = {r = 16, alpha = 32, ...}`) with the peft library.

    policy      PeftModel: the base model frozen, LoRA A/B matrices trainable; the optimizer
                holds only those
    reference   the same model with its adapters disabled (`AdaptersOff`): the base model, no
                second copy in memory (pairwise with reference = true, policy losses with beta)
    checkpoint  RUN/checkpoints/step-<k>/ holds the adapter in peft's own format
                (adapter_config.json, adapter_model.safetensors: `PeftModel.from_pretrained`
                loads it onto the base model), the optimizer state and trainer_state.json;
                with `save_merged = true` also merged/, a full model folder
    engine      gets the merged weights (base + B A * alpha / r, HF names) every round, from
                memory or, after a restart, merged from the newest checkpoint's adapter

The base model is the run's start model (trainer_state.json's base_model); a run cannot
switch LoRA on or off half-way (an error says how to start a new run instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from training.config import LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_DIR = "merged"
ADAPTER = "default"


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def wrap(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with fresh LoRA adapters (B = 0: the same outputs as `model` until trained)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load(base: torch.nn.Module, folder: str | Path, trainable: bool) -> torch.nn.Module:
    """The adapter saved in `folder` on `base` (a model loaded from the run's base model)."""
    from peft import PeftModel

    check_adapter_folder(folder)
    return PeftModel.from_pretrained(base, str(folder), is_trainable=trainable)


def check_adapter_folder(folder: str | Path) -> None:
    """A ValueError naming the file unless `folder` holds a readable peft LoRA adapter (its
    config, and its weights whole: header checks, no tensor loaded)."""
    from store.weights import check_safetensors

    folder = Path(folder)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise ValueError(f"checkpoint {folder}: no {name} (a LoRA checkpoint holds the adapter)")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {folder}: {ADAPTER_CONFIG} is not JSON ({exc})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"checkpoint {folder}: {ADAPTER_CONFIG} is a {config.get('peft_type')!r} adapter, not LORA")
    check_safetensors(folder / ADAPTER_WEIGHTS)


def is_peft(model: object) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a LoRA model, W + delta per adapted layer, under the base model's
    own parameter names, copied to the CPU; the model itself is left as it is."""
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    adapted = {name: module for name, module in inner.named_modules() if isinstance(module, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in inner.state_dict().items():
            if ".lora_" in name:
                continue
            out[name.replace(".base_layer.", ".")] = tensor.detach().to("cpu", copy=True)
        for name, module in adapted.items():
            weight = module.base_layer.weight
            delta = module.get_delta_weight(ADAPTER) if ADAPTER in module.lora_A else 0
            out[f"{name}.weight"] = (weight + delta).detach().to("cpu", copy=True)
    return out


def save_merged(model: torch.nn.Module, folder: Path) -> None:
    """A full model folder of the merged weights at `folder` (config from the base model)."""
    from safetensors.torch import save_file

    inner = model.get_base_model()
    folder.mkdir(parents=True)
    inner.config.save_pretrained(folder)
    state = merged_state_dict(model)
    if getattr(inner.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding is the head
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


class AdaptersOff:
    """The reference model of a LoRA policy: its forward with the adapters disabled (the base
    model's log-probs; StepContext.logprobs calls `groupforge_logprobs`)."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def groupforge_logprobs(self, *args, **kwargs) -> torch.Tensor:
        from training.logprobs import token_logprobs

        with self.policy.disable_adapter():
            return token_logprobs(self.policy, *args, **kwargs)
