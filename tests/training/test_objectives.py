"""training/objectives.py and training/cispo_loss.py: golden values worked by hand, equality
with loop implementations of the papers' formulas (GRPO, GSPO, CISPO, DAPO's and Dr. GRPO's
objectives), GSPO/GSPO-token, CISPO/GRPO and on-policy invariances, micro-batch split
invariance, and the errors bad inputs get."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import loop_agg, loop_clip_pg, loop_seq_ratio, random_batch
from training.objectives import (
    LOSS_DEFAULTS,
    PAIR_LOSSES,
    POLICY_LOSSES,
    LossDefaults,
    Normalizer,
    ObjectiveConfig,
    agg_loss,
    get_pair_loss,
    get_policy_loss,
    kl_penalty,
    loss_defaults,
)

F64 = torch.float64
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# B=2, T=3; the second response has 2 tokens, its third position is padding.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def log_ratios(ratios):
    """logp, old_logp (old = -1) whose exp(logp - old_logp) are `ratios`."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=F64)
    logp = (old + torch.log(t(ratios))).requires_grad_()
    return logp, old


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel, abs=1e-12)


def bce(h: float, p: float) -> float:
    """-p log sig(h) - (1-p) log sig(-h), with log sig(x) = -log(1 + e^-x)."""
    return p * math.log1p(math.exp(-h)) + (1 - p) * math.log1p(math.exp(h))


# ---- golden values, by hand ---------------------------------------------------------------

def test_agg_loss_golden():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # the 6 is padding
    # masked sum 1+2+3+4+5 = 15 over 5 tokens; row means 6/3 = 2 and 9/2 = 4.5
    assert agg_loss(values, MASK, "token-mean").item() == approx(15 / 5)
    assert agg_loss(values, MASK, "seq-mean-token-mean").item() == approx((2 + 4.5) / 2)
    assert agg_loss(values, MASK, "seq-mean-token-sum-norm").item() == approx(15 / (2 * 3))
    assert agg_loss(values, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == approx(15 / 8)
    # A step of 4 sequences / 10 tokens: this batch is its share.
    step = Normalizer(num_seqs=4, num_tokens=10)
    assert agg_loss(values, MASK, "token-mean", norm=step).item() == approx(15 / 10)
    assert agg_loss(values, MASK, "seq-mean-token-mean", norm=step).item() == approx(6.5 / 4)
    assert agg_loss(values, MASK, "seq-mean-token-sum-norm", 3, step).item() == approx(15 / 12)


# Ratios for grpo: row 0 has A = +1, row 1 has A = -1 (its 2.0 is padding); eps = 0.2.
RATIOS = [[1.5, 1.1, 0.5], [0.5, 3.0, 2.0]]
ADV = t([1.0, -1.0])


def test_grpo_golden_clipping_both_ways():
    logp, old = log_ratios(RATIOS)
    cfg = ObjectiveConfig(agg="token-mean")
    loss, m = get_policy_loss("grpo")(logp, old, ADV, MASK, cfg)
    # l = -min(rA, clip(r, .8, 1.2)A):
    #   A=+1: r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped high); 1.1 -> -1.1; 0.5 -> -min(.5, .8) = -0.5
    #   A=-1: r=0.5 -> -min(-.5, -.8) = 0.8 (clipped low);   3.0 -> -min(-3, -1.2) = 3.0
    row0, row1 = [-1.2, -1.1, -0.5], [0.8, 3.0]
    assert loss.item() == approx((sum(row0) + sum(row1)) / 5)
    assert m["pg_loss"] == approx((sum(row0) + sum(row1)) / 5)
    assert m["clip_frac_high"] == approx(1 / 5) and m["clip_frac_low"] == approx(1 / 5)
    assert m["ratio_mean"] == approx((1.5 + 1.1 + 0.5 + 0.5 + 3.0) / 5)
    assert (m["ratio_min"], m["ratio_max"]) == (approx(0.5), approx(3.0))
    # approx_kl = mean of 0.5 log(r)^2 over the 5 tokens
    logs = [math.log(r) for r in (1.5, 1.1, 0.5, 0.5, 3.0)]
    assert m["approx_kl"] == approx(sum(0.5 * x * x for x in logs) / 5)
    assert "kl" not in m and "dual_clip_frac" not in m
    # d l/d logp = -A r where unclipped, 0 where clipped (and on padding); / 5 tokens
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, t([[0.0, -1.1 / 5, -0.5 / 5], [0.0, 3.0 / 5, 0.0]]))

    seq_loss, _ = get_policy_loss("grpo")(logp, old, ADV, MASK, ObjectiveConfig())
    assert seq_loss.item() == approx((sum(row0) / 3 + sum(row1) / 2) / 2)


def test_grpo_golden_dual_clip():
    logp, old = log_ratios(RATIOS)
    cfg = ObjectiveConfig(agg="token-mean", dual_clip=2.0)
    loss, m = get_policy_loss("grpo")(logp, old, ADV, MASK, cfg)
    # A=-1, r=3.0: l = 3.0 is capped at -c A = 2.0; nothing else changes.
    assert loss.item() == approx((-1.2 - 1.1 - 0.5 + 0.8 + 2.0) / 5)
    assert m["dual_clip_frac"] == approx(1 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, t([[0.0, -1.1 / 5, -0.5 / 5], [0.0, 0.0, 0.0]]))


