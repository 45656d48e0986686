"""Model weights as generators see them: safetensors folders and state dicts, fingerprinted.

No pickle anywhere: weights come from `*.safetensors` files only.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch



def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder: model*.safetensors (as save_pretrained names them),
    else every *.safetensors file. A training checkpoint's optimizer.safetensors is not weights."""
    files = sorted(folder.glob("model*.safetensors")) or sorted(
        f for f in folder.glob("*.safetensors") if f.name != "optimizer.safetensors")
    if not files:
        raise FileNotFoundError(f"model folder {folder}: no *.safetensors files (pickled weights are not loaded)")
    return files


def count_parameters(path: str | Path) -> int:
    """Number of weights in a model folder (or one file), read from the safetensors headers
    only (an 8-byte length, then a JSON map of tensor name to shape): no tensor is loaded."""
    path = Path(path)
    total = 0
    for file in _safetensors_files(path) if path.is_dir() else [path]:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


def load_state_dict(path: str | Path) -> dict[str, "torch.Tensor"]:
    """All tensors of a safetensors file, or of every *.safetensors file in a folder."""
    from safetensors.torch import load_file

    path = Path(path)
    files = _safetensors_files(path) if path.is_dir() else [path]
    state_dict: dict[str, "torch.Tensor"] = {}
    for file in files:
        state_dict.update(load_file(file))
    return state_dict


def weights_fingerprint(weights: "Mapping[str, torch.Tensor] | str | Path") -> str:
    """sha256 (hex) of a model's weights: its safetensors files (and config.json) for a
    folder, or every tensor's name, dtype, shape and bytes for a state dict."""
    h = hashlib.sha256()
    if isinstance(weights, (str, Path)):
        path = Path(weights)
        files = _safetensors_files(path) if path.is_dir() else [path]
        if path.is_dir() and (path / "config.json").exists():
            files = [path / "config.json"] + files
        for file in files:
            h.update(file.name.encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()
    import torch  # a state dict holds tensors: torch is loaded already

    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()
