"""The trainer's configuration: everything `groupforge train` and a spec's [train] section set.

Torch-free, so that reading a spec or building the CLI never loads torch. The loss
settings left unset (None) take the loss's paper defaults, `training.objectives.loss_defaults`,
which live beside the loss; they are resolved into a `training.objectives.ObjectiveConfig`
only when the trainer starts (`objective_config()`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from training.objectives import ObjectiveConfig


def steps_for_passes(num_rows: int, batch_size: int, passes: float) -> int:
    """Optimizer steps that draw `passes` * `num_rows` rows: ceil(passes * rows / b), with b =
    min(batch_size, rows) because a step never takes a row twice (training.schedule.step_rows).
    0 without rows."""
    if num_rows <= 0:
        return 0
    # round(): 0.3 * 10 is 3.0000000000000004 in floating point, which is 3 steps, not 4.
    return max(1, math.ceil(round(passes * num_rows / min(batch_size, num_rows), 9)))


class LoraSettings(BaseModel):
    """LoRA adapters instead of full fine-tuning (training/lora.py, the peft library)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="Rank of each adapter's A (r x in) and B (out x r).")
    alpha: float = Field(32.0, gt=0, description="Scale: the update is B A * alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on each adapter's input.")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names to adapt (e.g. [\"q_proj\", \"v_proj\"]), or \"all-linear\": "
                                  "every linear layer but the LM head.")
    save_merged: bool = Field(False, description="Also write each checkpoint's merged full model to merged/.")


class TrainConfig(BaseModel):
    """Everything `groupforge train` and a spec's [train] section set. CLI flags map 1:1."""

    model_config = ConfigDict(extra="forbid")

    objective: Literal["grpo", "gspo", "gspo_token", "cispo", "pairwise", "sft"] = Field(
        "grpo", description="Loss: grpo, gspo, gspo_token, cispo (policy gradient on groups), pairwise (pairs), sft.")

    # -- data
    rounds: list[int] | None = Field(None, description="Rounds to train on (default: every labelled round).")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop rounds more than this many rounds older than the newest samples.")
    sft_min_reward: float | None = Field(
        None, description="sft: train on samples with reward >= this (default: advantage > 0).")
    batch_size: int = Field(256, ge=1, description="Sequences (pairwise: pairs) per optimizer step.")
    trust_remote_code: bool = Field(False, description="Run the model folder's own Python code (auto_map); in "
                                                       "the round loop it comes from [model] trust_remote_code.")
    passes: float | None = Field(
        None, gt=0, description="Optimizer passes over each new set of training rows (TRL's num_iterations): "
                                "train stops ceil(passes * rows / batch_size) steps after these rows were first "
                                "trained on, or at --steps if sooner; the round loop trains that many steps per "
                                "round. Passes after the first are off-policy and clipped like any stale sample.")
    token_budget: int | None = Field(
        None, ge=1, description="Padded tokens per micro-batch (memory knob; does not change the gradient). Default: "
                                "sized from the model's config and memory_budget (training/sizing.py), the "
                                "derivation printed once.")
    memory_budget: float | None = Field(
        None, gt=0, description="GiB the training process may use (weights, gradients, AdamW, reference, an "
                                "engine in the same process, activations); sizes token_budget and checkpointing. "
                                "Default: 30% of the machine's RAM, or on a GPU 0.9 - gpu_memory_utilization of its "
                                "memory.")
    checkpointing: Literal["auto", "on", "off"] = Field(
        "auto", description="Activation checkpointing (recompute each decoder layer in backward: less memory, ~28% "
                            "slower a token on CPU); auto: on only when memory_budget cannot hold the longest "
                            "sequence, or 1,024 tokens, without it.")
    share_prompts: bool = Field(
        False, description="grpo, gspo, gspo_token, cispo, sft: compute each prompt once for all of its responses in a "
                           "micro-batch (they attend to it through a custom attention mask, at their own "
                           "positions: the same log-probs), and draw each step's rows group by group (whole "
                           "groups of the same prompt, in a seeded order) so that a step holds whole groups. "
                           "Pays when prompts are long next to responses: 2x fewer forward tokens on the toy. "
                           "Packed sequences are capped at 1,024 tokens (the mask is dense).")
    share_prompts_rows: int | None = Field(
        None, ge=1, description="share_prompts: a step draws a group's rows in runs of this many (more prompts a "
                                "step, less sharing); default: the whole group.")
    old_logprobs: Literal["generator", "recompute"] = Field(
        "generator", description="old_logp from samples.behavior_logprobs (bypass mode: the PPO ratio is "
                                 "current/behavior), or recomputed by the trainer when it first trains on a set "
                                 "of rows (decoupled mode: current/old, with rollout_correction's weight "
                                 "old/behavior). See training/correction.py.")
    rollout_correction: Literal["off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "off", description="Decoupled mode's weight w = old/behavior per token, or per sequence (exp of the mean "
                           "or sum of the token log-ratios), truncated at correction_cap (TIS) or masked outside "
                           "[correction_floor, correction_cap] (MIS/IcePop); needs old_logprobs = 'recompute'. "
                           "grpo, gspo, gspo_token, cispo.")
    correction_cap: float = Field(2.0, gt=0, description="Truncate the correction weight here, or mask above it.")
    correction_floor: float = Field(0.0, ge=0, description="Mask modes: mask a correction weight below this.")
    correction_sequence: Literal["mean", "sum"] = Field(
        "mean", description="Sequence modes: w_i = exp(mean) (geometric mean of token ratios) or exp(sum) (their "
                            "product) of the token log-ratios old - behavior.")
    temperature: float | None = Field(
        None, gt=0, description="Temperature of logp/old_logp (default: the rounds' sampling temperature).")
    truncated_logprobs: bool = Field(
        True, description="Compute logp/old_logp under the rounds' sampling top_k/top_p (the distribution the "
                          "engine sampled from and logged behavior_logprobs under); false: the full softmax.")

    # -- objective (training.objectives.ObjectiveConfig)
    eps_low: float | None = Field(
        None, ge=0, description="Lower clip range: the ratio's bound 1 - eps_low (default grpo 0.2, gspo 3e-4, "
                                "cispo 1: no lower bound on its weight).")
    eps_high: float | None = Field(
        None, ge=0, description="Upper clip range: the ratio's bound 1 + eps_high (default grpo 0.2, gspo 4e-4, "
                                "cispo 3; DAPO's clip-higher: 0.28 with eps_low 0.2).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 (off when unset; not cispo).")
    beta: float | None = Field(
        None, ge=0, description="KL weight (policy losses, default 0) or preference temperature (pairwise, 0.1).")
    kl: Literal["k1", "k2", "k3", "k3_clamped"] = Field(
        "k3", description="KL estimator against the reference model, from d = logp - ref_logp: k1 = d, k2 = d^2 / 2, "
                          "k3 = exp(-d) + d - 1, k3_clamped = min(k3, 10) (verl's low_var_kl).")
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "seq-mean-token-mean", description="Token aggregation of grpo/cispo/sft (and of gspo's KL term): "
                                           "token-mean is DAPO's and CISPO's token-level loss, "
                                           "seq-mean-token-sum-norm Dr. GRPO's.")
    norm_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm divides by batch * norm_len (default: the longest "
                                "response in the training rows; Dr. GRPO's constant is the sampling max_tokens).")
    gamma: float = Field(0.0, description="Pairwise margin (SimPO's gamma).")
    length_normalize: bool = Field(False, description="Pairwise: mean instead of sum of token log-probs.")
    reference: bool = Field(
        False, description="Pairwise: use the frozen reference model (DPO). Policy losses use it when beta > 0.")
    ref_model: str | None = Field(None, description="Reference model folder (default: the base model).")

    # -- optimisation
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="After warmup.")
    decay_steps: int | None = Field(
        None, ge=1, description="cosine: the step where lr reaches min_lr_ratio * lr (default: --steps).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr / peak lr.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm (0: off).")
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = Field(
        "auto", description="bfloat16 autocast or float32 (auto: bfloat16 on CUDA, float32 on CPU, where "
                            "bf16 matmuls are not faster); float64 master weights for numerics checks.")
    strategy: Literal["single", "ddp", "fsdp2"] = Field(
        "single", description="single: one process; ddp: every rank of the caller's torch.distributed group "
                              "(torchrun) trains on its share of each step's rows, gradients summed over the "
                              "ranks (training/distributed.py); fsdp2: the same with weights, gradients and "
                              "AdamW state sharded over the ranks (training/fsdp.py). Rank 0 writes.")
    nproc: int = Field(1, ge=1, description="ddp, fsdp2: ranks `groupforge train` starts itself (torchrun "
                                            "--standalone) when it is not already running under torchrun; "
                                            "in the round loop, ranks kept as Ray actors for the whole run.")
    rank_cpus: float = Field(1.0, gt=0, description="Round loop with nproc > 1: CPUs Ray reserves for each "
                                                    "trainer rank (and its torch threads on CPU).")
    rank_gpus: float = Field(0.0, ge=0, description="Round loop with nproc > 1: GPUs Ray reserves for each "
                                                    "trainer rank (1 on a GPU cluster).")
    device: str | None = Field(None, description="torch device (default: cuda when available, else cpu).")
    grad_noise: bool = Field(
        False, description="Measure each step's gradient signal and noise from its micro-batches' gradients "
                           "(training/grad_noise.py): step records gain grad_signal (||E g||^2 per sample, "
                           "unbiased, may be < 0), grad_noise (tr Sigma per sample) and grad_snr (max(signal, 0) / "
                           "(noise / batch)); absent on a step of one micro-batch. Keeps a float64 copy of the "
                           "gradient on the CPU, read after each micro-batch; never changes the weights. "
                           "Micro-batches are packed by length, so noise errs high when gradients depend on "
                           "length. Not with fsdp2.")
    seed: int = Field(0, description="Seeds the order rows are drawn in.")

    lora: LoraSettings | None = Field(
        None, description="Train LoRA adapters, e.g. {r = 16, alpha = 32} (a spec or --config file key; no flag).")

    # -- checkpoints
    save_every: int | None = Field(None, ge=1, description="Checkpoint every N steps (always at the end).")
    keep_last: int = Field(3, ge=0, description="Checkpoints kept (0: all).")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        # Every registered default beta of pairwise is > 0, so only an explicit one can be bad.
        if self.objective == "pairwise" and self.beta is not None and self.beta <= 0:
            raise ValueError("pairwise needs beta > 0: h = beta * (log-ratio difference) would be constant")
        if self.share_prompts and self.objective == "pairwise":
            raise ValueError("share_prompts is for the policy objectives (grpo, gspo, gspo_token, cispo, sft), "
                             "not pairwise")
        if self.objective == "cispo" and self.dual_clip is not None:
            raise ValueError(f"dual_clip = {self.dual_clip} does not apply to cispo: its clipped ratio is a detached "
                             "weight, never a clipped loss (bound the weight with eps_high instead)")
        if self.grad_noise and self.strategy == "fsdp2":
            raise ValueError("grad_noise is not supported with strategy = 'fsdp2' (each micro-batch's gradient is "
                             "reduce-scattered into shards during backward): use strategy 'single' or 'ddp'")
        if self.rollout_correction != "off":
            if self.old_logprobs != "recompute":
                raise ValueError(f"rollout_correction = {self.rollout_correction!r} needs old_logprobs = 'recompute' "
                                 "(decoupled mode: the PPO ratio is current/old and the weight old/behavior); with "
                                 "old_logprobs = 'generator' (bypass) old is behavior and the weight is 1")
            if self.objective not in ("grpo", "gspo", "gspo_token", "cispo"):
                raise ValueError("rollout_correction applies to grpo, gspo, gspo_token and cispo, "
                                 f"not {self.objective!r}")
            if self.correction_floor >= self.correction_cap:
                raise ValueError(f"correction_floor ({self.correction_floor}) must be below correction_cap "
                                 f"({self.correction_cap})")
        return self

    def autocast(self, device_type: str) -> bool:
        """Forward passes under bfloat16 autocast: dtype bfloat16, or auto on CUDA."""
        return self.dtype == "bfloat16" or (self.dtype == "auto" and device_type == "cuda")

    def correction_config(self):
        """The rollout correction settings as a training.correction.CorrectionConfig (loads torch)."""
        from training.correction import CorrectionConfig

        return CorrectionConfig(mode=self.rollout_correction, cap=self.correction_cap,
                                floor=self.correction_floor, sequence=self.correction_sequence)

    def objective_config(self, longest_response: int | None = None) -> ObjectiveConfig:
        """The loss hyperparameters: the settings given here, the loss's paper defaults for
        those left unset; norm_len defaults to `longest_response`."""
        from training.objectives import ObjectiveConfig, loss_defaults

        defaults = loss_defaults(self.objective)
        return ObjectiveConfig(
            eps_low=defaults.eps_low if self.eps_low is None else self.eps_low,
            eps_high=defaults.eps_high if self.eps_high is None else self.eps_high,
            beta=defaults.beta if self.beta is None else self.beta,
            dual_clip=self.dual_clip, kl=self.kl, agg=self.agg, norm_len=self.norm_len or longest_response,
            gamma=self.gamma, length_normalize=self.length_normalize)

    def uses_reference(self) -> bool:
        """Whether the trainer loads the reference model: pairwise when asked (DPO), policy
        losses when their KL weight beta > 0."""
        return self.reference if self.objective == "pairwise" else self.objective_config().beta > 0