def kl_by_hand(kind: str, d: float) -> float:
    k3 = math.exp(-d) + d - 1
    return {"k1": d, "k2": 0.5 * d * d, "k3": k3, "k3_clamped": min(k3, 10.0)}[kind]


@pytest.mark.parametrize("kl", ["k1", "k2", "k3", "k3_clamped"])
def test_grpo_golden_kl(kl):
    logp, old = log_ratios(RATIOS)
    d = [[0.1, -0.2, 0.3], [0.5, 0.0, 9.0]]  # logp - ref; the 9.0 is padding
    ref = logp.detach() - t(d)
    cfg = ObjectiveConfig(agg="token-mean", beta=0.5, kl=kl)
    loss, m = get_policy_loss("grpo")(logp, old, ADV, MASK, cfg, ref_logp=ref)
    ds = [0.1, -0.2, 0.3, 0.5, 0.0]
    kl_mean = sum(kl_by_hand(kl, x) for x in ds) / 5  # k1: 0.7/5 = 0.14; k2: 0.5*0.39/5 = 0.039
    pg = (-1.2 - 1.1 - 0.5 + 0.8 + 3.0) / 5
    assert m["kl"] == approx(kl_mean)
    assert loss.item() == approx(pg + 0.5 * kl_mean)


def test_kl_estimators_golden_values_and_gradients():
    d = t([0.5, -0.5, -2.0, -3.0, 25.0, -25.0]).requires_grad_()
    # k3(-3) = e^3 - 4 = 16.09 and k3(+-25) > 10 are clamped to 10; k3(-2) = e^2 - 3 = 4.39 is not
    expected = {
        "k1": [0.5, -0.5, -2.0, -3.0, 25.0, -25.0],
        "k2": [0.125, 0.125, 2.0, 4.5, 312.5, 312.5],
        "k3": [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, math.exp(2) - 3, math.exp(3) - 4,
               math.exp(-25) + 24, math.exp(25) - 26],
        "k3_clamped": [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, math.exp(2) - 3, 10.0, 10.0, 10.0],
    }
    # d/dd: k1 1, k2 d, k3 1 - exp(-d); k3_clamped as k3 below the clamp and 0 above it
    grads = {
        "k1": [1.0] * 6,
        "k2": [0.5, -0.5, -2.0, -3.0, 25.0, -25.0],
        "k3": [1 - math.exp(-x) for x in (0.5, -0.5, -2.0, -3.0, 25.0, -25.0)],
        "k3_clamped": [1 - math.exp(-0.5), 1 - math.exp(0.5), 1 - math.exp(2), 0.0, 0.0, 0.0],
    }
    for kind in expected:
        value = kl_penalty(d, kind)
        assert value.tolist() == pytest.approx(expected[kind], rel=1e-12), kind
        assert value.tolist() == pytest.approx([kl_by_hand(kind, x) for x in d.tolist()], rel=1e-12), kind
        (grad,) = torch.autograd.grad(value.sum(), d)
        assert grad.tolist() == pytest.approx(grads[kind], rel=1e-12), kind
    # k3's exp(25) is finite; at d = -1000 only the clamp of d keeps the gradient finite
    far = t([-1000.0]).requires_grad_()
    (grad,) = torch.autograd.grad(kl_penalty(far, "k3_clamped").sum(), far)
    assert kl_penalty(far, "k3_clamped").item() == 10.0 and grad.item() == 0.0


def test_cispo_golden():
    logp, old = log_ratios(RATIOS)
    cfg = ObjectiveConfig(agg="token-mean", eps_low=0.2, eps_high=0.2)
    loss, m = get_policy_loss("cispo")(logp, old, ADV, MASK, cfg)
    # w = sg(clip(r, .8, 1.2)): row 0 (A=+1) r 1.5, 1.1, 0.5 -> 1.2, 1.1, 0.8; row 1 (A=-1) 0.5, 3.0 -> 0.8, 1.2
    # l = -w A logp, logp = -1 + log r
    lp = [[-1 + math.log(r) for r in row] for row in RATIOS]
    by_hand = -(1.2 * lp[0][0] + 1.1 * lp[0][1] + 0.8 * lp[0][2]) + (0.8 * lp[1][0] + 1.2 * lp[1][1])
    assert loss.item() == approx(by_hand / 5)
    assert m["pg_loss"] == approx(-(1.2 + 1.1 + 0.8 - 0.8 - 1.2) / 5)  # -w A
    assert m["clip_frac_low"] == approx(2 / 5) and m["clip_frac_high"] == approx(2 / 5)
    assert (m["ratio_min"], m["ratio_max"]) == (approx(0.5), approx(3.0))
    # d l / d logp = -w A, on every token: grpo gave the clipped tokens (r 1.5 with A > 0,
    # r 0.5 with A < 0) no gradient
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, t([[-1.2 / 5, -1.1 / 5, -0.8 / 5], [0.8 / 5, 1.2 / 5, 0.0]]))

    # The registered defaults, bounds 0 and 4: only r = 6 is clipped, to 4.
    logp, old = log_ratios([[6.0, 1.1, 0.5], [0.5, 3.0, 2.0]])
    loss, m = get_policy_loss("cispo")(logp, old, ADV, MASK, ObjectiveConfig(agg="token-mean", eps_low=1.0,
                                                                             eps_high=3.0))
    assert m["clip_frac_high"] == approx(1 / 5) and m["clip_frac_low"] == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, t([[-4.0 / 5, -1.1 / 5, -0.5 / 5], [0.5 / 5, 3.0 / 5, 0.0]]))


