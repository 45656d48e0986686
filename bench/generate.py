"""Benchmark: vLLM vs transformers (HF) sampling throughput, side by side in one run.

    .venv/bin/python bench/generate.py           # full: toy + ~50M random Llama
    .venv/bin/python bench/generate.py --quick   # smoke run, about a minute

For each model, both backends' `.sample()` get the same token-id prompts, seeds and
SamplingConfig (temperature 1.0), after one small warm-up call each; engine start-up is
timed separately. HF gets its fairest batch: the best of "all prompts in one batch" and a
quarter of that (or only `--hf-batch-size`). The generate stage is also timed on the toy
with the live vLLM engine to show what Parquet, tokenizing and validation add. Prints a
table and appends a section to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before any vllm import
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from curation.generate.base import SamplingConfig  # noqa: E402

TARGET = 5.0  # vLLM / HF samples/s we aim for


@dataclass
class Result:
    model: str
    backend: str
    samples: int
    tokens: int
    seconds: float
    startup: float
    detail: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def build_random_llama(folder: Path, vocab: int = 32000, hidden: int = 512, layers: int = 8,
                       intermediate: int = 1024, max_len: int = 512) -> int:
    """A randomly initialised Llama (untied embeddings) + a WordLevel tokenizer of dummy
    tokens, saved so that vLLM and transformers both load it. Returns the parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words = specials + [f"w{i}" for i in range(len(specials), vocab)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", model_max_length=max_len)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         head_dim=64, max_position_embeddings=max_len, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32")
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def time_sample(generator, prompts: list[list[int]], cfg: SamplingConfig, repeats: int) -> tuple[float, int]:
    """Best wall time of `repeats` identical calls, and the response tokens of one call."""
    seeds = [cfg.seed + i for i in range(len(prompts))]
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        groups = generator.sample(prompts, seeds, cfg)
        best = min(best, time.perf_counter() - started)
        tokens = sum(len(c.token_ids) for group in groups for c in group)
    return best, tokens


def bench_model(name: str, model_dir: Path, prompts: list[list[int]], cfg: SamplingConfig,
                hf_batch_sizes: list[int], repeats: int, stage_prompts: Path | None = None) -> list[Result]:
    from curation.generate.hf import HFGenerator
    from curation.generate.vllm import VLLMGenerator

    warmup = (prompts[:2], [0, 1], SamplingConfig(group_size=cfg.group_size, max_tokens=4))
    samples = len(prompts) * cfg.group_size
    results = []

    started = time.perf_counter()
    vllm_gen = VLLMGenerator(model_dir, dtype="float32")
    startup = time.perf_counter() - started
    vllm_gen.sample(*warmup)
    seconds, tokens = time_sample(vllm_gen, prompts, cfg, repeats)
    results.append(Result(name, "vllm", samples, tokens, seconds, startup))
    if stage_prompts is not None:  # the whole stage, same engine, one chunk like the call above
        from curation.generate.stage import generate

        with tempfile.TemporaryDirectory() as run_dir:
            out = generate(run_dir, stage_prompts, cfg, generator=vllm_gen, force=True, chunk_prompts=len(prompts))
        results.append(Result(name, "vllm stage", out.samples, out.response_tokens, out.seconds, 0.0,
                              f"generate() with the live engine: {out.seconds / seconds - 1:+.0%} time vs "
                              "sample() alone (tokenize, seeds, Parquet, validate, manifest)"))
    vllm_gen.close()
    del vllm_gen

    started = time.perf_counter()
    hf_gen = HFGenerator(model_dir, dtype="float32")
    startup = time.perf_counter() - started
    hf_gen.sample(*warmup)
    timings = {}  # one call per candidate batch size, then the remaining repeats on the best
    for batch_size in hf_batch_sizes:
        hf_gen.batch_size = batch_size
        timings[batch_size] = time_sample(hf_gen, prompts, cfg, 1)
    best = min(timings, key=lambda b: timings[b][0])
    tried = ", ".join(f"{b}: {samples / s:.0f}/s" for b, (s, _) in timings.items())
    if repeats > 1:
        hf_gen.batch_size = best
        seconds, tokens = time_sample(hf_gen, prompts, cfg, repeats - 1)
        timings[best] = min(timings[best], (seconds, tokens))
    results.append(Result(name, "hf", samples, timings[best][1], timings[best][0], startup,
                          f"batch {best} prompts (first calls: {tried}); torch threads {torch.get_num_threads()}"))
    hf_gen.close()
    return results


def machine() -> str:
    import transformers
    import vllm

    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {gpu}; python {platform.python_version()}, "
            f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")


def ratios(results: list[Result]) -> dict[str, tuple[float, float]]:
    """model -> (vLLM/HF samples/s, vLLM/HF tokens/s)."""
    out = {}
    for model in dict.fromkeys(r.model for r in results):
        by = {r.backend: r for r in results if r.model == model}
        out[model] = (by["vllm"].samples_per_s / by["hf"].samples_per_s, by["vllm"].tokens_per_s / by["hf"].tokens_per_s)
    return out


