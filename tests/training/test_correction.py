"""training/correction.py and the losses' rollout correction weights: golden values worked by
hand, the weights are constants, equality with loop implementations, the config's rules."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import loop_agg, loop_clip_pg, loop_seq_ratio, random_batch
from training.config import TrainConfig
from training.correction import CorrectionConfig, correction_weights, mismatch_metrics
from training.objectives import ObjectiveConfig, get_policy_loss

F64 = torch.float64
E = math.e

# Two sequences, the second one token shorter: log r = old - behavior is
#   row 0: 0.5, -1.0, 0.0        row 1: 0.0, 1.0, (padding)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]], dtype=F64)
BEHAVIOR = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.2, -9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
TOKEN_RAW = [E**0.5, E**-1, 1.0, 1.0, E]


def weights(mode, **kw):
    w, metrics = correction_weights(OLD, BEHAVIOR, MASK, CorrectionConfig(mode=mode, **kw))
    return w.flatten().tolist(), {k: float(v) for k, v in metrics.items()}


def flat(rows):
    return [x for row in rows for x in row]


def test_token_truncate_golden():
    w, m = weights("token_truncate", cap=2.0)
    assert w == pytest.approx(flat([[E**0.5, E**-1, 1.0], [1.0, 2.0, 0.0]]))
    assert m["is_weight_mean"] == pytest.approx(sum(TOKEN_RAW) / 5)
    assert m["is_weight_max"] == pytest.approx(E) and m["is_truncated_frac"] == pytest.approx(1 / 5)


def test_token_mask_golden():
    w, m = weights("token_mask", cap=2.0, floor=0.5)  # e^-1 < 0.5 and e > 2 leave the loss
    assert w == pytest.approx(flat([[E**0.5, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert m["is_masked_frac"] == pytest.approx(2 / 5)


def test_sequence_modes_golden():
    w, m = weights("sequence_truncate", cap=2.0)  # geometric means: e^(-1/6), e^(1/2)
    assert w == pytest.approx(flat([[E ** (-1 / 6)] * 3, [E**0.5, E**0.5, 0.0]]))
    assert m["is_weight_mean"] == pytest.approx((E ** (-1 / 6) + E**0.5) / 2)  # each sequence once
    assert m["is_truncated_frac"] == 0
    w, m = weights("sequence_truncate", cap=2.0, sequence="sum")  # products: e^(-1/2), e -> 2
    assert w == pytest.approx(flat([[E**-0.5] * 3, [2.0, 2.0, 0.0]]))
    assert m["is_truncated_frac"] == pytest.approx(1 / 2) and m["is_weight_max"] == pytest.approx(E)
    w, m = weights("sequence_mask", cap=2.0, floor=0.7, sequence="sum")  # e^(-1/2) < 0.7, e > 2
    assert w == [0.0] * 6 and m["is_masked_frac"] == 1
    w, _ = weights("sequence_mask", cap=2.0, floor=0.7)  # both geometric means inside the band
    assert w == pytest.approx(flat([[E ** (-1 / 6)] * 3, [E**0.5, E**0.5, 0.0]]))


def test_mismatch_metrics_golden():
    m = {k: float(v) for k, v in mismatch_metrics(OLD, BEHAVIOR, MASK).items()}
    log_r = [0.5, -1.0, 0.0, 0.0, 1.0]
    assert m["mismatch_kl_k1"] == pytest.approx(-sum(log_r) / 5)
    assert m["mismatch_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / 5)
    assert m["old_behavior_gap"] == pytest.approx(sum(abs(x) for x in log_r) / 5)
    same = mismatch_metrics(OLD, OLD, MASK)
    assert float(same["mismatch_kl_k3"]) == 0 and float(same["old_behavior_gap"]) == 0


def test_grpo_golden_with_weights():
    # logp = old: every ratio is 1, so l_it = -w_it A_i; seq-mean-token-mean over the two rows
    w, _ = correction_weights(OLD, BEHAVIOR, MASK, CorrectionConfig("token_truncate", cap=2.0))
    logp = OLD.clone().requires_grad_()
    loss, _ = get_policy_loss("grpo")(logp, OLD, torch.tensor([1.0, -2.0], dtype=F64), MASK, ObjectiveConfig(),
                                      is_weight=w)
    row0 = -(E**0.5 + E**-1 + 1.0) / 3
    row1 = 2.0 * (1.0 + 2.0) / 2
    assert loss.item() == pytest.approx((row0 + row1) / 2)


def test_the_weights_are_constants():
    logp, old, _, adv, token_adv, mask = random_batch(0)
    w = torch.rand_like(old).requires_grad_()
    for name, a in (("grpo", adv), ("gspo", adv), ("gspo_token", token_adv), ("cispo", token_adv)):
        loss, _ = get_policy_loss(name)(logp, old, a, mask, ObjectiveConfig(), is_weight=w)
        loss.backward()
        assert w.grad is None, name  # no gradient reaches the weights ...
        with_weights = logp.grad.clone()
        logp.grad = None
        plain, _ = get_policy_loss(name)(logp, old, a, mask, ObjectiveConfig(), is_weight=w.detach())
        plain.backward()
        assert torch.equal(logp.grad, with_weights), name  # ... and the policy's is that of constants
        logp.grad = None


def test_ones_change_nothing_and_sft_takes_no_weights():
    logp, old, _, adv, _, mask = random_batch(1)
    for name in ("grpo", "gspo", "gspo_token", "cispo"):
        a = adv
        plain, _ = get_policy_loss(name)(logp, old, a, mask, ObjectiveConfig())
        ones, _ = get_policy_loss(name)(logp, old, a, mask, ObjectiveConfig(), is_weight=torch.ones_like(old))
        assert ones.item() == pytest.approx(plain.item(), abs=1e-12), name
    with pytest.raises(ValueError, match="takes no rollout correction"):
        get_policy_loss("sft")(logp, None, None, mask, ObjectiveConfig(), is_weight=torch.ones_like(old))
    with pytest.raises(ValueError, match="is_weight has shape"):
        get_policy_loss("grpo")(logp, old, adv, mask, ObjectiveConfig(), is_weight=torch.ones(2, 2, dtype=F64))


def loop_weighted(name, L, OLD, A, M, W, cfg):
    B, T = len(L), len(L[0])
    if name == "gspo":
        total = 0.0
        for i in range(B):
            w_i = sum(W[i][t] * M[i][t] for t in range(T)) / sum(M[i])
            total += w_i * loop_clip_pg(loop_seq_ratio(L, OLD, M, i), A[i], cfg)
        return total / B
    pg = []
    for i in range(B):
        s_i = loop_seq_ratio(L, OLD, M, i)
        row = []
        for t in range(T):
            r = math.exp(L[i][t] - OLD[i][t]) if M[i][t] else 1.0
            if name == "cispo":  # -w sg(clip(r)) A logp
                row.append(-W[i][t] * min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * A[i][t] * L[i][t])
            else:
                row.append(W[i][t] * loop_clip_pg(r if name == "grpo" else s_i, A[i][t], cfg))
        pg.append(row)
    return loop_agg(pg, M, "seq-mean-token-mean" if name == "gspo_token" else cfg.agg, cfg.norm_len)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_weighted_losses_match_loops(seed, mode):
    logp, old, _, adv, token_adv, mask = random_batch(seed, noise=0.5)
    behavior = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 10), dtype=F64)
    w, _ = correction_weights(old, behavior, mask, CorrectionConfig(mode, cap=1.5, floor=0.6))
    cfg = ObjectiveConfig(agg="token-mean", eps_high=0.28)
    L, OLD, M, W = (x.tolist() for x in (logp.detach(), old, mask, w))
    for name, a in (("grpo", token_adv), ("gspo", adv), ("gspo_token", token_adv), ("cispo", token_adv)):
        loss, _ = get_policy_loss(name)(logp, old, a, mask, cfg, is_weight=w)
        assert loss.item() == pytest.approx(loop_weighted(name, L, OLD, a.tolist(), M, W, cfg), abs=1e-9), name


def test_train_config_rules():
    TrainConfig(rollout_correction="sequence_mask", old_logprobs="recompute", objective="gspo")
    with pytest.raises(ValueError, match="needs old_logprobs = 'recompute'"):
        TrainConfig(rollout_correction="token_truncate")
    with pytest.raises(ValueError, match="not 'sft'"):
        TrainConfig(rollout_correction="token_truncate", old_logprobs="recompute", objective="sft")
    with pytest.raises(ValueError, match="correction_floor"):
        TrainConfig(rollout_correction="token_mask", old_logprobs="recompute", correction_floor=3.0)
    with pytest.raises(ValueError, match="floor < cap"):
        CorrectionConfig("token_mask", cap=1.0, floor=1.0)
