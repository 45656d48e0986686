"""training/grad_noise.py: golden values, invariances, exact unbiasedness over every draw from a
population of real per-sample gradients, and the trainer's streamed micro-batch estimates
(training/step.py) against per-sample gradients computed one backward at a time (float64)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pyarrow as pa
import pytest
import torch

from training import checkpoint as ckpt
from training.batching import pair_batches, policy_batches, step_normalizer
from training.config import TrainConfig
from training.grad_noise import grad_noise, grad_noise_from_sums
from training.objectives import get_pair_loss, get_policy_loss
from training.step import StepContext, accumulate_gradients, pair_micro_step, policy_micro_step


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


# ---- the estimator on hand-made vectors --------------------------------------------------

def test_golden_values_unequal_parts():
    # g = (1, 0) over 1 sample, (3, 2) over 3: gbar = (2.5, 1.5), ||gbar||^2 = 8.5,
    # S = 1 * (1.5^2 + 1.5^2) + 3 * (0.5^2 + 0.5^2) = 6, noise = S / (K - 1) = 6,
    # signal = 8.5 - 6 / 4 = 7, snr = 7 / (6 / 4).
    est = grad_noise(torch.tensor([[1.0, 0.0], [3.0, 2.0]]), [1, 3])
    assert (est.noise, est.signal, est.batch_size, est.parts) == (6.0, 7.0, 4.0, 2)
    assert est.snr == pytest.approx(7 / 1.5, rel=1e-15)
    # three parts, sizes 2, 1, 1 (B = 4): gbar = (2 * 1 + 4 + 0) / 4 = 1.5 in one dimension,
    # S = 2 * 0.25 + 6.25 + 2.25 = 9, noise = 4.5, signal = 2.25 - 4.5 / 4 = 1.125
    est = grad_noise([torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([0.0])], [2, 1, 1])
    assert (est.noise, est.signal) == (4.5, 1.125)
    # noise dominating: the unbiased signal is negative and snr clamps it at 0
    est = grad_noise(torch.tensor([[1.0], [-1.0]]), [1, 1])
    assert (est.noise, est.signal, est.snr) == (2.0, -1.0, 0.0)
    # identical parts: no noise, snr undefined
    assert grad_noise(torch.ones(3, 2), [1, 2, 3]).snr is None


def test_singleton_parts_give_the_sample_covariance_and_equal_parts_give_the_two_batch_estimator():
    rng = np.random.default_rng(0)
    G = rng.normal(size=(7, 5)) + 0.3
    est = grad_noise(torch.from_numpy(G), [1] * 7)
    trace = np.trace(np.cov(G, rowvar=False, ddof=1))
    assert est.noise == pytest.approx(trace, rel=1e-12)
    assert est.signal == pytest.approx(np.sum(G.mean(0) ** 2) - trace / 7, rel=1e-12)
    # K equal parts of n: McCandlish et al.'s |G|^2 and S from B_small = n, B_big = B
    n, K = 3, 4
    G = rng.normal(size=(K * n, 5)) + 0.5
    g = G.reshape(K, n, 5).mean(1)
    small, big, B = np.mean(np.sum(g**2, 1)), np.sum(G.mean(0) ** 2), K * n
    est = grad_noise(torch.from_numpy(g), [n] * K)
    assert est.noise == pytest.approx((small - big) / (1 / n - 1 / B), rel=1e-12)
    assert est.signal == pytest.approx((B * big - n * small) / (B - n), rel=1e-12)


def test_invariances_and_the_streamed_form():
    rng = np.random.default_rng(1)
    g, sizes = torch.from_numpy(rng.normal(size=(5, 6))), [3, 1, 4, 2, 2]
    est = grad_noise(g, sizes)
    order = [3, 0, 4, 2, 1]
    reordered = grad_noise(g[order], [sizes[i] for i in order])
    assert reordered.noise == pytest.approx(est.noise, rel=1e-14)
    assert reordered.signal == pytest.approx(est.signal, rel=1e-14)
    # a permutation of the coordinates (parameters) changes nothing either
    swapped = grad_noise(g[:, torch.randperm(6)], sizes)
    assert swapped.noise == pytest.approx(est.noise, rel=1e-14)
    # scaling every gradient by c scales signal and noise by c^2, not snr
    scaled = grad_noise(3 * g, sizes)
    assert (scaled.noise, scaled.signal) == (pytest.approx(9 * est.noise), pytest.approx(9 * est.signal))
    assert scaled.snr == pytest.approx(est.snr)
    n = torch.tensor(sizes, dtype=torch.float64)
    gbar = (n[:, None] * g).sum(0) / n.sum()
    streamed = grad_noise_from_sums(float((n * (g**2).sum(1)).sum()), float(gbar @ gbar), float(n.sum()), 5)
    assert streamed.noise == pytest.approx(est.noise, rel=1e-12)
    assert streamed.signal == pytest.approx(est.signal, rel=1e-12)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 2 parts"):
        grad_noise(torch.ones(1, 3), [4])
    with pytest.raises(ValueError, match="2 part gradients but 3 sizes"):
        grad_noise(torch.ones(2, 3), [1, 1, 1])
    with pytest.raises(ValueError, match="at least one sample"):
        grad_noise(torch.ones(2, 3), [0, 2])
    with pytest.raises(ValueError, match="at least 2 parts"):
        grad_noise_from_sums(1.0, 1.0, 4, 1)


# ---- a tiny real model: per-sample gradients one backward each ----------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config).to(torch.float64)


def sequence_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of each row of `ids` (b, L): (b,)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def per_sample_gradients(model, ids: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(ids)):
        grads = torch.autograd.grad(sequence_nll(model, ids[i : i + 1]).sum(), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_part_means_of_a_real_model_match_the_direct_computation(tiny_llama):
    """Per-sample gradients by a loop; the parts' mean gradients by one batched backward each;
    the estimator on singletons is the direct unbiased sample covariance trace and signal."""
    ids = torch.randint(0, 13, (10, 7), generator=torch.Generator().manual_seed(1))
    G = per_sample_gradients(tiny_llama, ids)
    assert 1000 < G.shape[1] < 10_000  # a few thousand parameters
    mean = G.mean(0)
    trace = float(((G - mean) ** 2).sum() / (len(G) - 1))
    est = grad_noise(G, [1] * len(G))
    assert est.noise == pytest.approx(trace, rel=1e-9)
    assert est.signal == pytest.approx(float(mean @ mean) - trace / len(G), rel=1e-9)
    # unequal parts, each part's gradient from one batched backward; of the summed loss over n_k,
    # since LlamaRMSNorm computes in float32 and would round a 1/n_k-scaled upstream gradient
    sizes, params = [2, 5, 3], [p for p in tiny_llama.parameters() if p.requires_grad]
    bounds = np.cumsum([0, *sizes])
    parts = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(sequence_nll(tiny_llama, ids[a:b]).sum(), params)])
             / (b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    for part, a, b in zip(parts, bounds[:-1], bounds[1:]):
        torch.testing.assert_close(part, G[a:b].mean(0), rtol=1e-9, atol=1e-12)
    est = grad_noise(parts, sizes)
    g = torch.stack(parts)
    n = torch.tensor(sizes, dtype=torch.float64)
    between = float((n * ((g - mean) ** 2).sum(1)).sum())
    assert est.noise == pytest.approx(between / 2, rel=1e-9)
    assert est.signal == pytest.approx(float(mean @ mean) - between / 2 / 10, rel=1e-9)


@pytest.mark.parametrize("sizes", [(1, 3), (1, 1, 2), (2, 2)])
def test_unbiased_over_every_draw_from_a_population_of_real_gradients(tiny_llama, sizes):
    """Draw B samples i.i.d. (with replacement) from M real per-sample gradients, in all M^B
    ways: the estimates' average is exactly ||mu||^2 and tr(Sigma) of that population."""
    ids = torch.randint(0, 13, (4, 6), generator=torch.Generator().manual_seed(2))
    V = per_sample_gradients(tiny_llama, ids)  # the population, M = 4
    mu = V.mean(0)
    signal, noise = float(mu @ mu), float(((V - mu) ** 2).sum(1).mean())  # Sigma with 1/M
    B, bounds = sum(sizes), np.cumsum([0, *sizes])
    draws = list(itertools.product(range(len(V)), repeat=B))
    totals = np.zeros(2)
    for draw in draws:
        G = V[list(draw)]
        est = grad_noise([G[a:b].mean(0) for a, b in zip(bounds[:-1], bounds[1:])], sizes)
        totals += (est.signal, est.noise)
    assert totals[0] / len(draws) == pytest.approx(signal, rel=1e-9)
    assert totals[1] / len(draws) == pytest.approx(noise, rel=1e-9)
    assert noise > 0.01 * signal  # a population with real spread, not a degenerate check


