"""Benchmark: vLLM vs transformers (HF) sampling throughput, side by side in one run.

    .venv/bin/python bench/generate.py           # full: toy + ~50M random Llama
    .venv/bin/python bench/generate.py --quick   # smoke run, about a minute

For each model, both backends' `.sample()` get the same token-id prompts, seeds and
SamplingConfig (temperature 1.0), after one small warm-up call each; engine start-up (not
`import vllm`) is timed separately. Timed calls alternate between the two live engines and
the fastest of each is kept: the machine may be shared and noisy. HF gets its fairest batch
on CPU, all prompts at once (in trials, a quarter of that was 2-3x slower); `--hf-batch-size`
overrides. The generate stage is also timed on the toy with the live vLLM engine, to show
what tokenizing, Parquet and validation add. Prints a table; appends it to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
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


def bench_model(name: str, model_dir: Path, prompts: list[list[int]], cfg: SamplingConfig,
                hf_batch_size: int, repeats: int, stage_prompts: Path | None = None) -> list[Result]:
    """Both engines live at once; the timed calls alternate (vLLM, HF, then HF, vLLM, ...) so
    both see the same background load on a shared machine. The fastest call of each is kept."""
    from curation.generate.hf import HFGenerator
    from curation.generate.vllm import VLLMGenerator

    makers = {"vllm": lambda: VLLMGenerator(model_dir, dtype="float32"),
              "hf": lambda: HFGenerator(model_dir, dtype="float32", batch_size=hf_batch_size)}
    generators, startup = {}, {}
    for backend, make in makers.items():
        started = time.perf_counter()
        generators[backend] = make()
        startup[backend] = time.perf_counter() - started
        generators[backend].sample(prompts[:2], [0, 1], SamplingConfig(group_size=cfg.group_size, max_tokens=4))

    seeds = [cfg.seed + i for i in range(len(prompts))]
    calls: dict[str, list[float]] = {backend: [] for backend in generators}
    tokens: dict[str, int] = {}
    for r in range(repeats):
        for backend in (["vllm", "hf"] if r % 2 == 0 else ["hf", "vllm"]):
            started = time.perf_counter()
            groups = generators[backend].sample(prompts, seeds, cfg)
            calls[backend].append(time.perf_counter() - started)
            tokens[backend] = sum(len(c.token_ids) for group in groups for c in group)
            print(f"  {name} {backend} call {r + 1}/{repeats}: {calls[backend][-1]:.1f} s", flush=True)

    samples = len(prompts) * cfg.group_size
    notes = {"vllm": "", "hf": f"batch {min(hf_batch_size, len(prompts))} prompts; "}
    results = [Result(name, backend, samples, tokens[backend], min(calls[backend]), startup[backend],
                      notes[backend] + "calls " + ", ".join(f"{s:.1f}" for s in calls[backend]) + " s")
               for backend in generators]
    if stage_prompts is not None:  # the whole stage on the live engine, one chunk like sample()
        from curation.generate.stage import generate

        with tempfile.TemporaryDirectory() as run_dir:
            runs = [generate(run_dir, stage_prompts, cfg, generator=generators["vllm"], force=True,
                             chunk_prompts=len(prompts)) for _ in range(repeats)]
        out = min(runs, key=lambda run: run.seconds)
        results.append(Result(name, "vllm stage", out.samples, out.response_tokens, out.seconds, 0.0,
                              f"generate() on the live engine, best of {repeats}: "
                              f"{out.seconds / results[0].seconds - 1:+.0%} time vs the best sample() "
                              "(tokenize, seeds, Parquet, validate, manifest)"))
    for generator in generators.values():
        generator.close()
    return results


def machine() -> str:
    import transformers
    import vllm
    from _machine import cpu_name  # bench/ is on sys.path when a bench runs as a script

    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {gpu}; python {platform.python_version()}, "
            f"torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")


def ratios(results: list[Result]) -> dict[str, tuple[float, float]]:
    """model -> (vLLM/HF samples/s, vLLM/HF tokens/s)."""
    out = {}
    for model in dict.fromkeys(r.model for r in results):
        by = {r.backend: r for r in results if r.model == model}
        vllm, hf = by["vllm"], by["hf"]
        out[model] = (vllm.samples_per_s / hf.samples_per_s, vllm.tokens_per_s / hf.tokens_per_s)
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
        lines.append("- note: below target on CPU. Neither engine gets GPU-side wins here (CUDA graphs, fused "
                     "kernels, big batches on idle SMs): both run fp32 ops on the same few shared cores, so what "
                     "remains is vLLM's leaner decode step on the random model, while the tiny toy (7-token prompts, "
                     "~4-token answers) is dominated by fixed per-step and per-request costs, where HF's "
                     "single big batch beats vLLM's waves of at most 256 sequences. Call times vary 2-5x "
                     "with the machine's other load: see the calls column. Judge the 5x target on a GPU run.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of about a minute")
    parser.add_argument("--prompts", type=int, help="prompts per model (default: 400 toy / 16 random; quick 64 / 4)")
    parser.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-tokens", type=int, help="random model response tokens (default 32, quick 8; toy: 8)")
    parser.add_argument("--prompt-len", type=int, default=32, help="random model prompt tokens")
    parser.add_argument("--hf-batch-size", type=int, help="HF prompts per batch (default: all prompts in one)")
    parser.add_argument("--repeats", type=int, help="timed calls per backend, best kept (default 3, quick 1)")
    parser.add_argument("--skip-random", action="store_true", help="only the toy model")
    parser.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    toy_n = args.prompts or (64 if args.quick else 400)
    random_n = args.prompts or (4 if args.quick else 16)
    max_tokens = args.max_tokens or (8 if args.quick else 32)

    import vllm  # noqa: F401  (imported here so that engine start-up times exclude it)
    from transformers import AutoTokenizer

    from pipelines.toy.build import build_toy

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        # --- toy: its eval prompts, its natural response length (answer + EOS, cap 8) ---
        toy = build_toy(ROOT / "runs" / "toy")
        table = pq.read_table(toy / "eval.parquet").slice(0, toy_n)
        toy_n = table.num_rows
        stage_prompts = Path(tmp) / "toy-prompts.parquet"
        pq.write_table(table, stage_prompts)
        tokenizer = AutoTokenizer.from_pretrained(toy / "model")
        toy_prompts = [tokenizer(p).input_ids for p in table.column("prompt").to_pylist()]
        toy_cfg = SamplingConfig(group_size=args.group_size, max_tokens=8, temperature=1.0)
        results += bench_model("toy", toy / "model", toy_prompts, toy_cfg, args.hf_batch_size or toy_n,
                               repeats, stage_prompts)

        # --- random ~50M Llama (quick: ~18M): EOS should be ~1/32000 per step, so responses
        # run to max_tokens (the mean tokens column shows it; tokens/s absorbs early stops) ---
        if not args.skip_random:
            random_dir = Path(tmp) / "random-llama"
            size = dict(hidden=256, layers=2, intermediate=512) if args.quick else {}
            params = build_random_llama(random_dir, **size)
            print(f"random Llama: {params / 1e6:.1f}M parameters ({random_dir})")
            rng = np.random.default_rng(0)
            random_prompts = [[1] + rng.integers(4, 32000, args.prompt_len - 1).tolist() for _ in range(random_n)]
            random_cfg = SamplingConfig(group_size=args.group_size, max_tokens=max_tokens, temperature=1.0)
            results += bench_model(f"random-llama-{params / 1e6:.0f}M", random_dir, random_prompts, random_cfg,
                                   args.hf_batch_size or random_n, repeats)

    settings = (f"G={args.group_size}, temperature 1.0, fp32; toy: {toy_n} eval prompts, max_tokens 8; "
                + ("" if args.skip_random else f"random: {random_n} prompts x {args.prompt_len} tokens, "
                   f"max_tokens {max_tokens}; ")
                + f"best of {repeats} timed call(s) per backend, alternating, after 1 warm-up")
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
