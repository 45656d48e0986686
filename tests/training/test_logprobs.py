"""training/logprobs.py: chunked log-probs equal the full-logits reference (values and
every parameter gradient), padding changes nothing, bf16 autocast stays close, and the
head's memory does not grow with B*L*V (measured in a fresh interpreter)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.helpers import REPO
from training.logprobs import ChunkedTokenLogProbs, GatherRows, token_logprobs, token_logprobs_reference, truncate_


@pytest.fixture(scope="module")
def toy_float32(toy_dir):
    return AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)


def _copy(model, dtype):
    return copy.deepcopy(model).to(dtype)


def _big_vocab(dtype=torch.float64, vocab=32000, tie=False, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config).to(dtype)


def _batch(vocab, seed=0, prompt_lens=(3, 5, 2, 4), resp_lens=(6, 2, 9, 4), low=3):
    """Right-padded rows (pad 0) with response targets; returns ids, attention, targets."""
    g = torch.Generator().manual_seed(seed)
    L = max(p + r for p, r in zip(prompt_lens, resp_lens))
    ids = torch.zeros(len(prompt_lens), L, dtype=torch.long)
    attention = torch.zeros_like(ids)
    targets = torch.zeros(len(prompt_lens), L - 1, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        ids[b, : p + r] = torch.randint(low, vocab, (p + r,), generator=g)
        attention[b, : p + r] = 1
        targets[b, p - 1 : p + r - 1] = True
    return ids, attention, targets


def _logp_and_grads(fn, model, ids, attention, targets, weights, **kw):
    model.zero_grad(set_to_none=True)
    logp = fn(model, ids, attention, targets, **kw)
    (logp * weights).sum().backward()  # arbitrary upstream gradient, not just ones
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, ids, attention, targets, atol, rtol, temperature=1.0, chunk_tokens=2048, **truncation):
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, got_grads = _logp_and_grads(token_logprobs, model, ids, attention, targets, weights.to(torch.float32)
                                     if next(model.parameters()).dtype == torch.float32 else weights,
                                     temperature=temperature, chunk_tokens=chunk_tokens, **truncation)
    want, want_grads = _logp_and_grads(token_logprobs_reference, model, ids, attention, targets,
                                       weights.to(got.dtype), temperature=temperature, **truncation)
    assert got.shape == targets.shape and got.dtype == want.dtype
    assert (got[~targets] == 0).all()
    assert (got[targets] < 0).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert got_grads.keys() == want_grads.keys() == {n for n, _ in model.named_parameters()}
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=atol, rtol=rtol, msg=name)


# chunk sizes: 1 row, one that does not divide N (N = 21 targets), exactly N, more than N
@pytest.mark.parametrize("chunk_tokens", [1, 4, 21, 2048])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_toy_matches_reference_float64(toy_float32, chunk_tokens, temperature):
    model = _copy(toy_float32, torch.float64)
    ids, attention, targets = _batch(vocab=18)
    assert int(targets.sum()) == 21
    _assert_same(model, ids, attention, targets, atol=1e-10, rtol=1e-9,
                 temperature=temperature, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [1, 8, 2048])
def test_toy_matches_reference_float32(toy_float32, chunk_tokens):
    model = _copy(toy_float32, torch.float32)
    ids, attention, targets = _batch(vocab=18, seed=3)
    _assert_same(model, ids, attention, targets, atol=1e-5, rtol=1e-4, temperature=1.3,
                 chunk_tokens=chunk_tokens)


def test_truncate_keeps_the_samplers_set():
    # probabilities of [2, 1, 0.5, 0]: 0.579, 0.213, 0.129, 0.078
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0]], dtype=torch.float64)
    kept = lambda target, **kw: torch.isfinite(truncate_(row.clone(), torch.tensor([target]), **kw))[0].tolist()  # noqa: E731
    assert kept(0, top_k=2, top_p=1.0) == [True, True, False, False]
    assert kept(0, top_k=0, top_p=0.7) == [True, True, False, False]  # 0.579 above token 1 < 0.7
    assert kept(0, top_k=0, top_p=0.5) == [True, False, False, False]  # 0.579 >= 0.5: token 1 is out
    assert kept(3, top_k=0, top_p=0.5) == [True, False, False, True]  # the sampled token is always in
    # top-k first, then top-p on the renormalised top 3: 0.628, 0.231, 0.140
    assert kept(0, top_k=3, top_p=0.85) == [True, True, False, False]
    assert kept(0, top_k=3, top_p=0.87) == [True, True, True, False]
    assert kept(0, top_k=0, top_p=1.0) == [True] * 4 and kept(0, top_k=4, top_p=1.0) == [True] * 4
    logp = truncate_(row.clone(), torch.tensor([0]), top_k=2, top_p=1.0).log_softmax(-1)[0, 0]
    assert float(logp) == pytest.approx(2.0 - math.log(math.exp(2.0) + math.exp(1.0)))


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9), (5, 0.9), (0, 0.5)])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 2048])
def test_truncated_logprobs_match_reference(toy_float32, top_k, top_p, chunk_tokens):
    """Values and every gradient of the chunked truncated log-probs (custom backward) against
    autograd through the masked full log-softmax."""
    model = _copy(toy_float32, torch.float64)
    ids, attention, targets = _batch(vocab=18, seed=5)
    _assert_same(model, ids, attention, targets, atol=1e-10, rtol=1e-9, temperature=0.7,
                 chunk_tokens=chunk_tokens, top_k=top_k, top_p=top_p)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 2048])
def test_big_vocab_matches_reference(chunk_tokens, tie):
    model = _big_vocab(tie=tie)
    ids, attention, targets = _batch(vocab=32000, seed=2)
    _assert_same(model, ids, attention, targets, atol=1e-10, rtol=1e-9, temperature=0.6,
                 chunk_tokens=chunk_tokens)


def test_big_vocab_float32_matches_reference():
    model = _big_vocab(torch.float32)
    ids, attention, targets = _batch(vocab=32000, seed=4)
    _assert_same(model, ids, attention, targets, atol=1e-5, rtol=1e-4, chunk_tokens=7)


def test_gradcheck_function():
    """Analytic backward (recomputed chunk logits) vs finite differences, float64, with a
    bias, a temperature and a chunk size that does not divide N."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    for fn_bias in (bias, None):
        def fn(h, w, *b):
            return ChunkedTokenLogProbs.apply(h, w, b[0] if b else None, targets, 0.6, 3, torch.float64)
        inputs = (hidden, weight) + ((fn_bias,) if fn_bias is not None else ())
        assert torch.autograd.gradcheck(fn, inputs)
    # and the values are log_softmax's
    want = ((hidden @ weight.T + bias) / 0.6).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    got = ChunkedTokenLogProbs.apply(hidden, weight, bias, targets, 0.6, 3, torch.float64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_padded_batch_equals_unpadded_rows(toy_float32):
    model = toy_float32
    ids, attention, targets = _batch(vocab=18, seed=5, prompt_lens=(2, 6, 3), resp_lens=(3, 7, 1))
    with torch.no_grad():
        batched = token_logprobs(model, ids, attention, targets, chunk_tokens=3)
        for b in range(ids.shape[0]):
            n = int(attention[b].sum())
            alone = token_logprobs(model, ids[b : b + 1, :n], attention[b : b + 1, :n], targets[b : b + 1, : n - 1])
            torch.testing.assert_close(batched[b, : n - 1], alone[0], atol=1e-5, rtol=1e-5)
            assert (batched[b, n - 1 :] == 0).all()


def test_bf16_autocast_close_to_float32(toy_float32):
    model = _copy(toy_float32, torch.float32)
    ids, attention, targets = _batch(vocab=18, seed=6)
    full = token_logprobs(model, ids, attention, targets)
    full.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = token_logprobs(model, ids, attention, targets, chunk_tokens=5)
        ref = token_logprobs_reference(model, ids, attention, targets)
    assert half.dtype == torch.float32  # log-softmax in float32 under autocast
    torch.testing.assert_close(half, ref.float(), atol=1e-4, rtol=0)  # same bf16 head, same result
    # bf16 keeps ~3 significant digits through the body and the head (measured: 0.02 at |logp| ~ 8)
    assert (half - full).abs().max() < 0.1
    half.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        assert (p.grad - want[name]).norm() < 0.05 * want[name].norm(), name


def test_input_errors(toy_float32):
    model = toy_float32
    ids, attention, targets = _batch(vocab=18)
    with pytest.raises(ValueError, match=r"target_mask must be a bool tensor of shape \(B, L-1\)"):
        token_logprobs(model, ids, attention, targets[:, :-1])
    with pytest.raises(ValueError, match="target_mask must be a bool"):
        token_logprobs(model, ids, attention, targets.long())
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        token_logprobs(model, ids, attention, targets, chunk_tokens=0)
    with pytest.raises(TypeError, match="ForCausalLM"):
        token_logprobs(model.model, ids, attention, targets)


_MEMORY_PROBE = textwrap.dedent("""
    import json, sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from training.logprobs import token_logprobs, token_logprobs_reference
    torch.set_num_threads(1)
    torch.manual_seed(0)
    V, B, L, CHUNK = 32000, 4, 1024, 128
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=L))
    ids = torch.randint(0, V, (B, L)); attention = torch.ones_like(ids)
    targets = torch.ones(B, L - 1, dtype=torch.bool)

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def peak_growth(fn, **kw):
        # Reset the high-water mark first (Linux: "5" > clear_refs), so that an earlier peak
        # (imports, bytecode compilation on a fresh checkout) cannot hide this one.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kib("VmRSS")
        fn(model, ids, attention, targets, **kw).sum().backward()
        model.zero_grad(set_to_none=False)
        return (status_kib("VmHWM") - before) * 1024

    # warm-up on 4 x 8 tokens (small, so that it sets no high-water mark of its own):
    # grads allocated, thread pools up
    token_logprobs(model, ids[:, :8], attention[:, :8], targets[:, :7]).sum().backward()
    model.zero_grad(set_to_none=False)
    chunked = peak_growth(token_logprobs, chunk_tokens=CHUNK)
    reference = peak_growth(token_logprobs_reference)
    print(json.dumps({"chunked": chunked, "reference": reference, "full_logits": B * L * V * 4,
                      "chunk_logits": CHUNK * V * 4}))
""")


def test_peak_memory_does_not_grow_with_vocab_times_tokens():
    """Measured: peak RSS growth (VmHWM after a reset, minus VmRSS before) of one
    forward+backward in a fresh interpreter. Full logits
    would be 4 x 1024 x 32000 x 4 B = 500 MiB; chunked (128 rows = 16 MiB of logits per
    chunk) must stay under a quarter of that, while the reference must exceed it (which
    shows the measurement sees the logits at all)."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = {k: round(v / 2**20) for k, v in m.items()}
    assert m["reference"] > m["full_logits"], mib
    assert m["chunked"] < m["full_logits"] / 4, mib
    assert m["chunked"] < 6 * m["chunk_logits"], mib  # a few chunk-sized buffers (measured ~2.8)


def test_gather_rows_sums_repeated_indices_and_repeats_bitwise():
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    index = torch.tensor([0, 2, 0, 0])
    out = GatherRows.apply(x, index)
    assert out.tolist() == [[0.0, 1.0], [4.0, 5.0], [0.0, 1.0], [0.0, 1.0]]
    out.backward(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]))
    assert x.grad.tolist() == [[13.0, 16.0], [0.0, 0.0], [3.0, 4.0]]

    # many repeats of a few rows, large enough for torch's parallel index_put_ path
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(64, 256, generator=gen, requires_grad=True)
    index = torch.randint(0, 8, (4096,), generator=gen)
    grad_out = torch.randn(4096, 256, generator=gen)
    grads = []
    for _ in range(4):
        big.grad = None
        GatherRows.apply(big, index).backward(grad_out)
        grads.append(big.grad.clone())
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    expected = torch.zeros(64, 256, dtype=torch.float64).index_add_(0, index, grad_out.double())
    torch.testing.assert_close(grads[0].double(), expected, rtol=1e-5, atol=1e-4)
