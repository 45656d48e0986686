"""The trainer's configuration: everything `groupforge train` and a spec's [train] section set.

Torch-free, so that reading a spec or building the CLI never loads torch; the loss
hyperparameters are resolved into a `training.objectives.ObjectiveConfig` only when the
trainer starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from training.objectives import ObjectiveConfig

# Paper defaults where the objective has its own (GSPO's clip ranges are ~1000x GRPO's,
# because a sequence ratio is a geometric mean of token ratios).
_DEFAULT_EPS = {"grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "sft": (0.2, 0.2),
                "pairwise": (0.2, 0.2)}
_DEFAULT_BETA = {"pairwise": 0.1}


class TrainConfig(BaseModel):
    """Everything `groupforge train` and a spec's [train] section set. CLI flags map 1:1."""

    model_config = ConfigDict(extra="forbid")

    objective: Literal["grpo", "gspo", "gspo_token", "pairwise", "sft"] = Field(
        "grpo", description="Loss: grpo, gspo, gspo_token (policy gradient on groups), pairwise (pairs), sft.")

    # -- data
    rounds: list[int] | None = Field(None, description="Rounds to train on (default: every labelled round).")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop rounds more than this many rounds older than the newest samples.")
    sft_min_reward: float | None = Field(
        None, description="sft: train on samples with reward >= this (default: advantage > 0).")
    batch_size: int = Field(256, ge=1, description="Sequences (pairwise: pairs) per optimizer step.")
    token_budget: int = Field(16384, ge=1, description="Padded tokens per micro-batch (memory knob; "
                                                        "does not change the gradient).")
    old_logprobs: Literal["generator", "recompute"] = Field(
        "generator", description="old_logp from samples.behavior_logprobs, or recomputed by the trainer "
                                 "when it first trains on a set of rows.")
    temperature: float | None = Field(
        None, gt=0, description="Temperature of logp/old_logp (default: the rounds' sampling temperature).")

    # -- objective (training.objectives.ObjectiveConfig)
    eps_low: float | None = Field(None, ge=0, description="Lower clip range (default grpo 0.2, gspo 3e-4).")
    eps_high: float | None = Field(None, ge=0, description="Upper clip range (default grpo 0.2, gspo 4e-4).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 (off when unset).")
    beta: float | None = Field(
        None, ge=0, description="KL weight (policy losses, default 0) or preference temperature (pairwise, 0.1).")
    kl: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator against the reference model.")
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "seq-mean-token-mean", description="Token aggregation of grpo/sft (and of gspo's KL term).")
    norm_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm divides by batch * norm_len (default: the longest "
                                "response in the training rows; a constant, as Dr. GRPO asks).")
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
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="bfloat16 autocast or float32 (auto: bfloat16 on CUDA, float32 on CPU, where "
                            "bf16 matmuls are not faster).")
    device: str | None = Field(None, description="torch device (default: cuda when available, else cpu).")
    seed: int = Field(0, description="Seeds the order rows are drawn in.")

    # -- checkpoints
    save_every: int | None = Field(None, ge=1, description="Checkpoint every N steps (always at the end).")
    keep_last: int = Field(3, ge=0, description="Checkpoints kept (0: all).")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.objective == "pairwise" and self.resolved_beta() <= 0:
            raise ValueError("pairwise needs beta > 0: h = beta * (log-ratio difference) would be constant")
        return self

    def resolved_beta(self) -> float:
        return self.beta if self.beta is not None else _DEFAULT_BETA.get(self.objective, 0.0)

    def objective_config(self, longest_response: int | None = None) -> ObjectiveConfig:
        from training.objectives import ObjectiveConfig

        eps_low, eps_high = _DEFAULT_EPS[self.objective]
        return ObjectiveConfig(
            eps_low=eps_low if self.eps_low is None else self.eps_low,
            eps_high=eps_high if self.eps_high is None else self.eps_high,
            dual_clip=self.dual_clip, beta=self.resolved_beta(), kl=self.kl, agg=self.agg,
            norm_len=self.norm_len or longest_response, gamma=self.gamma, length_normalize=self.length_normalize)

    def uses_reference(self) -> bool:
        return self.reference if self.objective == "pairwise" else self.resolved_beta() > 0
