"""training/batching.py: exact placement of ids, masks and old_logp; the budget; every row
exactly once; pairs kept together; clear errors; and the micro-batch split invariance of
the real toy model's gradients (token_logprobs + objectives + step_normalizer)."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from training.batching import MicroBatch, pair_batches, policy_batches, prompt_groups, step_normalizer
from training.logprobs import token_logprobs
from training.objectives import Normalizer, ObjectiveConfig, get_pair_loss, get_policy_loss

IDS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())


def _policy_table(prompts, responses, logprobs=None, advantage=None) -> pa.Table:
    columns = {"prompt_token_ids": pa.array(prompts, IDS), "response_token_ids": pa.array(responses, IDS)}
    if logprobs is not None:
        columns["behavior_logprobs"] = pa.array(logprobs, LOGPROBS)
    if advantage is not None:
        columns["advantage"] = pa.array(advantage, pa.float64())
    return pa.table(columns)


def _pair_table(prompts, chosen, rejected, soft_label, weight, chosen_lp=None, rejected_lp=None) -> pa.Table:
    columns = {"prompt_token_ids": pa.array(prompts, IDS), "chosen_token_ids": pa.array(chosen, IDS),
               "rejected_token_ids": pa.array(rejected, IDS), "soft_label": pa.array(soft_label, pa.float64()),
               "weight": pa.array(weight, pa.float64())}
    if chosen_lp is not None:
        columns["chosen_logprobs"] = pa.array(chosen_lp, LOGPROBS)
    if rejected_lp is not None:
        columns["rejected_logprobs"] = pa.array(rejected_lp, LOGPROBS)
    return pa.table(columns)


def _random_lists(rng, n, low, high, vocab=(3, 18)):
    return [rng.integers(*vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(n)]


# ---- placement -----------------------------------------------------------------------------

def test_policy_placement_exact():
    table = _policy_table(
        prompts=[[1, 5, 6], [1, 7], [1, 4, 4, 4]],
        responses=[[9, 10], [11, 12, 13, 14], [15]],
        logprobs=[[-0.5, -1.5], [-0.1, -0.2, -0.3, -0.4], [-2.0]],
        advantage=[0.5, -1.0, 2.0],
    )
    # lengths 5, 6, 5: sorted (5, row 0), (5, row 2), (6, row 1); budget 10 fits two rows of 5
    first, second = policy_batches(table, token_budget=10, pad_id=0)
    assert first.rows.tolist() == [0, 2] and second.rows.tolist() == [1]
    assert first.input_ids.tolist() == [[1, 5, 6, 9, 10], [1, 4, 4, 4, 15]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position t predicts token t+1: row 0's response tokens are at 3, 4 -> targets at 2, 3
    assert first.target_mask.tolist() == [[False, False, True, True], [False, False, False, True]]
    assert first.old_logp.tolist() == [[0.0, 0.0, -0.5, -1.5], [0.0, 0.0, 0.0, -2.0]]
    assert first.advantages.tolist() == [0.5, 2.0]
    assert second.input_ids.tolist() == [[1, 7, 11, 12, 13, 14]]
    assert second.target_mask.tolist() == [[False, True, True, True, True]]
    torch.testing.assert_close(second.old_logp, torch.tensor([[0.0, -0.1, -0.2, -0.3, -0.4]]))
    for b in (first, second):
        assert b.input_ids.dtype == b.attention_mask.dtype == b.rows.dtype == torch.int64
        assert b.target_mask.dtype == torch.bool and b.old_logp.dtype == b.advantages.dtype == torch.float32
        assert b.soft_label is None and b.weight is None and b.num_pairs == 0


def test_policy_right_padding_with_pad_id_and_optional_columns():
    table = _policy_table(prompts=[[1, 2], [1]], responses=[[3], [4, 5, 6]])
    (batch,) = policy_batches(table, token_budget=100, pad_id=17)
    assert batch.rows.tolist() == [0, 1]
    assert batch.input_ids.tolist() == [[1, 2, 3, 17], [1, 4, 5, 6]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.target_mask.tolist() == [[False, True, False], [True, True, True]]
    assert batch.old_logp is None  # no behavior_logprobs column
    assert batch.advantages.tolist() == [0.0, 0.0]  # no advantage column
    assert batch.policy_version is None  # no policy_version column


def test_policy_version_follows_its_rows():
    table = _policy_table(prompts=[[1, 2, 3], [1], [1, 2]], responses=[[4], [5], [6]])
    table = table.append_column("policy_version", pa.array([7, 0, 3], pa.int64()))
    first, second = policy_batches(table, token_budget=6, pad_id=0)  # lengths 4, 2, 3: rows [1, 2] then [0]
    assert first.rows.tolist() == [1, 2] and second.rows.tolist() == [0]
    assert first.policy_version.tolist() == [0, 3] and second.policy_version.tolist() == [7]
    assert all(b.policy_version is None for b in pair_batches(
        _pair_table([[1]], [[2]], [[3]], soft_label=[1.0], weight=[1.0]), token_budget=100))


def test_pair_placement_exact():
    table = _pair_table(
        prompts=[[1, 5], [1, 6, 6]],
        chosen=[[7, 8, 9], [10]],
        rejected=[[11], [12, 13]],
        soft_label=[0.9, 1.0], weight=[2.0, 0.5],
        chosen_lp=[[-0.1, -0.2, -0.3], [-0.4]], rejected_lp=[[-1.0], [-2.0, -3.0]],
    )
    (batch,) = pair_batches(table, token_budget=100, pad_id=0)
    # pair lengths 5, 5 (row order kept on the tie); rows 0..k-1 chosen, k..2k-1 rejected
    assert batch.num_pairs == 2
    assert batch.rows.tolist() == [0, 1, 0, 1]
    assert batch.input_ids.tolist() == [[1, 5, 7, 8, 9], [1, 6, 6, 10, 0], [1, 5, 11, 0, 0], [1, 6, 6, 12, 13]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.target_mask.tolist() == [[False, True, True, True], [False, False, True, False],
                                          [False, True, False, False], [False, False, True, True]]
    torch.testing.assert_close(batch.old_logp, torch.tensor([[0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0],
                                                             [0, -1.0, 0, 0], [0, 0, -2.0, -3.0]]))
    assert batch.soft_label.tolist() == pytest.approx([0.9, 1.0])
    assert batch.weight.tolist() == [2.0, 0.5]
    assert batch.advantages.tolist() == [0.0] * 4


# ---- budget, coverage, order -----------------------------------------------------------------

def _unpack(batch: MicroBatch, j: int):
    """(prompt+response ids, response ids, old_logp at targets) of sequence j of a batch."""
    n = int(batch.attention_mask[j].sum())
    targets = batch.target_mask[j]
    response_start = int(targets.nonzero()[0]) + 1
    assert targets[response_start - 1 : n - 1].all() and not targets[: response_start - 1].any()
    assert not targets[n - 1 :].any() and not batch.attention_mask[j, n:].any()
    old = None if batch.old_logp is None else batch.old_logp[j][targets].tolist()
    if batch.old_logp is not None:
        assert (batch.old_logp[j][~targets] == 0).all()
    return batch.input_ids[j, :n].tolist(), batch.input_ids[j, response_start:n].tolist(), old


@pytest.mark.parametrize("budget", [1, 7, 24, 64, 10_000])
def test_policy_budget_and_every_row_exactly_once(budget):
    rng = np.random.default_rng(budget)
    prompts, responses = _random_lists(rng, 40, 1, 9), _random_lists(rng, 40, 1, 15)
    logprobs = [(-rng.random(len(r))).astype(np.float32).tolist() for r in responses]
    advantage = rng.normal(size=40).tolist()
    table = _policy_table(prompts, responses, logprobs, advantage)
    batches = policy_batches(table, budget, pad_id=0)
    seen = []
    previous_longest = 0
    for batch in batches:
        b, L = batch.input_ids.shape
        lengths = batch.attention_mask.sum(1)
        assert b * L <= budget or b == 1  # over-budget sequences only alone
        assert int(lengths.max()) == L  # no all-padding columns
        assert int(lengths.min()) >= previous_longest  # sorted by length across batches
        previous_longest = L
        for j, row in enumerate(batch.rows.tolist()):
            ids, response, old = _unpack(batch, j)
            assert ids == prompts[row] + responses[row] and response == responses[row]
            assert old == logprobs[row]
            assert batch.advantages[j].item() == pytest.approx(advantage[row], rel=1e-6)
            seen.append(row)
    assert sorted(seen) == list(range(40))
    # sorting: by length, then by row (deterministic)
    keys = [(len(prompts[r]) + len(responses[r]), r) for r in seen]
    assert keys == sorted(keys)
    if budget == 1:
        assert len(batches) == 40


def test_over_budget_sequence_gets_its_own_batch():
    table = _policy_table(prompts=[[1], [1], [1, 2, 3, 4, 5, 6, 7, 8], [1]], responses=[[2], [3], [9, 9, 9], [4]])
    batches = policy_batches(table, token_budget=6)
    assert [b.rows.tolist() for b in batches] == [[0, 1, 3], [2]]
    assert batches[1].input_ids.shape == (1, 11)


@pytest.mark.parametrize("budget", [1, 10, 40, 10_000])
def test_pairs_stay_together_within_budget(budget):
    rng = np.random.default_rng(budget)
    n = 25
    prompts, chosen, rejected = _random_lists(rng, n, 1, 6), _random_lists(rng, n, 1, 9), _random_lists(rng, n, 1, 9)
    table = _pair_table(prompts, chosen, rejected, rng.random(n).tolist(), (rng.random(n) + 0.5).tolist())
    seen = []
    for batch in pair_batches(table, budget):
        k = batch.num_pairs
        two_k, L = batch.input_ids.shape
        assert two_k == 2 * k and batch.soft_label.shape == batch.weight.shape == (k,)
        assert two_k * L <= budget or k == 1
        assert batch.rows[:k].tolist() == batch.rows[k:].tolist()
        for j, row in enumerate(batch.rows[:k].tolist()):
            ids_w, resp_w, _ = _unpack(batch, j)
            ids_l, resp_l, _ = _unpack(batch, k + j)
            assert ids_w == prompts[row] + chosen[row] and resp_w == chosen[row]
            assert ids_l == prompts[row] + rejected[row] and resp_l == rejected[row]
            assert batch.soft_label[j].item() == pytest.approx(table["soft_label"][row].as_py(), rel=1e-6)
            seen.append(row)
        assert batch.old_logp is None
    assert sorted(seen) == list(range(n))


def test_sliced_and_chunked_tables():
    rng = np.random.default_rng(0)
    prompts, responses = _random_lists(rng, 12, 1, 4), _random_lists(rng, 12, 1, 6)
    logprobs = [[-0.5] * len(r) for r in responses]
    table = _policy_table(prompts, responses, logprobs)
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5)])
    sliced = table.slice(3, 6)
    for t, offset in ((chunked, 0), (sliced, 3)):
        for batch in policy_batches(t, 30):
            for j, row in enumerate(batch.rows.tolist()):
                ids, _, old = _unpack(batch, j)
                assert ids == prompts[offset + row] + responses[offset + row]
                assert old == logprobs[offset + row]


def test_step_normalizer_counts():
    table = _policy_table(prompts=[[1], [1, 2], [1]], responses=[[2, 3], [4], [5, 6, 7]])
    norm = step_normalizer(policy_batches(table, token_budget=3))
    assert norm == Normalizer(num_seqs=3.0, num_tokens=6.0, weight_sum=None)
    pairs = _pair_table([[1], [1, 2]], [[3, 4], [5]], [[6], [7, 8, 9]], [1.0, 0.7], [2.0, 0.25])
    norm = step_normalizer(pair_batches(pairs, token_budget=4))
    assert norm == Normalizer(num_seqs=2.0, num_tokens=7.0, weight_sum=2.25)


# ---- errors --------------------------------------------------------------------------------

def test_errors():
    good = dict(prompts=[[1], [1, 2]], responses=[[3], [4, 5]])
    with pytest.raises(ValueError, match=r"row 1: behavior_logprobs has 1 values but response_token_ids has 2"):
        policy_batches(_policy_table(**good, logprobs=[[-0.1], [-0.2]]), 10)
    with pytest.raises(ValueError, match=r"row 1: response_token_ids is empty"):
        policy_batches(_policy_table(prompts=[[1], [1]], responses=[[3], []]), 10)
    with pytest.raises(ValueError, match=r"row 0: prompt_token_ids is empty"):
        policy_batches(_policy_table(prompts=[[], [1]], responses=[[3], [4]]), 10)
    for budget in (0, -5, 2.5):
        with pytest.raises(ValueError, match="token_budget must be a positive int"):
            policy_batches(_policy_table(**good), budget)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['response_token_ids'\]"):
        policy_batches(pa.table({"prompt_token_ids": pa.array([[1]], IDS)}), 10)
    with pytest.raises(ValueError, match=r"column 'response_token_ids': row 1 is null"):
        policy_batches(_policy_table(prompts=[[1], [1]], responses=[[3], None]), 10)
    with pytest.raises(ValueError, match=r"column 'advantage': row 0 is nan"):
        policy_batches(_policy_table(**good, advantage=[float("nan"), 1.0]), 10)
    pair = dict(prompts=[[1]], chosen=[[2, 3]], rejected=[[4]], soft_label=[1.0], weight=[1.0])
    with pytest.raises(ValueError, match="chosen_logprobs and rejected_logprobs come together"):
        pair_batches(_pair_table(**pair, chosen_lp=[[-1.0, -1.0]]), 10)
    with pytest.raises(ValueError, match=r"row 0: rejected_logprobs has 2 values but rejected_token_ids has 1"):
        pair_batches(_pair_table(**pair, chosen_lp=[[-1.0, -1.0]], rejected_lp=[[-1.0, -2.0]]), 10)
    with pytest.raises(ValueError, match=r"row 0: chosen_token_ids is empty"):
        pair_batches(_pair_table(**{**pair, "chosen": [[]]}), 10)
    with pytest.raises(ValueError, match="token_budget must be a positive int"):
        pair_batches(_pair_table(**pair), 0)
    with pytest.raises(ValueError, match="no micro-batches"):
        step_normalizer([])
    mixed = policy_batches(_policy_table(**good), 10) + pair_batches(_pair_table(**pair), 10)
    with pytest.raises(ValueError, match="mixes pair and policy"):
        step_normalizer(mixed)


# ---- micro-batch split invariance on the real toy model ----------------------------------------

@pytest.fixture(scope="module")
def toy64(toy_dir):
    """The toy model in float64, so that 1e-6 separates a real bug from rounding."""
    return AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32).to(torch.float64)


def _step_grads(model, batches, loss_of):
    """One optimizer step's gradients, accumulated over micro-batches, and its summed loss."""
    model = copy.deepcopy(model)
    norm = step_normalizer(batches)
    total = 0.0
    for batch in batches:
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask, chunk_tokens=16,
                              shared=batch.shared)
        loss = loss_of(logp, batch, norm)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def _assert_split_invariant(model, make_batches, loss_of, budgets=(100_000, 40)):
    whole, split = (make_batches(b) for b in budgets)
    assert len(whole) == 1 and len(split) >= 4
    loss_1, grads_1 = _step_grads(model, whole, loss_of)
    loss_n, grads_n = _step_grads(model, split, loss_of)
    assert loss_n == pytest.approx(loss_1, abs=1e-9)
    assert sum(g.norm() ** 2 for g in grads_1.values()) > 1e-6  # the gradient is not trivially 0
    for name, g in grads_1.items():
        torch.testing.assert_close(grads_n[name], g, atol=1e-6, rtol=0, msg=name)


