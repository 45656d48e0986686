"""Model weights on disk, shared by the generate engines and the trainer's checkpoints:
safetensors folders and state dicts, their fingerprints, and the checks of a model folder.

No pickle anywhere: weights come from `*.safetensors` files only.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from store.run_files import read_json

if TYPE_CHECKING:
    import torch



def _safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder: model*.safetensors (as save_pretrained names them),
    else every *.safetensors file (not the optimizer.safetensors of a checkpoint written before it moved)."""
    files = sorted(folder.glob("model*.safetensors")) or sorted(
        f for f in folder.glob("*.safetensors") if f.name != "optimizer.safetensors")
    if not files:
        raise FileNotFoundError(f"model folder {folder}: no *.safetensors files (pickled weights are not loaded)")
    return files


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""One of these makes a folder's tokenizer loadable without conversion libraries."""


def check_safetensors(file: Path) -> None:
    """A ValueError naming `file` unless it is a whole safetensors file: an 8-byte header length,
    that many bytes of JSON, then tensor data up to the largest end offset the header lists. Reads
    the header only (a truncated or corrupt file fails here, not deep inside a loader)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > size - 8:
            raise ValueError(f"weights file {file}: not a safetensors file, or truncated ({size:,} bytes; the header "
                             f"length field says {length if length is not None else 'nothing'})")
        try:
            header = json.loads(f.read(length))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"weights file {file}: corrupt safetensors header ({exc})") from None
    need = 8 + length + max(ends, default=0)
    if need > size:
        raise ValueError(f"weights file {file}: truncated: its tensors end at byte {need:,}, the file has {size:,}")


def check_model_folder(folder: str | Path, trust_remote_code: bool = False) -> None:
    """A clear error (naming the folder, the file and the problem) for a model folder that cannot
    load: missing, no config.json or not JSON, classes that live in the folder's own code
    (`auto_map`, unless `trust_remote_code`), a model_type transformers does not know, no tokenizer
    files, no safetensors weights, or a truncated or corrupt weights file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder}: not found")
    try:
        weights = _safetensors_files(folder)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {folder}: no config.json (not a Hugging Face model folder)")
    try:
        config = read_json(config_file)
    except ValueError as exc:  # not JSON, or not an object; the message names the file
        raise ValueError(f"model folder {folder}: {exc}") from None
    if config.get("auto_map") and not trust_remote_code:
        raise ValueError(f"model folder {folder}: config.json maps its classes to Python code in the folder "
                         f"(auto_map: {', '.join(sorted(config['auto_map']))}); groupforge does not run a model "
                         "folder's code (trust_remote_code is off)")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES and not trust_remote_code:
        raise ValueError(f"model folder {folder}: config.json model_type {model_type!r} is not one this "
                         "transformers knows (a model that needs remote code, or a newer transformers)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"model folder {folder}: no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    for file in weights:
        check_safetensors(file)


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
        check_safetensors(file)  # a truncated file is named here, not deep in the loader
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
        if tensor.numel():
            h.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the bytes in place: no copy
    return h.hexdigest()