# GSPO: mean log-ratio per sequence 0.2 (row 0) and -0.3 (row 1; the 5.0 is padding).
SEQ_LOG_RATIOS = [[0.3, 0.0, 0.3], [-0.4, -0.2, 5.0]]
S0, S1 = math.exp(0.2), math.exp(-0.3)  # 1.2214, 0.7408


def gspo_inputs():
    old = torch.full((2, 3), -1.0, dtype=F64)
    return (old + t(SEQ_LOG_RATIOS)).requires_grad_(), old


def test_gspo_golden():
    logp, old = gspo_inputs()
    adv = t([2.0, -0.5])
    loss, m = get_policy_loss("gspo")(logp, old, adv, MASK, ObjectiveConfig())
    # eps 0.2: s0 = 1.2214 > 1.2 with A > 0 -> -2 * 1.2; s1 = 0.7408 < 0.8 with A < 0 -> 0.5 * 0.8
    assert loss.item() == approx((-2 * 1.2 + 0.5 * 0.8) / 2)
    assert m["clip_frac_high"] == approx(0.5) and m["clip_frac_low"] == approx(0.5)
    assert m["ratio_mean"] == approx((S0 + S1) / 2)
    assert (m["ratio_min"], m["ratio_max"]) == (approx(S1), approx(S0))

    cfg = ObjectiveConfig(eps_low=0.3, eps_high=0.3)  # nothing clipped now
    loss, m = get_policy_loss("gspo")(logp, old, adv, MASK, cfg)
    assert loss.item() == approx((-2 * S0 + 0.5 * S1) / 2)
    assert m["clip_frac_high"] == 0.0 and m["clip_frac_low"] == 0.0
    # d l_i / d logp_it = -A_i s_i / |y_i|, then / 2 sequences
    (grad,) = torch.autograd.grad(loss, logp)
    g0, g1 = -2 * S0 / 3 / 2, 0.5 * S1 / 2 / 2
    assert torch.allclose(grad, t([[g0, g0, g0], [g1, g1, 0.0]]))


def test_gspo_token_golden():
    logp, old = gspo_inputs()
    adv = t([[2.0, 1.0, 0.0], [-0.5, -1.0, 7.0]])  # per-token; the 7.0 is padding
    cfg = ObjectiveConfig(eps_low=0.3, eps_high=0.3, agg="token-mean")  # agg ignored for pg
    loss, m = get_policy_loss("gspo_token")(logp, old, adv, MASK, cfg)
    # s_it has value s_i: row 0 mean of -(2+1+0) S0 / 3 = -S0; row 1 (0.5+1) S1 / 2 = 0.75 S1
    assert loss.item() == approx((-S0 + 0.75 * S1) / 2)
    assert m["ratio_mean"] == approx((3 * S0 + 2 * S1) / 5)  # over tokens
    # d s_it / d logp_it = s_i (own token only): grad = -A_it s_i / |y_i| / 2
    (grad,) = torch.autograd.grad(loss, logp)
    expected = [[-2 * S0 / 6, -1 * S0 / 6, 0.0], [0.5 * S1 / 4, 1.0 * S1 / 4, 0.0]]
    assert torch.allclose(grad, t(expected))


def test_sft_golden():
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0]]).requires_grad_()
    sft = get_policy_loss("sft")
    # NLL 1+2+3+0.5+1.5 = 8 over 5 tokens; row means 2 and 1
    loss, m = sft(logp, None, None, MASK, ObjectiveConfig(agg="token-mean"))
    assert loss.item() == approx(8 / 5) and m["nll"] == approx(8 / 5)
    assert sft(logp, None, None, MASK, ObjectiveConfig())[0].item() == approx((2 + 1) / 2)
    cfg = ObjectiveConfig(agg="seq-mean-token-sum-norm", norm_len=4)
    assert sft(logp, None, None, MASK, cfg)[0].item() == approx(8 / (2 * 4))


# Pairs: K=2. Sums: L_w = [-6, -2], L_l = [-7, -4]; means: L_w = [-2, -1], L_l = [-7/3, -2].
CHOSEN = t([[-1.0, -2.0, -3.0], [-0.5, -1.5, -7.0]])
REJECTED = t([[-3.0, -2.0, -2.0], [-1.0, -3.0, -5.0]])
# Reference sums: Lref_w = [-6.5, -2], Lref_l = [-5, -3]
REF_CHOSEN = t([[-1.5, -2.0, -3.0], [-1.0, -1.0, 0.0]])
REF_REJECTED = t([[-2.0, -2.0, -1.0], [-2.0, -1.0, 0.0]])
LABEL, WEIGHT = t([1.0, 0.7]), t([1.0, 3.0])


def pair_loss(cfg, ref=False):
    refs = (REF_CHOSEN, REF_REJECTED) if ref else (None, None)
    return get_pair_loss("pairwise")(CHOSEN, REJECTED, MASK, MASK, LABEL, WEIGHT, cfg, *refs)


def expected_pair_loss(h):
    return (1 * bce(h[0], 1.0) + 3 * bce(h[1], 0.7)) / 4


def test_pairwise_golden_without_reference():
    loss, m = pair_loss(ObjectiveConfig(beta=0.5))
    h = [0.5 * (-6 + 7), 0.5 * (-2 + 4)]  # [0.5, 1.0]
    assert loss.item() == approx(expected_pair_loss(h)) and m["loss"] == approx(loss.item())
    assert m["reward_accuracy"] == 1.0 and m["margin_mean"] == approx((0.5 + 1.0) / 2)


