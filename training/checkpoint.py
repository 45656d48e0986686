"""Checkpoints: a Hugging Face model folder plus optimizer and trainer state, without pickle.

    RUN/checkpoints/step-<k>/
        config.json, model.safetensors, tokenizer files   an ordinary HF folder (vLLM loads it)
        optimizer/state.safetensors                       every optimizer state tensor (not in the
                                                          folder itself: vLLM loads every *.safetensors there)
        trainer_state.json                                step, config, data cursor, param groups

k is the optimizer step, which is also the `policy_version` of samples generated from it.
A checkpoint is written into `checkpoints/.tmp-step-<k>-<pid>/` of the run's work folder
(store/location.py) and renamed into place, `trainer_state.json` last, so a folder
named step-<k> is always complete; a kill while saving leaves only a `.tmp-*` folder, removed by
the next save. A run on an object store then uploads the folder, `trainer_state.json` last: a
checkpoint counts once its trainer_state.json is in the storage (`checkpoint_steps`).

Optimizer state is stored as tensors (safetensors) and JSON (param groups), so loading a
checkpoint from elsewhere never unpickles anything. The file names are `store.run_files`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file

from store.errors import disk_write
from store.faults import fault_point
from store.location import RunLocation, local_folder
from store.run_files import (
    CHECKPOINTS_DIR,
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    load_best,
    read_json,
    write_json_atomic,
)
from store.storage import fsync_dir

_STEP_DIR = re.compile(r"step-(\d+)")
# Files of a model folder that are not weights: copied so every checkpoint is loadable alone.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No per-file progress bars from transformers while saving and loading models."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


Run = str | Path | RunLocation
"""A run as the checkpoint functions take it: its folder or URL, or its location."""


def checkpoint_rel(step: int) -> str:
    """Checkpoint `step`'s folder, relative to the run."""
    return f"{CHECKPOINTS_DIR}/step-{step}"


def checkpoint_steps(run: Run) -> list[int]:
    """The steps of every complete checkpoint in the run's storage (those with a
    trainer_state.json), oldest first."""
    found = set()
    for entry in RunLocation.of(run).storage.list(CHECKPOINTS_DIR + "/"):
        parts = entry.rel.split("/")
        match = _STEP_DIR.fullmatch(parts[1]) if len(parts) == 3 else None
        if match and parts[2] == TRAINER_STATE_FILE:
            found.add(int(match[1]))
    return sorted(found)


def checkpoint_dir(run: Run, step: int) -> Path:
    """The local folder of checkpoint `step` (for a run on an object store: its copy in this
    machine's cache, downloaded when missing)."""
    return RunLocation.of(run).fetch(checkpoint_rel(step), last=TRAINER_STATE_FILE)


def best_checkpoint(run: Run) -> Path | None:
    """The local folder of the checkpoint RUN/checkpoints/best.json names (`[run] keep_best`;
    None: the run keeps none)."""
    best = load_best(RunLocation.of(run).storage)
    return None if best is None else checkpoint_dir(run, best.policy_version)


def latest_checkpoint(run: Run) -> Path | None:
    """The local folder of the newest complete checkpoint (None: there is none)."""
    steps = checkpoint_steps(run)
    return checkpoint_dir(run, steps[-1]) if steps else None


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An optimizer's state as {"<param index>.<name>": tensor} plus its param groups (JSON-able)."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, state in state_dict["state"].items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"{index}.{name}"] = value.detach().to("cpu").contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
              for group in state_dict["param_groups"]]
    return tensors, groups


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           groups: list[dict]) -> None:
    """Load what `optimizer_to_tensors` produced into `optimizer` (same parameters, same order)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    current = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in current] != [len(g["params"]) for g in groups]:
        raise ValueError("optimizer checkpoint does not match the model: different parameter groups")
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _write_checkpoint_files(tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any], step: int, tokenizer_from: str | Path | None,
                            merged: bool = False) -> None:
    from training import lora

    with quiet_transformers():
        model.save_pretrained(tmp, safe_serialization=True)
    folders = [tmp]
    if merged and lora.is_peft(model):
        lora.save_merged(model, tmp / lora.MERGED_DIR)
        folders.append(tmp / lora.MERGED_DIR)
    if tokenizer_from is not None:
        source_folder = local_folder(tokenizer_from)
        for folder in folders:
            for name in _TOKENIZER_FILES:
                source = source_folder / name
                if source.is_file() and not (folder / name).exists():
                    shutil.copy2(source, folder / name)
    fault_point("checkpoint.weights_written")
    tensors, groups = optimizer_to_tensors(optimizer)
    (tmp / OPTIMIZER_FILE).parent.mkdir()
    save_file(tensors, tmp / OPTIMIZER_FILE)
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir((tmp / OPTIMIZER_FILE).parent)
    fault_point("checkpoint.optimizer_written")
    # Last: a folder with a trainer_state.json is complete (checkpoint_steps relies on it).
    write_json_atomic(tmp / TRAINER_STATE_FILE, {**state, "step": step, "optimizer_param_groups": groups})


def save_checkpoint(run: Run, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], tokenizer_from: str | Path | None = None,
                    keep_last: int | None = None, merged: bool = False) -> Path:
    """Write checkpoint `step` atomically and return its local folder; then keep only the
    newest `keep_last` checkpoints (None: keep all) and the one RUN/checkpoints/best.json
    names. A LoRA model (training/lora.py) saves its adapter in peft's format, and with
    `merged` also merged/, the full model. For a run on an object store the folder is written
    in this machine's cache, then uploaded with trainer_state.json last."""
    location = RunLocation.of(run)
    root = location.work / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = location.work / checkpoint_rel(step)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    try:
        with disk_write(final):
            _write_checkpoint_files(tmp, model, optimizer, state, step, tokenizer_from, merged)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk or a crash: free what it took
        raise
    if final.exists():  # a rerun of the same step (e.g. after a kill between rename and cleanup)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    location.upload(checkpoint_rel(step), last=TRAINER_STATE_FILE)
    if keep_last is not None:
        best = load_best(location.storage)  # `[run] keep_best`: never removed while it is the best
        for old_step in checkpoint_steps(location)[:-keep_last]:
            if old_step != step and (best is None or best.policy_version != old_step):
                location.remove(checkpoint_rel(old_step))
    return final


