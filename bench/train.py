"""Benchmark: training throughput (tokens/s, FLOP/s, MFU) of token_logprobs + grpo + AdamW.

    .venv/bin/python bench/train.py            # toy + ~54M random Llama, fp32 and bf16, ~2.5 min on 2 cores
    .venv/bin/python bench/train.py --quick    # smaller steps: a smoke run of about a minute
    .venv/bin/python bench/train.py --compare-logprobs REV   # + the 50M runs with logprobs.py as of git REV

Each (model, dtype, variant) runs in its own process (so its peak RSS, ru_maxrss, is its own)
and does real optimizer steps: policy_batches -> for each micro-batch token_logprobs (chunked
LM head) + grpo loss (objectives, token-mean, step_normalizer) -> backward -> AdamW step. The
first step is a warm-up; the fastest of the timed steps is kept (the machine is shared: short
steps, many of them, and the best one is the least disturbed).

FLOPs (model FLOPs, what the maths needs; recompute and the optimizer not counted):

    6 * P_layers * T  +  6 * V * H * T_resp  +  6 * n_layers * H * sum_seq L^2

P_layers = decoder-layer + final-norm parameters (no input embedding: a lookup, no FLOPs);
the LM head (V x H) counted only on the T_resp response tokens it is applied to (prompt
positions never reach it); the last term is causal attention (QK^T and AV, forward +
backward). The head's backward recompute adds 2 * V * H * T_resp hardware FLOPs on top.
MFU = model FLOP/s / peak, peak = the best timed 2048^3 torch.mm in the same dtype and thread
count over the whole run (each process times it before every step and after the last): on a shared
machine a process's own peak may be measured under load, and dividing by it would flatter.
The 1-minute load average is printed per configuration: compare rows taken at similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

TARGET_MFU = 0.5  # on the ~50M model

MODELS = {
    # name: (LlamaConfig kwargs or None for the toy folder, prompt tokens, response tokens)
    "toy": (None, 8, 8),
    "random-llama": (dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=512,
                          tie_word_embeddings=False), 128, 384),
}


@dataclass
class Result:
    model: str
    dtype: str
    variant: str
    params: int
    params_layers: int
    seqs: int
    micro_batches: int
    tokens: int  # per step, prompt + response (no padding: equal lengths)
    resp_tokens: int
    flops: float  # model FLOPs per step
    step_s: float
    steps_s: list
    process_peak_flops: float  # best torch.mm FLOP/s in this process (around its steps)
    peak_rss_mib: float
    threads: int
    load: float = 0.0  # 1-minute load average when the process ended
    breakdown: dict | None = None
    peak_flops: float = 0.0  # the dtype's best torch.mm FLOP/s over the whole run: the MFU denominator

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops_per_s / self.peak_flops


# ---- one configuration, in its own process ----------------------------------------------------

def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n torch.mm in `dtype` (this process's thread count)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def build_model(name: str, attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kwargs = MODELS[name][0]
    if kwargs is None:
        from pipelines.toy.build import build_toy

        return AutoModelForCausalLM.from_pretrained(build_toy(ROOT / "runs" / "toy", progress=False) / "model",
                                                    dtype=torch.float32, attn_implementation=attn)
    return LlamaForCausalLM(LlamaConfig(**kwargs, attn_implementation=attn))


def synthetic_table(vocab: int, seqs: int, prompt_len: int, response_len: int, seed: int = 0) -> pa.Table:
    """Equal-length rows (no padding, so tokens/s counts only real tokens); behavior log-probs
    near a random model's -log V, so ratios sit around 1; advantages ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    ids = pa.list_(pa.int32())
    return pa.table({
        "prompt_token_ids": pa.array([rng.integers(3, vocab, prompt_len).tolist() for _ in range(seqs)], ids),
        "response_token_ids": pa.array([rng.integers(3, vocab, response_len).tolist() for _ in range(seqs)], ids),
        "behavior_logprobs": pa.array([(-np.log(vocab) + 0.05 * rng.standard_normal(response_len)).astype(np.float32)
                                       .tolist() for _ in range(seqs)], pa.list_(pa.float32())),
        "advantage": rng.standard_normal(seqs),
    })


def model_flops(model, tokens: int, resp_tokens: int, seq_lens: list[int]) -> tuple[float, int]:
    """(model FLOPs per step, P_layers): see the module docstring."""
    config = model.config
    p_layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    head = model.get_output_embeddings().weight.numel()
    attention = (6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
                 * sum(L * L for L in seq_lens))
    return 6 * p_layers * tokens + 6 * head * resp_tokens + attention, p_layers


