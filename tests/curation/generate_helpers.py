"""What the generate tests share: the toy's prompts, a live vLLM generator, and log-probs from a
plain transformers fp32 forward to check behavior_logprobs against.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from curation.generate.base import SamplingConfig

SAMPLING = SamplingConfig(group_size=4, max_tokens=8, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def prompts_file(toy_dir: Path, tmp_path_factory) -> Path:
    """24 eval prompts of the toy, with their references."""
    table = pq.read_table(toy_dir / "eval.parquet").slice(0, 24)
    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def vllm_generator(toy_dir: Path):
    from curation.generate.vllm import VLLMGenerator

    generator = VLLMGenerator(toy_dir / "model", dtype="float32")
    yield generator
    generator.close()


def transformers_logprobs(model, samples: pa.Table, temperature: float = 1.0) -> list[list[float]]:
    """log p(response token | prefix) from one plain fp32 forward per sample."""
    out = []
    with torch.no_grad():
        for prompt_ids, response_ids in zip(
            samples.column("prompt_token_ids").to_pylist(), samples.column("response_token_ids").to_pylist()
        ):
            ids = torch.tensor([prompt_ids + response_ids])
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
            out.append(logp.tolist())
    return out


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a = [x for row in a for x in row]
    flat_b = [x for row in b for x in row]
    assert len(flat_a) == len(flat_b) > 0
    return sum(abs(x - y) for x, y in zip(flat_a, flat_b)) / len(flat_a)


def load_fp32(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_samples_table(samples: pa.Table, n_prompts: int, group_size: int) -> None:
    assert samples.num_rows == n_prompts * group_size
    for ids, logprobs, reason in zip(
        samples.column("response_token_ids").to_pylist(),
        samples.column("behavior_logprobs").to_pylist(),
        samples.column("finish_reason").to_pylist(),
    ):
        assert len(ids) == len(logprobs) >= 1
        assert all(lp <= 0.0 for lp in logprobs)
        assert reason in {"stop", "length"}
    keys = samples.select(["prompt_id", "sample_idx"]).to_pylist()
    assert len({(k["prompt_id"], k["sample_idx"]) for k in keys}) == samples.num_rows


def perturbed_model(toy_dir: Path, out: Path, scale: float = 0.05, seed: int = 3) -> Path:
    """A copy of the toy model with every weight moved, the LM head included."""
    import shutil

    shutil.copytree(toy_dir / "model", out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    new = {k: (v + scale * v.std() * torch.randn(v.shape, generator=gen)).contiguous() for k, v in state.items()}
    head = state["lm_head.weight"]
    new["lm_head.weight"] = (head * 1.5 + 0.1 * torch.randn(head.shape, generator=gen)).contiguous()
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    return out