def test_pairwise_golden_with_reference_and_gamma():
    loss, m = pair_loss(ObjectiveConfig(beta=0.5, gamma=0.75), ref=True)
    # margins (L_w - Lref_w) - (L_l - Lref_l): (0.5) - (-2) = 2.5 and 0 - (-1) = 1
    h = [0.5 * 2.5 - 0.75, 0.5 * 1.0 - 0.75]  # [0.5, -0.25]
    assert loss.item() == approx(expected_pair_loss(h))
    assert m["reward_accuracy"] == 0.5 and m["margin_mean"] == approx((1.25 + 0.5) / 2)


def test_pairwise_golden_length_normalized():
    loss, _ = pair_loss(ObjectiveConfig(beta=2.0, gamma=0.5, length_normalize=True))
    h = [2 * (-2 + 7 / 3) - 0.5, 2 * (-1 + 2) - 0.5]  # [1/6, 1.5]
    assert loss.item() == approx(expected_pair_loss(h))
    # A step with weight_sum 8: this batch's weighted sum 1*l0 + 3*l1 is divided by 8.
    step = Normalizer(num_seqs=4, num_tokens=0, weight_sum=8.0)
    cfg = ObjectiveConfig(beta=2.0, gamma=0.5, length_normalize=True)
    loss, _ = get_pair_loss("pairwise")(CHOSEN, REJECTED, MASK, MASK, LABEL, WEIGHT, cfg, norm=step)
    assert loss.item() == approx(expected_pair_loss(h) * 4 / 8)


# ---- equality with loop implementations of the papers' formulas ---------------------------


def loop_kl_term(logp, ref, m, cfg):
    if cfg.beta == 0:
        return 0.0
    kl = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[0])):
            d = logp[i][t] - ref[i][t]
            row.append(kl_by_hand(cfg.kl, d))
        kl.append(row)
    return cfg.beta * loop_agg(kl, m, cfg.agg, cfg.norm_len)


def loop_grpo(logp, old, ref, a, m, cfg):  # a: (B,) or (B, T)
    pg = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[0])):
            a_it = a[i][t] if isinstance(a[i], list) else a[i]
            row.append(loop_clip_pg(math.exp(logp[i][t] - old[i][t]), a_it, cfg))
        pg.append(row)
    return loop_agg(pg, m, cfg.agg, cfg.norm_len) + loop_kl_term(logp, ref, m, cfg)


def loop_gspo(logp, old, ref, a, m, cfg):
    B = len(logp)
    pg = 0.0
    for i in range(B):
        pg += loop_clip_pg(loop_seq_ratio(logp, old, m, i), a[i], cfg)
    return pg / B + loop_kl_term(logp, ref, m, cfg)


def loop_gspo_token(logp, old, ref, a, m, cfg):  # a: (B, T); the value of s_it is s_i
    pg = []
    for i in range(len(logp)):
        s_i = loop_seq_ratio(logp, old, m, i)
        pg.append([loop_clip_pg(s_i, a[i][t], cfg) for t in range(len(logp[0]))])
    return loop_agg(pg, m, "seq-mean-token-mean", None) + loop_kl_term(logp, ref, m, cfg)


def loop_cispo(logp, old, ref, a, m, cfg):  # a: (B,) or (B, T); the value -w A logp
    pg = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[0])):
            a_it = a[i][t] if isinstance(a[i], list) else a[i]
            r = math.exp(logp[i][t] - old[i][t])
            row.append(-min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) * a_it * logp[i][t])
        pg.append(row)
    return loop_agg(pg, m, cfg.agg, cfg.norm_len) + loop_kl_term(logp, ref, m, cfg)


def loop_sft(logp, m, ref, cfg):
    nll = [[-x for x in row] for row in logp]
    return loop_agg(nll, m, cfg.agg, cfg.norm_len) + loop_kl_term(logp, ref, m, cfg)