def profile_breakdown(step) -> dict[str, float]:
    """Self CPU seconds of one step by where they are spent: each op's self time goes to the
    LM head / optimizer when it runs inside them, else to attention, body matmuls, dtype
    casts or other (elementwise, norms, autograd bookkeeping)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out: dict[str, float] = {}
    others: dict[str, float] = {}
    for event in prof.events():
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if any(n.startswith("ChunkedTokenLogProbs") for n in names):
            key = "lm head (chunked, fwd+bwd)"
        elif any(n.startswith("Optimizer.step") for n in names):
            key = "optimizer"
        elif any("scaled_dot_product" in n or "attention" in n.lower() for n in names):
            key = "attention (sdpa)"
        elif event.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_"):
            key = "body matmuls"
        elif event.name in ("aten::copy_", "aten::_to_copy"):
            key = "dtype casts / copies"
        else:
            key = "other"
            others[event.name] = others.get(event.name, 0.0) + event.self_cpu_time_total / 1e6
        out[key] = out.get(key, 0.0) + event.self_cpu_time_total / 1e6
    top = sorted(others.items(), key=lambda kv: -kv[1])[:4]
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["other: top ops"] = ", ".join(f"{name} {t:.2f}s" for name, t in top)
    return out


def logprobs_at(rev: str):
    """training/logprobs.py as of git revision `rev`, imported as its own module (the
    checkout is left alone), to time an earlier version side by side."""
    import importlib.util
    import tempfile

    source = subprocess.run(["git", "show", f"{rev}:training/logprobs.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench-train-") as folder:
        path = Path(folder) / "logprobs_at_rev.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("logprobs_at_rev", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def run_one(spec: dict) -> Result:
    from training.batching import policy_batches, step_normalizer
    from training.objectives import ObjectiveConfig, get_policy_loss

    if spec.get("logprobs_rev"):
        token_logprobs = logprobs_at(spec["logprobs_rev"]).token_logprobs
    else:
        from training.logprobs import token_logprobs

    torch.set_num_threads(spec["threads"])
    bf16 = spec["dtype"] == "bf16"
    peak_dtype = torch.bfloat16 if bf16 else torch.float32
    peaks = [matmul_peak(peak_dtype)]
    model = build_model(spec["model"], spec["attn"])
    _, prompt_len, response_len = MODELS[spec["model"]]
    table = synthetic_table(model.config.vocab_size, spec["seqs"], prompt_len, response_len)
    batches = policy_batches(table, spec["token_budget"])
    norm = step_normalizer(batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=spec["fused_adamw"])
    loss_fn, cfg = get_policy_loss("grpo"), ObjectiveConfig(agg="token-mean")

    def step():
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask,
                                      chunk_tokens=spec["chunk_tokens"])
            loss, _ = loss_fn(logp, batch.old_logp, batch.advantages, batch.target_mask, cfg, norm=norm)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state, allocator, thread pools
    times = []
    for _ in range(spec["steps"]):
        peaks.append(matmul_peak(peak_dtype, repeats=2))
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peaks.append(matmul_peak(peak_dtype))
    breakdown = profile_breakdown(step) if spec["profile"] else None

    tokens = int(sum(b.attention_mask.sum() for b in batches))
    resp_tokens = int(norm.num_tokens)
    seq_lens = [int(n) for b in batches for n in b.attention_mask.sum(1)]
    flops, p_layers = model_flops(model, tokens, resp_tokens, seq_lens)
    return Result(spec["model"], spec["dtype"], spec["variant"], sum(p.numel() for p in model.parameters()), p_layers,
                  spec["seqs"], len(batches), tokens, resp_tokens, flops, min(times), [round(t, 2) for t in times],
                  max(peaks), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, spec["threads"],
                  breakdown=breakdown)


def run_in_subprocess(spec: dict) -> Result:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**data)


# ---- report -------------------------------------------------------------------------------------

def machine() -> str:
    import transformers
    from _machine import cpu_name  # bench/ is on sys.path when a bench runs as a script

    cpu = cpu_name()
    return (f"{os.cpu_count()} CPU cores ({cpu}), shared; python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}")


def markdown(results: list[Result], settings: str, command: str, load: list[float]) -> str:
    when = datetime.now().strftime('%Y-%m-%d %H:%M')
    lines = [f"## train: tokens/s and MFU of token_logprobs + grpo + AdamW — {when}",
             "", f"- machine: {machine()}; 1-minute load average {min(load):.1f}-{max(load):.1f} during the run "
             "(this benchmark included)", f"- command: `{command}`", f"- settings: {settings}", "",
             "| model | params (layers) | dtype | variant | seqs x len | micro-batches | step s | tokens/s "
             "| model GFLOP/s | matmul peak GFLOP/s (run; process) | MFU | peak RSS MiB | load | steps s |",
             "|---|--:|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in results:
        lines.append(f"| {r.model} | {r.params / 1e6:.2f}M ({r.params_layers / 1e6:.2f}M) | {r.dtype} | {r.variant} | "
                     f"{r.seqs} x {r.tokens // r.seqs} | {r.micro_batches} | {r.step_s:.2f} | {r.tokens_per_s:,.0f} | "
                     f"{r.flops_per_s / 1e9:.1f} | {r.peak_flops / 1e9:.0f}; {r.process_peak_flops / 1e9:.0f} | "
                     f"{r.mfu:.0%} | {r.peak_rss_mib:,.0f} | {r.load:.1f} | "
                     f"{', '.join(f'{t:.2f}' for t in r.steps_s)} |")
    lines.append("")
    for r in results:
        if r.model == "random-llama" and r.variant == "tuned":
            verdict = "meets" if r.mfu >= TARGET_MFU else "BELOW"
            lines.append(f"- **{r.model} {r.dtype}: {r.mfu:.0%} MFU, {r.tokens_per_s:,.0f} tokens/s** "
                         f"({verdict} the {TARGET_MFU:.0%} target)")
    for r in results:
        if r.breakdown:
            seconds = {k: v for k, v in r.breakdown.items() if isinstance(v, float)}
            total = sum(seconds.values())
            parts = ", ".join(f"{k} {v:.2f}s ({v / total:.0%})" for k, v in seconds.items())
            lines.append(f"- where one step goes, {r.model} {r.dtype} {r.variant} (profiler self CPU time, "
                         f"{total:.2f}s in all): {parts}; in other: {r.breakdown['other: top ops']}")
    return "\n".join(lines) + "\n"


VARIANTS = {
    # name: overrides of the defaults; "tuned" is the default set
    "tuned": {},
    "baseline": dict(token_budget=1024, fused_adamw=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer steps and sequences: a smoke run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--steps", type=int, help="timed steps after one warm-up (default 6, quick 1)")
    parser.add_argument("--seqs", type=int, help="sequences per optimizer step, 50M model (default 4, quick 2)")
    parser.add_argument("--token-budget", type=int, default=2048, help="padded tokens per micro-batch, 50M model")
    parser.add_argument("--chunk-tokens", type=int, default=2048, help="token_logprobs chunk_tokens")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager)")
    parser.add_argument("--no-fused-adamw", action="store_true", help="AdamW's foreach path instead of fused")
    parser.add_argument("--only", choices=sorted(MODELS), help="one model only")
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline variant of the 50M model")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--compare-logprobs", metavar="REV",
                        help="also time the 50M tuned variant with training/logprobs.py as of git REV")
    parser.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asdict(run_one(json.loads(args.worker)))))
        return

    steps = args.steps or (1 if args.quick else 6)
    seqs = args.seqs or (2 if args.quick else 4)
    base = dict(threads=args.threads, steps=steps, chunk_tokens=args.chunk_tokens, attn=args.attn,
                fused_adamw=not args.no_fused_adamw, profile=False)
    specs = []
    for model in ([args.only] if args.only else list(MODELS)):
        for dtype in ("fp32", "bf16"):
            if model == "toy":  # ~3k sequences of 16 tokens a step, in micro-batches of 4096 tokens
                specs.append(dict(base, model=model, dtype=dtype, variant="tuned", seqs=256 if args.quick else 512,
                                  token_budget=4096))
                continue
            variants = ["tuned"] if args.no_baseline else ["baseline", "tuned"]
            for variant in variants:
                spec = dict(base, model=model, dtype=dtype, variant=variant, seqs=seqs, token_budget=args.token_budget)
                spec.update(VARIANTS[variant])
                spec["profile"] = variant == "tuned" and not args.no_profile
                specs.append(spec)
                if variant == "tuned" and args.compare_logprobs:
                    specs.append(dict(spec, variant=f"tuned, logprobs.py@{args.compare_logprobs}",
                                      logprobs_rev=args.compare_logprobs, profile=False))

    results, load = [], [os.getloadavg()[0]]
    started = time.perf_counter()
    for spec in specs:
        result = run_in_subprocess(spec)
        load.append(os.getloadavg()[0])
        result.load = load[-1]
        print(f"  {result.model} {result.dtype} {result.variant}: {result.step_s:.2f} s/step, "
              f"{result.tokens_per_s:,.0f} tokens/s, {result.flops_per_s / result.process_peak_flops:.0%} of this "
              f"process's matmul peak (load {load[-1]:.1f})", flush=True)
        results.append(result)
    print(f"total {time.perf_counter() - started:.0f} s")
    for result in results:
        result.peak_flops = max(r.process_peak_flops for r in results if r.dtype == result.dtype)

    settings = (f"{args.threads} torch threads; grpo token-mean, AdamW; toy: prompt 8 + response 8 tokens, "
                f"budget 4096; random-llama: {seqs} seqs x (128 prompt + 384 response) a step; tuned = budget "
                f"{args.token_budget} tokens/micro-batch, fused AdamW = {not args.no_fused_adamw}; "
                "baseline = budget 1024, "
                f"foreach AdamW; chunk_tokens {args.chunk_tokens}; attn {args.attn}; bf16 = torch.autocast(bfloat16) "
                f"over fp32 weights; best of {steps} timed step(s) after 1 warm-up")
    command = shlex.join([".venv/bin/python", "bench/train.py", *sys.argv[1:]])
    section = markdown(results, settings, command, load)
    print("\n" + section)
    if not args.no_append:
        path = ROOT / "BENCHMARKS.md"
        with path.open("a") as f:  # append-only: other benches write their own sections
            f.write("\n" + section)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