def markdown(results: list[Result], settings: str, command: str) -> str:
    lines = [f"## generate: vLLM vs HF — {datetime.now().strftime('%Y-%m-%d %H:%M')}", "",
             f"- machine: {machine()}", f"- command: `{command}`", f"- settings: {settings}", "",
             "| model | backend | samples | samples/s | tokens/s | mean tokens | startup s | notes |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for r in results:
        lines.append(f"| {r.model} | {r.backend} | {r.samples} | {r.samples_per_s:.1f} | {r.tokens_per_s:.0f} | "
                     f"{r.tokens / r.samples:.1f} | {r.startup:.1f} | {r.detail} |")
    lines.append("")
    below = False
    for model, (samples_ratio, tokens_ratio) in ratios(results).items():
        below |= samples_ratio < TARGET
        verdict = "meets" if samples_ratio >= TARGET else "BELOW"
        lines.append(f"- **{model}: vLLM/HF = {samples_ratio:.2f}x samples/s, {tokens_ratio:.2f}x tokens/s** "
                     f"({verdict} the {TARGET:.0f}x target)")
    if below and not torch.cuda.is_available():
        lines.append("- note: below target on CPU, as expected: both backends spend the time in the same fp32 "
                     "matmuls (a 50M model decoding 100+ rows is compute-bound on a few cores), so vLLM's wins "
                     "(paged KV without padding, continuous batching, CUDA graphs, fused GPU kernels) barely "
                     "apply; the toy (7-token prompts, ~4-token answers) is bound by per-step Python overhead "
                     "in both. The 5x target needs a GPU run.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of about a minute")
    parser.add_argument("--prompts", type=int, help="prompts per model (default: 400 toy / 16 random; quick 64 / 4)")
    parser.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-tokens", type=int, help="random model response tokens (default 32, quick 8; toy: 8)")
    parser.add_argument("--prompt-len", type=int, default=32, help="random model prompt tokens")
    parser.add_argument("--hf-batch-size", type=int, help="HF prompts per batch (default: best of all and 1/4)")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement, best kept (default 2, quick 1)")
    parser.add_argument("--skip-random", action="store_true", help="only the toy model")
    parser.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    toy_n = args.prompts or (64 if args.quick else 400)
    random_n = args.prompts or (4 if args.quick else 16)
    max_tokens = args.max_tokens or (8 if args.quick else 32)

    def hf_sizes(n: int) -> list[int]:
        return [args.hf_batch_size] if args.hf_batch_size else sorted({n, max(1, n // 4)}, reverse=True)

    from pipelines.toy import build_toy
    from transformers import AutoTokenizer

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        # --- toy: its eval prompts, its natural response length (answer + EOS, cap 8) ---
        toy = build_toy(ROOT / "runs" / "toy")
        table = pq.read_table(toy / "eval.parquet").slice(0, toy_n)
        stage_prompts = Path(tmp) / "toy-prompts.parquet"
        pq.write_table(table, stage_prompts)
        tokenizer = AutoTokenizer.from_pretrained(toy / "model")
        toy_prompts = [tokenizer(p).input_ids for p in table.column("prompt").to_pylist()]
        toy_cfg = SamplingConfig(group_size=args.group_size, max_tokens=8, temperature=1.0)
        results += bench_model("toy", toy / "model", toy_prompts, toy_cfg, hf_sizes(len(toy_prompts)),
                               repeats, stage_prompts)

        # --- random ~50M Llama (quick: ~17M): EOS is ~1/32000 per step, so responses run to
        # max_tokens on both backends (the mean tokens column shows it) ---
        if not args.skip_random:
            random_dir = Path(tmp) / "random-llama"
            size = dict(hidden=256, layers=2, intermediate=512) if args.quick else {}
            params = build_random_llama(random_dir, **size)
            print(f"random Llama: {params / 1e6:.1f}M parameters ({random_dir})")
            rng = np.random.default_rng(0)
            random_prompts = [[1] + rng.integers(4, 32000, args.prompt_len - 1).tolist() for _ in range(random_n)]
            random_cfg = SamplingConfig(group_size=args.group_size, max_tokens=max_tokens, temperature=1.0)
            results += bench_model(f"random-llama-{params / 1e6:.0f}M", random_dir, random_prompts, random_cfg,
                                   hf_sizes(random_n), repeats)

    settings = (f"G={args.group_size}, temperature 1.0, fp32; toy: {toy_n} eval prompts, max_tokens 8; "
                + ("" if args.skip_random else f"random: {random_n} prompts x {args.prompt_len} tokens, "
                   f"max_tokens {max_tokens}; ") + f"best of {repeats} timed call(s) after 1 warm-up")
    command = shlex.join([".venv/bin/python", "bench/generate.py", *sys.argv[1:]])
    section = markdown(results, settings, command)
    print("\n" + section)
    if not args.no_append:
        path = ROOT / "BENCHMARKS.md"
        header = ("# Benchmarks\n\nEach section below is one run of a `bench/` script: its figures and ratios were "
                  "measured side by side in that run, on the machine it names. Compare ratios, not absolute "
                  "figures, across sections.\n")
        with path.open("a") as f:  # append-only: other benches may write their own sections
            f.write((header if f.tell() == 0 else "") + "\n" + section)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
