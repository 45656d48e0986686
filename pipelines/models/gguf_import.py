"""`groupforge model import-gguf`: a GGUF file (llama.cpp's format) as a standard Hugging Face
model folder, which vLLM, the trainer and `groupforge init` then load like any other:

    OUT/config.json                 the architecture, without the GGUF quantisation config
    OUT/model.safetensors           the weights, dequantised to float32 (or bfloat16)
    OUT/generation_config.json      bos, eos and pad token ids
    OUT/tokenizer.json, tokenizer_config.json, chat_template.jinja

transformers reads the file (`from_pretrained(..., gguf_file=...)`: every tensor dequantised by
the gguf package, or by transformers' own unpacker for the architectures its newer GGUF path
takes). The file is checked first with gguf's GGUFReader, so that one transformers cannot load
fails in one line saying why: not GGUF, truncated, an architecture or a tensor type the loader
lacks. The folder is written beside OUT and renamed into place: OUT is never half-written.

Light: gguf, torch and transformers are imported when a file is read, not with this module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16")
"""What `--dtype` may name: the dtype of the safetensors written."""

# The architecture names the GGUF files of llama.cpp use where transformers' loader has another
# (transformers' load_gguf_checkpoint renames them the same way before it checks its list).
_LOADER_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
                 "t5encoder": "t5"}


@dataclass(frozen=True)
class GGUFFile:
    """What the checks read from a GGUF file's header."""

    path: Path
    size: int
    architecture: str
    """The file's `general.architecture`, as llama.cpp names it ("llama", "qwen2", ...)."""
    tensor_types: dict[str, int]
    """Tensors per ggml type ("Q4_1": 210, "F32": 61, ...)."""

    def describe(self) -> str:
        types = ", ".join(f"{name} {count}" for name, count in self.tensor_types.items())
        return (f"{self.path}: {self.architecture}, {sum(self.tensor_types.values())} tensors ({types}), "
                f"{self.size / 1e6:.0f} MB")


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the GGUF file at `path`, checked: FileNotFoundError if it is missing, a
    ValueError naming the file and the problem if it is not GGUF (magic bytes), truncated or
    damaged, of an architecture transformers' GGUF loader lacks, or holds a tensor type it cannot
    dequantise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")

    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        # a short file is read as short numpy arrays, which fail to view or reshape
        raise ValueError(f"{path}: truncated or damaged GGUF file ({size:,} bytes; its header and tensor table "
                         f"do not read: {exc})") from None
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    architecture = str(field.contents())
    _check_architecture(path, architecture)
    gguf = GGUFFile(path, size, architecture,
                    dict(Counter(t.tensor_type.name for t in reader.tensors).most_common()))
    _check_tensor_types(gguf, reader)
    return gguf


def _check_architecture(path: Path, architecture: str) -> None:
    from transformers import __version__
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the legacy loader's list holds two section names beside the architectures
    known = (set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}) | set(GGUF_ARCHS)
    if architecture not in known and _LOADER_NAMES.get(architecture) not in known:
        raise ValueError(f"{path}: architecture {architecture!r} (general.architecture) is not one transformers "
                         f"{__version__} loads from GGUF ({', '.join(sorted(known))})")


def _check_tensor_types(gguf: GGUFFile, reader) -> None:
    """Every tensor type of the file is one the loader that takes its architecture dequantises."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf import GGUF_ARCHS

    if gguf.architecture in GGUF_ARCHS:  # transformers' newer GGUF path: its own unpacker
        from transformers.integrations.gguf.dequant import GGML_BLOCK

        floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
        loadable = {t for t in GGMLQuantizationType if t in floats or int(t) in GGML_BLOCK}
        loader = "transformers' GGUF unpacker"
    else:  # the legacy loader: gguf.dequantize, tensor by tensor
        loadable = {t for t in GGMLQuantizationType if _gguf_dequantises(t)}
        loader = "the gguf package's dequantiser"
    for tensor in reader.tensors:
        if tensor.tensor_type not in loadable:
            raise ValueError(
                f"{gguf.path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which {loader} "
                f"cannot dequantise (it can: {', '.join(t.name for t in sorted(loadable))})")


def _gguf_dequantises(qtype) -> bool:
    """Whether gguf.dequantize unpacks `qtype`: asked of one block of zeros (gguf lists its
    dequantisers nowhere public)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def import_gguf(file: str | Path, out: str | Path, dtype: str = "float32",
                progress: Callable[[str], None] | None = None) -> Path:
    """Write the GGUF `file` as a Hugging Face model folder `out` (see the module docstring), its
    weights in `dtype` ("float32" or "bfloat16"); `progress` is called with a line before each long
    part. A ValueError (one line) for a bad file or dtype, or an `out` that is a file or a folder
    with something in it."""
    say = progress or (lambda line: None)
    file, out = Path(file), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    _check_out(out)
    gguf = read_gguf(file)
    say(gguf.describe())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-{os.getpid()}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
        from store.errors import disk_write
        from store.weights import check_model_folder

        with disk_write(out):
            _write_model_folder(gguf, tmp, dtype, say)
        check_model_folder(tmp)  # what every command that takes a model folder checks first
        _check_out(out)  # nothing appeared there while this ran
        os.replace(tmp, out)  # (an empty `out` folder is replaced too)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out(out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.exists():
        raise ValueError(f"--out {out}: folder in the way ({'a file' if not out.is_dir() else 'not empty'}); "
                         "remove it or name another folder")


def _write_model_folder(gguf: GGUFFile, folder: Path, dtype: str, say: Callable[[str], None]) -> None:
    """The model folder of `gguf` written into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from training.checkpoint import quiet_transformers

    # gguf_file as a full path: transformers takes an existing file as it is, before looking in
    # the folder or on the Hub
    where = dict(pretrained_model_name_or_path=str(gguf.path.parent), gguf_file=str(gguf.path.resolve()))
    with quiet_transformers():
        say("reading the tokenizer and chat template")
        tokenizer = AutoTokenizer.from_pretrained(**where)
        say("loading the model, every tensor dequantised to float32")
        # dequantize=True: a plain dense model, whose quantisation config transformers removes (without it
        # save_pretrained refuses the model), also where a GGUF matmul kernel is installed
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
        model.to(getattr(torch, dtype))
        n_weights = sum(p.numel() for p in model.parameters())
        say(f"writing model.safetensors: {n_weights / 1e6:.1f}M weights in {dtype}")
        model.save_pretrained(folder)
        max_length = getattr(model.config, "max_position_embeddings", None)
        if max_length:  # the context the model was trained for, not the tokenizer's "no limit"
            tokenizer.model_max_length = max_length
        tokenizer.save_pretrained(folder)