def load_trainer_state(folder: str | Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint: step, base_model, data (the segment cursor),
    config, temperature, optimizer_param_groups."""
    try:
        state = read_json(Path(folder) / TRAINER_STATE_FILE)
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {folder}: cannot read {TRAINER_STATE_FILE}: {exc}") from None
    if state is None:
        raise ValueError(f"checkpoint {folder}: no {TRAINER_STATE_FILE}")
    return state


def check_checkpoint(folder: str | Path) -> None:
    """A ValueError naming the file unless checkpoint `folder` is whole: trainer_state.json, the
    model folder (config, tokenizer, weights not truncated) and the optimizer state. Header reads
    only; a resumed run calls it before its first round, so a bad checkpoint stops it before it
    writes anything."""
    from store.weights import check_model_folder
    from training import lora

    folder = Path(folder)
    state = load_trainer_state(folder)
    if lora.is_adapter_folder(folder):
        lora.check_adapter_folder(folder)
        if state.get("base_model"):
            check_model_folder(local_folder(state["base_model"]))
    else:
        check_model_folder(folder)
    optimizer_file(folder)


def engine_weights(folder: str | Path) -> Path | dict[str, torch.Tensor]:
    """What an engine loads for checkpoint `folder`: the folder itself, or for a LoRA
    checkpoint its merged/ folder when there is one, else the weights merged from the base
    model (trainer_state.json's base_model) and the adapter."""
    from training import lora

    folder = Path(folder)
    if not lora.is_adapter_folder(folder):
        return folder
    if (folder / lora.MERGED_DIR / "config.json").is_file():
        return folder / lora.MERGED_DIR
    base = load_model(load_trainer_state(folder)["base_model"])
    return lora.merged_state_dict(lora.load(base, folder, trainable=False))


def optimizer_file(folder: str | Path) -> Path:
    """The optimizer state of checkpoint `folder` (in optimizer/, where vLLM does not take it for
    weights), checked whole (a ValueError naming it when it is missing or truncated)."""
    from store.weights import check_safetensors

    folder = Path(folder)
    file = folder / OPTIMIZER_FILE
    if not file.is_file():
        raise ValueError(f"checkpoint {folder}: no {OPTIMIZER_FILE} (the optimizer state); delete the folder to "
                         "resume from the checkpoint before it, or start the run again")
    check_safetensors(file)
    return file


def load_optimizer(optimizer: torch.optim.Optimizer, folder: str | Path) -> None:
    """Restore the optimizer state saved in checkpoint `folder` (safetensors + JSON, no pickle)."""
    state = load_trainer_state(folder)
    tensors = load_file(optimizer_file(folder))
    optimizer_from_tensors(optimizer, tensors, state["optimizer_param_groups"])


def load_model(folder: str | Path, device: torch.device | str = "cpu", trainable: bool = False,
               dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """A causal LM from a safetensors folder (a checkpoint or a base model; an object-store URL
    is read from this machine's copy, `local_folder`; the folder's own code only with
    `trust_remote_code`), fp32 master weights (`dtype`: float64 for numerics checks); frozen
    (eval, no grad) unless `trainable`."""
    from transformers import AutoModelForCausalLM

    from store.weights import check_model_folder

    folder = local_folder(folder)
    check_model_folder(folder, trust_remote_code=trust_remote_code)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)
    model.to(device)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model
