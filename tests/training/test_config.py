"""training/config.py: TrainConfig is torch-free, validates without torch, and takes each
loss's paper defaults from training.objectives for the settings it leaves unset."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.helpers import REPO
from training.config import TrainConfig, steps_for_passes


def test_config_is_torch_free():
    code = ("import sys\n"
            "from training.config import TrainConfig\n"
            "TrainConfig(objective='pairwise', length_normalize=True)\n"
            "TrainConfig.model_validate({'objective': 'gspo', 'eps_low': 1e-4, 'save_every': 5})\n"
            "try:\n"
            "    TrainConfig(objective='pairwise', beta=0)\n"
            "except ValueError as exc:\n"
            "    assert 'beta > 0' in str(exc)\n"
            "else:\n"
            "    raise SystemExit('pairwise beta = 0 accepted')\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_pairwise_needs_a_positive_beta_only_when_one_is_given():
    assert TrainConfig(objective="pairwise").beta is None  # the default (0.1) is resolved later
    assert TrainConfig(objective="pairwise", beta=0.5).objective_config().beta == 0.5
    with pytest.raises(ValidationError, match=r"pairwise needs beta > 0"):
        TrainConfig(objective="pairwise", beta=0)
    assert TrainConfig(objective="grpo", beta=0).objective_config().beta == 0.0  # a KL weight may be 0


@pytest.mark.parametrize("objective, eps, beta", [
    ("grpo", (0.2, 0.2), 0.0),
    ("gspo", (3e-4, 4e-4), 0.0),
    ("gspo_token", (3e-4, 4e-4), 0.0),
    ("cispo", (1.0, 3.0), 0.0),
    ("sft", (0.2, 0.2), 0.0),
    ("pairwise", (0.2, 0.2), 0.1),
])
def test_unset_settings_take_the_losses_paper_defaults(objective, eps, beta):
    from training.objectives import loss_defaults

    ocfg = TrainConfig(objective=objective).objective_config(longest_response=7)
    assert (ocfg.eps_low, ocfg.eps_high, ocfg.beta) == eps + (beta,)
    defaults = loss_defaults(objective)
    assert (defaults.eps_low, defaults.eps_high, defaults.beta) == eps + (beta,)
    assert ocfg.norm_len == 7 and ocfg.agg == "seq-mean-token-mean" and ocfg.kl == "k3"


def test_given_settings_win_over_the_defaults():
    cfg = TrainConfig(objective="gspo", eps_low=0.0, eps_high=1e-3, beta=0.02, kl="k1", agg="token-mean",
                      norm_len=64, dual_clip=3.0, gamma=0.5, length_normalize=True)
    ocfg = cfg.objective_config(longest_response=7)
    assert (ocfg.eps_low, ocfg.eps_high, ocfg.beta, ocfg.kl, ocfg.agg, ocfg.norm_len, ocfg.dual_clip) == \
        (0.0, 1e-3, 0.02, "k1", "token-mean", 64, 3.0)
    assert (ocfg.gamma, ocfg.length_normalize) == (0.5, True)


def test_the_field_variants_are_settings():
    """DAPO: clip-higher and token-mean; Dr. GRPO: the constant normaliser; CISPO; the clamped k3."""
    dapo = TrainConfig(objective="grpo", eps_high=0.28, agg="token-mean").objective_config()
    assert (dapo.eps_low, dapo.eps_high, dapo.agg) == (0.2, 0.28, "token-mean")
    dr_grpo = TrainConfig(agg="seq-mean-token-sum-norm", norm_len=4096).objective_config(longest_response=7)
    assert (dr_grpo.agg, dr_grpo.norm_len) == ("seq-mean-token-sum-norm", 4096)
    cispo = TrainConfig(objective="cispo", eps_high=0.28, agg="token-mean", beta=0.01, kl="k3_clamped")
    assert cispo.objective_config().kl == "k3_clamped" and cispo.objective_config().eps_low == 1.0
    assert TrainConfig(objective="cispo", old_logprobs="recompute", rollout_correction="token_truncate")


@pytest.mark.parametrize("settings, match", [
    ({"objective": "cispo", "dual_clip": 3.0}, r"dual_clip = 3.0 does not apply to cispo"),
    ({"kl": "low_var_kl"}, r"kl\n  Input should be 'k1', 'k2', 'k3' or 'k3_clamped'"),
    ({"objective": "dapo"}, r"objective\n  Input should be 'grpo', 'gspo', 'gspo_token', 'cispo', 'pairwise' or 'sft'"),
    ({"objective": "sft", "old_logprobs": "recompute", "rollout_correction": "token_mask"},
     r"rollout_correction applies to grpo, gspo, gspo_token and cispo, not 'sft'"),
])
def test_bad_loss_settings_are_one_clear_error(settings, match):
    with pytest.raises(ValidationError, match=match):
        TrainConfig(**settings)


def test_uses_reference():
    assert not TrainConfig(objective="grpo").uses_reference()
    assert TrainConfig(objective="grpo", beta=0.05).uses_reference()  # the KL term needs ref_logp
    assert not TrainConfig(objective="pairwise").uses_reference()  # beta 0.1 is a temperature, not a KL weight
    assert TrainConfig(objective="pairwise", reference=True).uses_reference()


def test_steps_for_passes():
    assert steps_for_passes(512, 128, 1) == 4 and steps_for_passes(512, 128, 2) == 8
    assert steps_for_passes(500, 128, 1) == 4  # ceil: the last step wraps into the next pass
    assert steps_for_passes(100, 256, 2) == 2  # a step takes at most every row once
    assert steps_for_passes(10, 1, 0.3) == 3  # not 4 from 0.3 * 10 = 3.0000000000000004
    assert steps_for_passes(10, 4, 0.01) == 1 and steps_for_passes(0, 128, 2) == 0
    assert TrainConfig().passes is None and TrainConfig(passes=1.5).passes == 1.5
    with pytest.raises(ValidationError):
        TrainConfig(passes=0)