def _policy_step_table(model, n=14, seed=0):
    """Toy-like rows whose behavior_logprobs are the model's own plus noise (ratios off 1, some
    clipped), advantages ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    prompts = [[1] + p for p in _random_lists(rng, n, 2, 8)]
    responses = _random_lists(rng, n, 1, 10)
    table = _policy_table(prompts, responses, advantage=rng.normal(size=n).tolist())
    (batch,) = policy_batches(table, 100_000)
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
    behavior = [None] * n
    for j, row in enumerate(batch.rows.tolist()):
        own = logp[j][batch.target_mask[j]].numpy()
        behavior[row] = (own + rng.normal(scale=0.3, size=own.size)).astype(np.float32).tolist()
    return table.append_column("behavior_logprobs", pa.array(behavior, LOGPROBS))


@pytest.fixture(scope="module")
def policy_step_table(toy64):
    return _policy_step_table(toy64)


@pytest.mark.parametrize("loss_name,cfg", [
    ("grpo", ObjectiveConfig(agg="token-mean")),
    ("grpo", ObjectiveConfig(agg="seq-mean-token-mean")),
    ("grpo", ObjectiveConfig(agg="seq-mean-token-sum-norm", norm_len=32)),
    ("grpo", ObjectiveConfig(agg="token-mean", beta=0.05, dual_clip=3.0)),  # + KL to a reference
    ("gspo", ObjectiveConfig(eps_low=0.05, eps_high=0.08)),
    ("gspo_token", ObjectiveConfig(eps_low=0.05, eps_high=0.08)),
    ("sft", ObjectiveConfig(agg="seq-mean-token-mean")),
], ids=["grpo-token-mean", "grpo-seq-mean-token-mean", "grpo-seq-mean-token-sum-norm", "grpo-kl",
        "gspo", "gspo-token", "sft"])
def test_policy_loss_split_invariance(toy64, policy_step_table, loss_name, cfg):
    table = policy_step_table
    loss_fn = get_policy_loss(loss_name)

    def loss_of(logp, batch, norm):
        old = batch.old_logp.to(logp.dtype)
        ref = old - 0.1 if cfg.beta > 0 else None  # any fixed tensor will do as a reference
        loss, metrics = loss_fn(logp, old, batch.advantages.to(logp.dtype), batch.target_mask, cfg,
                                ref_logp=ref, norm=norm)
        return loss

    _assert_split_invariant(toy64, lambda budget: policy_batches(table, budget), loss_of)


def test_policy_split_invariance_clips_something(toy64, policy_step_table):
    """The invariance above is not vacuous: the noisy behavior log-probs put ratios on both
    sides of the clip range."""
    table = policy_step_table
    (batch,) = policy_batches(table, 100_000)
    logp = token_logprobs(toy64, batch.input_ids, batch.attention_mask, batch.target_mask)
    _, metrics = get_policy_loss("grpo")(logp, batch.old_logp.double(), batch.advantages.double(),
                                         batch.target_mask, ObjectiveConfig())
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0


@pytest.mark.parametrize("cfg", [ObjectiveConfig(beta=0.5),
                                 ObjectiveConfig(beta=2.0, gamma=0.3, length_normalize=True)],
                         ids=["sum", "length-normalized"])
def test_pairwise_split_invariance(toy64, cfg):
    rng = np.random.default_rng(1)
    n = 10
    prompts = [[1] + p for p in _random_lists(rng, n, 2, 6)]
    table = _pair_table(prompts, _random_lists(rng, n, 1, 8), _random_lists(rng, n, 1, 8),
                        soft_label=rng.uniform(0.5, 1.0, n).tolist(), weight=rng.uniform(0.2, 2.0, n).tolist())
    loss_fn = get_pair_loss("pairwise")

    def loss_of(logp, batch, norm):
        k = batch.num_pairs
        loss, _ = loss_fn(logp[:k], logp[k:], batch.target_mask[:k], batch.target_mask[k:],
                          batch.soft_label.to(logp.dtype), batch.weight.to(logp.dtype), cfg, norm=norm)
        return loss

    _assert_split_invariant(toy64, lambda budget: pair_batches(table, budget), loss_of)


# ---- share_prompts: each prompt computed once ------------------------------------------------

def test_shared_prompts_layout_exact():
    table = _policy_table(prompts=[[1, 5], [1, 7, 8], [1, 5]], responses=[[9, 10], [11], [12, 13, 14]])
    (batch,) = policy_batches(table, 100, pad_id=0, share_prompts=True)
    assert batch.rows.tolist() == [0, 2, 1]  # a prompt's rows together (first seen first), by length within it
    shared = batch.shared
    # one packed sequence per prompt, in the order the prompts first appear in the micro-batch
    assert shared.input_ids.tolist() == [[1, 5, 9, 10, 12, 13, 14], [1, 7, 8, 11, 0, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4], [0, 1, 2, 3, 0, 0, 0]]
    m = shared.attention_mask[0, 0].int().tolist()
    assert m[1] == [1, 1, 0, 0, 0, 0, 0]  # prompt: causal
    assert m[3] == [1, 1, 1, 1, 0, 0, 0]  # response 1, token 2: the prompt and its own tokens
    assert m[5] == [1, 1, 0, 0, 1, 1, 0]  # response 2, token 2: the prompt and its own tokens, not response 1
    assert shared.attention_mask[1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1, 0]  # padding: itself only
    # row 0's 9, 10 <- packed (0, 1), (0, 2); row 2's 12, 13, 14 <- (0, 1), (0, 4), (0, 5); row 1's 11 <- (1, 2)
    L = 7
    assert shared.source.tolist() == [1, 2, 1, 4, 5, L + 2]
    assert int(batch.target_mask.sum()) == shared.source.numel()


def test_shared_prompts_micro_batches_keep_a_prompts_rows_together_and_count_packed_tokens():
    # 3 prompts x 4 responses of 3 tokens after a 6-token prompt: a packed sequence is 6 + 4 x 3 = 18
    # tokens, so a budget of 40 holds 2 prompts' sequences (2 x 18 = 36); unpacked, 40 holds 4 rows of 9
    prompts = [[1, 2, 3, 4, 5, n] for n in (6, 7, 8) for _ in range(4)]
    responses = [[9, 10, 11]] * 12
    table = _policy_table(prompts=prompts, responses=responses)
    batches = policy_batches(table, 40, pad_id=0, share_prompts=True)
    assert [b.rows.tolist() for b in batches] == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    assert [tuple(b.shared.input_ids.shape) for b in batches] == [(2, 18), (1, 18)]
    assert len(policy_batches(table, 40, pad_id=0)) == 3  # unshared: 4 rows of 9 tokens a micro-batch


def test_shared_prompts_split_layout_exact():
    # max_len 5: prompt [1, 5] (2 tokens) + responses of 2 and 3 tokens would be 7, so the
    # third row starts a second packed sequence that repeats the prompt
    table = _policy_table(prompts=[[1, 5], [1, 5], [1, 5]], responses=[[9], [10, 11], [12, 13, 14]])
    (batch,) = policy_batches(table, 100, pad_id=0, share_prompts=True, shared_max_len=5)
    shared = batch.shared
    assert shared.input_ids.tolist() == [[1, 5, 9, 10, 11], [1, 5, 12, 13, 14]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 2, 3], [0, 1, 2, 3, 4]]
    assert shared.attention_mask[0, 0, 4].int().tolist() == [1, 1, 0, 1, 1]
    assert shared.source.tolist() == [1, 1, 3, 5 + 1, 5 + 2, 5 + 3]


def test_prompt_groups_number_prompts_as_first_seen():
    # a prompt that is a prefix of another, or has the same tokens as int64, is told apart
    # only by its tokens: [1, 2] and [1, 2, 0] differ, the two [1, 2] rows are one group
    table = pa.table({"prompt_token_ids": pa.array([[7], [1, 2], [1, 2, 0], [7], [1, 2]], pa.list_(pa.int64())),
                      "response_token_ids": pa.array([[1]] * 5, IDS)})
    assert prompt_groups(table).tolist() == [0, 1, 2, 0, 1]
    chunked = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    assert prompt_groups(chunked.slice(1)).tolist() == [0, 1, 2, 0]
    assert prompt_groups(table.slice(0, 0)).tolist() == []


def _grouped_table(rng, groups=6, max_group=8):
    prompts, responses = [], []
    for _ in range(groups):
        prompt = [1] + rng.integers(3, 18, size=int(rng.integers(2, 9))).tolist()
        k = int(rng.integers(1, max_group + 1))
        prompts += [prompt] * k
        responses += _random_lists(rng, k, 1, 10)
    n = len(prompts)
    return _policy_table(prompts, responses, logprobs=[(-rng.uniform(0.1, 3, len(r))).tolist() for r in responses],
                         advantage=rng.normal(size=n).tolist())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("max_len", [1024, 24], ids=["one-per-prompt", "split-prompts"])
def test_shared_prompts_give_the_unpacked_logprobs_and_gradient(toy_dir, attn, max_len):
    model = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32,
                                                 attn_implementation=attn).to(torch.float64)
    table = _grouped_table(np.random.default_rng(5))
    (plain,) = policy_batches(table, 100_000)
    (shared,) = policy_batches(table, 100_000, share_prompts=True, shared_max_len=max_len)
    assert shared.shared.input_ids.numel() < plain.input_ids.numel()  # fewer tokens to run
    if max_len == 24:  # some prompt's responses went to two packed sequences
        assert shared.shared.input_ids.shape[0] > len(set(map(tuple, table.column("prompt_token_ids").to_pylist())))
        assert shared.shared.input_ids.shape[1] <= 24 + 9
    lp_plain = token_logprobs(model, plain.input_ids, plain.attention_mask, plain.target_mask)
    lp_shared = token_logprobs(model, shared.input_ids, shared.attention_mask, shared.target_mask,
                               shared=shared.shared)
    # eager attention takes its softmax in float32 whatever the model's dtype: rounding, not a bug
    atol, grad_atol = (1e-10, 1e-6) if attn == "sdpa" else (1e-5, 1e-4)
    # row by row (share_prompts orders a micro-batch's rows by prompt, the plain batch by length)
    torch.testing.assert_close(lp_shared[torch.argsort(shared.rows)], lp_plain[torch.argsort(plain.rows)],
                               atol=atol, rtol=0)
    cfg = ObjectiveConfig(agg="token-mean")

    def loss_of(logp, batch, norm):
        return get_policy_loss("grpo")(logp, batch.old_logp.to(logp.dtype), batch.advantages.to(logp.dtype),
                                       batch.target_mask, cfg, norm=norm)[0]

    loss_1, grads_1 = _step_grads(model, [plain], loss_of)
    loss_2, grads_2 = _step_grads(model, policy_batches(table, 60, share_prompts=True, shared_max_len=max_len),
                                  loss_of)  # split into micro-batches too
    assert loss_2 == pytest.approx(loss_1, abs=grad_atol)
    assert sum(g.norm() ** 2 for g in grads_1.values()) > 1e-6
    for name, g in grads_1.items():
        torch.testing.assert_close(grads_2[name], g, atol=grad_atol, rtol=0, msg=name)