# ---- the trainer's streamed estimates (training/step.py) on the toy model -------------------

def toy_rows(objective: str, rng: np.random.Generator, n: int = 12) -> pa.Table:
    def tokens(lo, hi):
        return [rng.integers(3, 18, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]

    prompts = tokens(2, 6)
    if objective == "pairwise":
        return pa.table({"prompt_token_ids": prompts, "chosen_token_ids": tokens(1, 6),
                         "rejected_token_ids": tokens(1, 6), "soft_label": rng.uniform(0.5, 1.0, n),
                         "weight": rng.uniform(0.5, 2.0, n)})
    responses = tokens(1, 7)
    advantage = rng.choice([-1.0, 0.0, 0.5, 1.5], size=n)
    table = pa.table({"prompt_token_ids": prompts, "response_token_ids": responses, "advantage": advantage})
    return table


@pytest.fixture(scope="module")
def toy_policy(toy_dir):
    return ckpt.load_model(toy_dir / "model", "cpu", trainable=True, dtype=torch.float64)


@pytest.mark.parametrize("objective,extra", [("grpo", {"agg": "token-mean"}), ("gspo", {}), ("sft", {}),
                                             ("pairwise", {"length_normalize": True})])
def test_step_estimates_match_per_sample_gradients(toy_policy, objective, extra):
    rng = np.random.default_rng(3)
    table = toy_rows(objective, rng)
    pairwise = objective == "pairwise"
    params = [p for p in toy_policy.parameters() if p.requires_grad]
    loss = get_pair_loss(objective) if pairwise else get_policy_loss(objective)
    cfg = TrainConfig(objective=objective, **extra)
    ctx = StepContext(policy=toy_policy, reference=None, loss=loss, objective=cfg.objective_config(longest_response=8),
                      temperature=1.0, pad_id=0, device=torch.device("cpu"), autocast=False, measure_gap=False,
                      grad_noise=True)
    make, micro_step = (pair_batches, pair_micro_step) if pairwise else (policy_batches, policy_micro_step)
    if not pairwise:  # old log-probs near the policy's own, so the ratios move and some clip
        with torch.no_grad():
            rows = [None] * len(table)
            for mb in make(table, 10_000):
                logp = ctx.logprobs(toy_policy, mb)
                for j, row in enumerate(mb.rows.tolist()):
                    rows[row] = (logp[j][mb.target_mask[j]] + 0.3 * torch.randn(int(mb.target_mask[j].sum()),
                                 generator=torch.Generator().manual_seed(row), dtype=torch.float64)).tolist()
        table = table.append_column("behavior_logprobs", pa.array(rows, pa.list_(pa.float32())))
    batches = make(table, 40)
    sizes = [mb.num_pairs or mb.input_ids.shape[0] for mb in batches]
    assert len(batches) >= 3 and len(set(sizes)) > 1  # several micro-batches of unequal sizes

    toy_policy.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(ctx, micro_step, batches, policy_version=0)
    step_gradient = flat_grad(params)
    toy_policy.zero_grad(set_to_none=True)
    plain = accumulate_gradients(dataclasses.replace(ctx, grad_noise=False), micro_step, batches, policy_version=0)
    assert torch.equal(flat_grad(params), step_gradient)  # measuring leaves the gradient bit for bit
    assert {k: v for k, v in metrics.items() if not k.startswith("grad_")} == plain
    assert not any(k.startswith("grad_") for k in plain)

    # G_i = B x sample i's term of the step gradient: its loss under the step's normaliser
    norm, B = step_normalizer(batches), len(table)
    G = torch.zeros(B, step_gradient.numel(), dtype=torch.float64)
    for i in range(B):
        (one,) = make(table.take([i]), 10_000)
        out = micro_step(ctx, one, norm)
        G[i] = B * torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in
                              zip(torch.autograd.grad(out.loss, params, allow_unused=True), params)])
    torch.testing.assert_close(G.mean(0), step_gradient, rtol=1e-9, atol=1e-12)
    parts = [G[mb.rows[: len(mb.rows) // 2 if pairwise else None]].mean(0) for mb in batches]
    direct = grad_noise(parts, sizes)
    assert metrics["grad_noise"] == pytest.approx(direct.noise, rel=1e-6)
    assert metrics["grad_signal"] == pytest.approx(direct.signal, rel=1e-6, abs=1e-9 * direct.noise)
    assert metrics["grad_snr"] == pytest.approx(direct.snr, rel=1e-6, abs=1e-9)
    assert direct.noise > 0
    if pairwise:
        assert "zero_adv_frac" not in metrics
    else:
        expected = float(np.mean(np.abs(table.column("advantage").to_numpy()) < 1e-6))
        assert 0 < expected < 1 and metrics["zero_adv_frac"] == pytest.approx(expected, rel=1e-12)


def test_one_micro_batch_has_no_estimate(toy_policy):
    table = toy_rows("grpo", np.random.default_rng(4), n=4)
    ctx = StepContext(policy=toy_policy, reference=None, loss=get_policy_loss("sft"),
                      objective=TrainConfig(objective="sft").objective_config(longest_response=8), temperature=1.0,
                      pad_id=0, device=torch.device("cpu"), autocast=False, measure_gap=False, grad_noise=True)
    toy_policy.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(ctx, policy_micro_step, policy_batches(table, 10_000), policy_version=0)
    assert metrics["micro_batches"] == 1
    assert not {"grad_signal", "grad_noise", "grad_snr"} & set(metrics)