POLICY_CFGS = [
    ObjectiveConfig(),
    ObjectiveConfig(agg="token-mean", eps_high=0.28, dual_clip=3.0),
    ObjectiveConfig(agg="seq-mean-token-sum-norm", beta=0.1, kl="k3"),
    ObjectiveConfig(agg="seq-mean-token-sum-norm", norm_len=10, beta=0.2, kl="k1"),
    ObjectiveConfig(agg="token-mean", eps_low=0.1, eps_high=0.1, beta=0.3, kl="k2", dual_clip=1.5),
    ObjectiveConfig(agg="token-mean", eps_high=0.28, beta=0.3, kl="k3_clamped"),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cfg", POLICY_CFGS, ids=lambda c: f"{c.agg}-b{c.beta}-{c.kl}")
def test_policy_losses_match_loops(seed, cfg):
    logp, old, ref, adv, token_adv, mask = random_batch(seed)
    L, OLD, R, A, TA, M = (x.tolist() for x in (logp.detach(), old, ref, adv, token_adv, mask))
    cases = {
        "grpo": (adv, loop_grpo(L, OLD, R, A, M, cfg)),
        "gspo": (adv, loop_gspo(L, OLD, R, A, M, cfg)),
        "gspo_token": (token_adv, loop_gspo_token(L, OLD, R, TA, M, cfg)),
        "cispo": (adv, loop_cispo(L, OLD, R, A, M, cfg)),
    }
    for name, (a, expected) in cases.items():
        loss, _ = get_policy_loss(name)(logp, old, a, mask, cfg, ref_logp=ref)
        assert loss.item() == pytest.approx(expected, abs=1e-6), name
    token_grpo, _ = get_policy_loss("grpo")(logp, old, token_adv, mask, cfg, ref_logp=ref)
    assert token_grpo.item() == pytest.approx(loop_grpo(L, OLD, R, TA, M, cfg), abs=1e-6)
    token_cispo, _ = get_policy_loss("cispo")(logp, old, token_adv, mask, cfg, ref_logp=ref)
    assert token_cispo.item() == pytest.approx(loop_cispo(L, OLD, R, TA, M, cfg), abs=1e-6)
    sft, _ = get_policy_loss("sft")(logp, None, None, mask, cfg, ref_logp=ref)
    assert sft.item() == pytest.approx(loop_sft(L, M, R, cfg), abs=1e-6)


def loop_pairwise(cw, cl, mw, ml, rw, rl, p, w, cfg):
    def seq(logp, mask, k):
        total = sum(logp[k][t] * mask[k][t] for t in range(len(logp[k])))
        return total / sum(mask[k]) if cfg.length_normalize else total

    total = 0.0
    for k in range(len(cw)):
        ref_margin = (seq(rw, mw, k) - seq(rl, ml, k)) if rw is not None else 0.0
        h = cfg.beta * ((seq(cw, mw, k) - seq(cl, ml, k)) - ref_margin) - cfg.gamma
        log_sig = -math.log1p(math.exp(-h))
        log_sig_neg = -math.log1p(math.exp(h))
        total += w[k] * (-p[k] * log_sig - (1 - p[k]) * log_sig_neg)
    return total / sum(w)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("cfg", [ObjectiveConfig(beta=0.1),
                                 ObjectiveConfig(beta=2.0, gamma=0.5, length_normalize=True)],
                         ids=["sum", "mean-gamma"])
def test_pairwise_matches_loop(seed, with_ref, cfg):
    cw, cl, mw, ml, rw, rl, p, w = random_pairs(seed)
    refs = (rw, rl) if with_ref else (None, None)
    loss, _ = get_pair_loss("pairwise")(cw, cl, mw, ml, p, w, cfg, *refs)
    lists = [x.tolist() if x is not None else None for x in (cw, cl, mw, ml, *refs, p, w)]
    assert loss.item() == pytest.approx(loop_pairwise(*lists, cfg), abs=1e-6)


def random_pairs(seed, K=8, T=6):
    g = torch.Generator().manual_seed(seed)

    def side():
        lengths = torch.randint(1, T + 1, (K,), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
        logp = -2 * torch.rand(K, T, generator=g, dtype=F64)
        return logp.requires_grad_(), mask, logp.detach() + 0.3 * torch.randn(K, T, generator=g,
                                                                                dtype=F64)

    cw, mw, rw = side()
    cl, ml, rl = side()
    p = torch.rand(K, generator=g, dtype=F64)
    w = 0.5 + torch.rand(K, generator=g, dtype=F64)
    return cw, cl, mw, ml, rw, rl, p, w


# ---- invariances --------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_gspo_and_gspo_token_agree_in_value_and_gradient(beta):
    logp, old, ref, adv, _, mask = random_batch(3, B=8, noise=0.5)
    cfg = ObjectiveConfig(eps_low=0.1, eps_high=0.1, beta=beta)
    gspo, m = get_policy_loss("gspo")(logp, old, adv, mask, cfg, ref_logp=ref)
    token, _ = get_policy_loss("gspo_token")(logp, old, adv, mask, cfg, ref_logp=ref)
    clipped = m["clip_frac_low"] + m["clip_frac_high"]
    assert 0 < clipped < 1 and m["ratio_min"] != m["ratio_max"]  # off-policy, partly clipped
    assert token.item() == pytest.approx(gspo.item(), abs=1e-12)
    (g_gspo,) = torch.autograd.grad(gspo, logp)
    (g_token,) = torch.autograd.grad(token, logp)
    assert torch.allclose(g_gspo, g_token, atol=1e-12)
    if beta == 0:  # a clipped sequence gets no gradient
        assert (g_gspo.abs().sum(-1) == 0).sum() == round(clipped * 8)


def test_on_policy_ratios_are_one_and_gspo_matches_grpo_gradient():
    logp, _, _, adv, _, mask = random_batch(4, B=6)
    old = logp.detach()
    cfg = ObjectiveConfig()  # seq-mean-token-mean
    grads = {}
    for name in ("grpo", "gspo", "gspo_token"):
        loss, m = get_policy_loss(name)(logp, old, adv, mask, cfg)
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["ratio_mean"] == 1.0
        assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
        assert m["approx_kl"] == 0.0
        (grads[name],) = torch.autograd.grad(loss, logp)
    # Both are -A_i / |y_i| / B on every response token.
    expected = -adv[:, None] * mask / mask.sum(-1, keepdim=True) / 6
    for name in grads:
        assert torch.allclose(grads[name], expected, atol=1e-12), name


@pytest.mark.parametrize("mode", AGG_MODES)
def test_cispo_on_policy_has_grpos_gradient(mode):
    """r = 1: w = 1, so CISPO's gradient -A grad logp is REINFORCE's, and grpo's."""
    logp, _, ref, adv, token_adv, mask = random_batch(4, B=6)
    old = logp.detach()
    for a in (adv, token_adv):
        cfg = ObjectiveConfig(agg=mode, norm_len=9, beta=0.1)
        cispo, m = get_policy_loss("cispo")(logp, old, a, mask, cfg, ref_logp=ref)
        grpo, _ = get_policy_loss("grpo")(logp, old, a, mask, cfg, ref_logp=ref)
        assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["clip_frac_low"] == m["clip_frac_high"] == 0.0
        (g_cispo,) = torch.autograd.grad(cispo, logp)
        (g_grpo,) = torch.autograd.grad(grpo, logp)
        assert torch.allclose(g_cispo, g_grpo, atol=1e-12)


def test_cispo_gradient_is_reinforce_weighted_by_the_clipped_ratio():
    """Off policy: CISPO's gradient is -clip(r) A / N_tok on every token. Inside the clip range
    that is grpo's -r A / N_tok; outside it CISPO still trains the token (with weight the bound)
    where grpo gives no gradient on the side its advantage pushes."""
    logp, old, _, _, token_adv, mask = random_batch(11, B=8, T=9, noise=0.5)
    cfg = ObjectiveConfig(agg="token-mean", eps_low=0.2, eps_high=0.28)
    cispo, _ = get_policy_loss("cispo")(logp, old, token_adv, mask, cfg)
    grpo, _ = get_policy_loss("grpo")(logp, old, token_adv, mask, cfg)
    (g_cispo,) = torch.autograd.grad(cispo, logp)
    (g_grpo,) = torch.autograd.grad(grpo, logp)
    r = torch.exp(logp.detach() - old)
    n = mask.sum()
    assert torch.allclose(g_cispo, -r.clamp(0.8, 1.28) * token_adv * mask / n, atol=1e-12)
    inside = (r >= 0.8) & (r <= 1.28) & (mask > 0)
    assert torch.allclose(g_cispo[inside], g_grpo[inside], atol=1e-12)
    grpo_clipped = (((r > 1.28) & (token_adv > 0)) | ((r < 0.8) & (token_adv < 0))) & (mask > 0)
    assert grpo_clipped.sum() > 0
    assert (g_grpo[grpo_clipped] == 0).all() and (g_cispo[grpo_clipped] != 0).all()


def test_dapo_objective_is_grpo_with_token_mean_and_clip_higher():
    """DAPO (Yu et al. 2025, eq. 8) on one group: J = 1/sum_i |o_i| sum_i sum_t min(r A, clip(r,
    1 - eps_low, 1 + eps_high) A), eps_low 0.2, eps_high 0.28: grpo with agg = token-mean."""
    logp, old, _, adv, _, mask = random_batch(12, B=6, T=8, noise=0.2)
    L, OLD, A, M = (x.tolist() for x in (logp.detach(), old, adv, mask))
    objective, tokens = 0.0, 0.0
    for i in range(6):
        for j in range(8):
            if M[i][j]:
                r = math.exp(L[i][j] - OLD[i][j])
                objective += min(r * A[i], min(max(r, 0.8), 1.28) * A[i])
                tokens += 1
    cfg = ObjectiveConfig(agg="token-mean", eps_low=0.2, eps_high=0.28)
    loss, _ = get_policy_loss("grpo")(logp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(-objective / tokens, abs=1e-12)
    # Clip-higher: r = 1.25 with A > 0 is clipped at 1.2 by eps_high 0.2, not by 0.28.
    logp, old = log_ratios([[1.25]])
    one = torch.ones(1, 1, dtype=F64)
    for eps_high, grad in ((0.2, 0.0), (0.28, -1.25)):
        loss, _ = get_policy_loss("grpo")(logp, old, t([1.0]), one, ObjectiveConfig(eps_high=eps_high))
        assert torch.autograd.grad(loss, logp)[0].item() == pytest.approx(grad, abs=1e-12)


def test_dr_grpo_objective_is_grpo_with_a_constant_length_normaliser():
    """Dr. GRPO (Liu et al. 2025): A_i = r_i - mean(r), and 1/|o_i| replaced by one constant,
    the generation budget MAX: J = 1/G sum_i 1/MAX sum_t min(r A_i, clip(r) A_i). That is grpo
    with agg = seq-mean-token-sum-norm and norm_len = MAX, and on policy every token of the group
    gets -A_i / (G MAX), whatever its response's length."""
    logp, old, _, _, _, mask = random_batch(13, B=4, T=6, noise=0.2)
    rewards = [1.0, 0.0, 0.0, 1.0]
    adv = t([r - sum(rewards) / 4 for r in rewards])  # the label stage's dr_grpo
    MAX = 16
    L, OLD, A, M = (x.tolist() for x in (logp.detach(), old, adv, mask))
    objective = 0.0
    for i in range(4):
        row = 0.0
        for j in range(6):
            if M[i][j]:
                r = math.exp(L[i][j] - OLD[i][j])
                row += min(r * A[i], min(max(r, 0.8), 1.2) * A[i])
        objective += row / MAX
    cfg = ObjectiveConfig(agg="seq-mean-token-sum-norm", norm_len=MAX)
    loss, _ = get_policy_loss("grpo")(logp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(-objective / 4, abs=1e-12)
    on_policy, _ = get_policy_loss("grpo")(logp, logp.detach(), adv, mask, cfg)
    (grad,) = torch.autograd.grad(on_policy, logp)
    assert torch.allclose(grad, -adv[:, None] * mask / (4 * MAX), atol=1e-12)
    assert len(set(mask.sum(-1).tolist())) > 1  # responses of different lengths


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "cispo", "sft"])
def test_padding_is_inert(name):
    """Padding may hold -inf in old/ref logps (a generator's fill value) and a row may have no
    response token at all: neither changes the loss beyond counting the row in N_seq."""
    logp, old, ref, adv, _, mask = random_batch(8, B=4)
    mask[2] = 0.0  # an empty response
    cfg = ObjectiveConfig(beta=0.1)
    loss_fn = get_policy_loss(name)
    loss, _ = loss_fn(logp, old, adv, mask, cfg, ref_logp=ref)
    pad = mask == 0
    inf_loss, _ = loss_fn(logp, old.masked_fill(pad, -math.inf), adv, mask, cfg,
                          ref_logp=ref.masked_fill(pad, -math.inf))
    assert inf_loss.item() == pytest.approx(loss.item(), abs=1e-12)
    keep = [0, 1, 3]  # the same rows without the empty one, but still 4 sequences in the step
    step = Normalizer(num_seqs=4, num_tokens=float(mask.sum()))
    kept, _ = loss_fn(logp[keep], old[keep], adv[keep], mask[keep], cfg, ref_logp=ref[keep],
                      norm=step)
    assert kept.item() == pytest.approx(loss.item(), abs=1e-12)


# Uneven micro-batches, each trimmed to its own padded length as the batcher would pad it.
SLICES = [slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)]


def split_sum(fn, *row_tensors):
    """Sum of fn over SLICES; each (B, T) tensor trimmed to the slice's longest response."""
    mask = row_tensors[-1]
    total = 0.0
    for sl in SLICES:
        T = int(mask[sl].sum(-1).max())
        parts = [x[sl, :T] if x is not None and x.dim() == 2 else
                 (x[sl] if x is not None else None) for x in row_tensors]
        total = total + fn(*parts)
    return total


def assert_same_value_and_grad(full, split, leaf):
    assert split.item() == pytest.approx(full.item(), abs=1e-6)
    (g_full,) = torch.autograd.grad(full, leaf)
    (g_split,) = torch.autograd.grad(split, leaf)
    assert torch.allclose(g_full, g_split, atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_split_invariance(mode):
    logp, _, _, _, _, mask = random_batch(5, B=8, T=9)
    step = Normalizer(num_seqs=8, num_tokens=float(mask.sum()))
    full = agg_loss(logp**2, mask, mode, norm_len=9)
    split = split_sum(lambda lp, m: agg_loss(lp**2, m, mode, norm_len=9, norm=step), logp, mask)
    assert_same_value_and_grad(full, split, logp)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "cispo", "sft"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_split_invariance(name, mode):
    logp, old, ref, adv, token_adv, mask = random_batch(6, B=8, T=9)
    a = token_adv if name in ("grpo", "gspo_token", "cispo") else adv
    cfg = ObjectiveConfig(agg=mode, norm_len=9, beta=0.1, dual_clip=2.0)
    step = Normalizer(num_seqs=8, num_tokens=float(mask.sum()))
    loss_fn = get_policy_loss(name)
    full, _ = loss_fn(logp, old, a, mask, cfg, ref_logp=ref)
    split = split_sum(lambda lp, o, r, a_, m: loss_fn(lp, o, a_, m, cfg, ref_logp=r, norm=step)[0],
                      logp, old, ref, a, mask)
    assert_same_value_and_grad(full, split, logp)


def test_sum_norm_needs_norm_len_for_split_invariance():
    """Without norm_len each micro-batch divides by its own padded T: the shares no longer add up."""
    logp, _, _, _, _, mask = random_batch(5, B=8, T=9)
    step = Normalizer(num_seqs=8, num_tokens=float(mask.sum()))
    mode = "seq-mean-token-sum-norm"
    full = agg_loss(logp, mask, mode)
    split = split_sum(lambda lp, m: agg_loss(lp, m, mode, norm=step), logp, mask)
    assert abs(split.item() - full.item()) > 1e-3


def test_pairwise_padding_is_inert():
    cw, cl, mw, ml, rw, rl, p, w = random_pairs(9)
    assert (ml == 0).any() and (mw == 0).any()
    cfg = ObjectiveConfig(beta=0.5)
    pairwise = get_pair_loss("pairwise")
    loss, _ = pairwise(cw, cl, mw, ml, p, w, cfg, rw, rl)
    inf_loss, _ = pairwise(cw, cl.detach().masked_fill(ml == 0, -math.inf), mw, ml, p, w, cfg,
                           rw.masked_fill(mw == 0, -math.inf), rl.masked_fill(ml == 0, -math.inf))
    assert inf_loss.item() == pytest.approx(loss.item(), abs=1e-12)


def test_pairwise_split_invariance():
    cw, cl, mw, ml, rw, rl, p, w = random_pairs(7)
    cfg = ObjectiveConfig(beta=0.5, gamma=0.2)
    step = Normalizer(num_seqs=8, num_tokens=0, weight_sum=float(w.sum()))
    pairwise = get_pair_loss("pairwise")
    full, _ = pairwise(cw, cl, mw, ml, p, w, cfg, rw, rl)
    split = sum(pairwise(cw[sl], cl[sl], mw[sl], ml[sl], p[sl], w[sl], cfg, rw[sl], rl[sl],
                         norm=step)[0] for sl in SLICES)
    assert_same_value_and_grad(full, split, cw)


# ---- bad inputs ---------------------------------------------------------------------------

def test_registries():
    assert set(POLICY_LOSSES) == {"grpo", "gspo", "gspo_token", "cispo", "sft"}
    assert set(PAIR_LOSSES) == {"pairwise"}


def test_each_loss_is_registered_with_its_papers_defaults():
    assert set(LOSS_DEFAULTS) == set(POLICY_LOSSES) | set(PAIR_LOSSES)
    assert loss_defaults("grpo") == loss_defaults("sft") == LossDefaults(eps_low=0.2, eps_high=0.2, beta=0.0)
    # GSPO's sequence ratio is a geometric mean of token ratios: its clip ranges are ~1000x smaller.
    assert loss_defaults("gspo") == loss_defaults("gspo_token") == LossDefaults(eps_low=3e-4, eps_high=4e-4)
    # CISPO: no lower bound on the weight (1 - 1 = 0), upper bound 1 + 3 = 4
    assert loss_defaults("cispo") == LossDefaults(eps_low=1.0, eps_high=3.0, beta=0.0)
    assert loss_defaults("pairwise").beta == 0.1  # pairwise needs beta > 0, so its default must be
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; known: cispo, grpo, gspo, gspo_token, pairwise, sft"):
        loss_defaults("ppo")


@pytest.mark.parametrize("call, match", [
    (lambda: get_policy_loss("ppo"), r"unknown policy loss 'ppo'; known: cispo, grpo, gspo, gspo_token, sft"),
    (lambda: kl_penalty(MASK, "low_var_kl"), r"unknown kl estimator 'low_var_kl'; known: k1, k2, k3, k3_clamped"),
    (lambda: get_pair_loss("dpo"), r"unknown pair loss 'dpo'; known: pairwise"),
    (lambda: agg_loss(MASK, MASK, "mean"), r"unknown agg mode 'mean'"),
])
def test_unknown_names(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("cfg, match", [
    (ObjectiveConfig(agg="sum"), r"unknown agg mode 'sum' \(known: token-mean"),
    (ObjectiveConfig(kl="k4"), r"unknown kl estimator 'k4' \(known: k1, k2, k3, k3_clamped\)"),
    (ObjectiveConfig(eps_low=-0.1), r"eps_low and eps_high must be >= 0"),
    (ObjectiveConfig(dual_clip=1.0), r"dual_clip must be > 1"),
    (ObjectiveConfig(norm_len=0), r"norm_len must be > 0"),
    (ObjectiveConfig(beta=0.1), r"beta = 0.1 > 0 needs ref_logp"),
])
def test_bad_policy_config(cfg, match):
    logp, old = log_ratios(RATIOS)
    with pytest.raises(ValueError, match=match):
        get_policy_loss("grpo")(logp, old, ADV, MASK, cfg)


def test_bad_policy_shapes():
    logp, old = log_ratios(RATIOS)
    grpo, cfg = get_policy_loss("grpo"), ObjectiveConfig()
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\), expected \(2, 3\)"):
        grpo(logp, old, ADV, MASK[:, :2], cfg)
    with pytest.raises(ValueError, match=r"old_logp has shape \(1, 3\)"):
        grpo(logp, old[:1], ADV, MASK, cfg)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), expected \(2,\) or \(2, 3\)"):
        grpo(logp, old, t([1.0, 2.0, 3.0]), MASK, cfg)
    with pytest.raises(ValueError, match=r"logp must be 2-D"):
        grpo(logp[0], old[0], ADV, MASK[0], cfg)
    with pytest.raises(ValueError, match=r"grpo needs old_logp \(got None\)"):
        grpo(logp, None, ADV, MASK, cfg)
    with pytest.raises(ValueError, match=r"cispo needs old_logp \(got None\)"):
        get_policy_loss("cispo")(logp, None, ADV, MASK, cfg)
    with pytest.raises(ValueError, match=r"policy loss 'sft' takes no rollout correction weights"):
        get_policy_loss("sft")(logp, old, ADV, MASK, cfg, is_weight=torch.ones_like(logp))
    with pytest.raises(ValueError, match=r"gspo needs per-sequence advantages of shape \(B,\)"):
        get_policy_loss("gspo")(logp, old, ADV[:, None].expand(2, 3), MASK, cfg)


def test_bad_pairwise_inputs():
    pairwise = get_pair_loss("pairwise")
    args = (CHOSEN, REJECTED, MASK, MASK, LABEL, WEIGHT)
    with pytest.raises(ValueError, match=r"pairwise needs beta > 0 .*constant"):
        pairwise(*args, ObjectiveConfig(beta=0.0))
    cfg = ObjectiveConfig(beta=0.1)
    with pytest.raises(ValueError, match=r"rejected_mask has shape \(2, 2\)"):
        pairwise(CHOSEN, REJECTED, MASK, MASK[:, :2], LABEL, WEIGHT, cfg)
    with pytest.raises(ValueError, match=r"K = 2 pairs; .* weight \(3,\)"):
        pairwise(CHOSEN, REJECTED, MASK, MASK, LABEL, t([1.0, 1.0, 1.0]), cfg)
    with pytest.raises(ValueError, match=r"both ref_chosen_logp and ref_rejected_logp"):
        pairwise(*args, cfg, ref_chosen_logp=REF_CHOSEN)
    with pytest.raises(ValueError, match=r"norm.weight_sum"):
        pairwise(*args, cfg, norm=Normalizer(num_seqs=2, num_tokens=5))
