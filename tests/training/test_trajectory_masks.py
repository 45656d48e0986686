"""Multi-turn rows (response_mask): the losses count only the model's tokens.

Oracles: the logits' gradient from a plain full-logits forward (no chunking, no batching
shortcuts), hand-computed sums over the mask's 1s, and the same rows without a mask
(single-turn), which must train bit for bit as before.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.helpers import trajectory_row
from training.batching import pair_batches, policy_batches, step_normalizer
from training.config import TrainConfig
from training.correction import CorrectionConfig, correction_weights
from training.objectives import ObjectiveConfig, get_pair_loss, get_policy_loss
from training.step import StepContext, accumulate_gradients, pair_micro_step, policy_micro_step

POLICY = ("grpo", "gspo", "gspo_token", "cispo", "sft")

TURNS = [
    [("assistant", [4, 5, 6]), ("tool", [7, 8]), ("assistant", [9, 2])],  # a tool span in the middle
    [("assistant", [4, 5]), ("user", [10, 11, 12]), ("assistant", [6, 7, 3]), ("tool", [8]), ("assistant", [2])],
    [("assistant", [5, 6, 2])],  # one turn
    [("assistant", [9, 4, 5, 6]), ("tool", [7, 8, 11])],  # ends on a tool span (cut by max_tokens)
]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]
CONFIGS = {  # each with a KL term against a reference that differs from the policy
    "grpo": ObjectiveConfig(beta=0.05, agg="token-mean"),
    "gspo": ObjectiveConfig(beta=0.05, eps_low=0.2, eps_high=0.2),
    "gspo_token": ObjectiveConfig(beta=0.05, eps_low=0.2, eps_high=0.2),
    "cispo": ObjectiveConfig(beta=0.05, eps_low=1.0, eps_high=3.0, kl="k3_clamped"),
    "sft": ObjectiveConfig(beta=0.05, agg="seq-mean-token-mean"),
    "pairwise": ObjectiveConfig(beta=0.5),
}


@pytest.fixture(scope="module")
def models(toy_dir):
    """(policy, reference): the toy in float32, and a perturbed copy of it."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(toy_dir / "model", dtype=torch.float32)
    reference = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    reference.requires_grad_(False)
    return policy, reference


def _rows(turns=TURNS, seed: int = 0) -> list[dict]:
    """trajectory_row's rows with varied behavior log-probs on the model's tokens (0.0 on the others)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, spans in enumerate(turns):
        row = trajectory_row(spans, sample_idx=i)
        row["behavior_logprobs"] = [float(np.float32(-rng.uniform(1.5, 3.5))) if m else 0.0
                                    for m in row["response_mask"]]
        rows.append(row)
    return rows


def policy_table(rows: list[dict], mask: bool = True, old: bool = False) -> pa.Table:
    """The policy rows training.data gives: token ids, behavior log-probs, advantage (and the
    response_mask when `mask`; old_logprobs = behavior + 0.1 when `old`: decoupled mode)."""
    columns = {
        "prompt_token_ids": pa.array([r["prompt_token_ids"] for r in rows], pa.list_(pa.int32())),
        "response_token_ids": pa.array([r["response_token_ids"] for r in rows], pa.list_(pa.int32())),
        "behavior_logprobs": pa.array([r["behavior_logprobs"] for r in rows], pa.list_(pa.float32())),
        "advantage": pa.array(ADVANTAGES[: len(rows)], pa.float64()),
    }
    if old:
        columns["old_logprobs"] = pa.array([[v + 0.1 if m else 0.0 for v, m in zip(r["behavior_logprobs"],
                                                                                   r["response_mask"])]
                                            for r in rows], pa.list_(pa.float32()))
    if mask:
        columns["response_mask"] = pa.array([r["response_mask"] for r in rows], pa.list_(pa.int8()))
    return pa.table(columns)


def pair_table(rows: list[dict], mask: bool = True) -> pa.Table:
    """Pairs (row 0 over row 1, row 2 over row 3) as training.data gives them."""
    chosen, rejected = [rows[0], rows[2]], [rows[1], rows[3]]
    columns = {
        "prompt_token_ids": pa.array([r["prompt_token_ids"] for r in chosen], pa.list_(pa.int32())),
        "chosen_token_ids": pa.array([r["response_token_ids"] for r in chosen], pa.list_(pa.int32())),
        "rejected_token_ids": pa.array([r["response_token_ids"] for r in rejected], pa.list_(pa.int32())),
        "soft_label": pa.array([0.9, 0.7]), "weight": pa.array([1.0, 0.5]),
    }
    if mask:
        columns["chosen_response_mask"] = pa.array([r["response_mask"] for r in chosen], pa.list_(pa.int8()))
        columns["rejected_response_mask"] = pa.array([r["response_mask"] for r in rejected], pa.list_(pa.int8()))
    return pa.table(columns)


def masked_positions(mb, rows: list[dict]) -> tuple[set, set]:
    """(positions predicting a tool/environment token, positions predicting a model token) of the
    micro-batch, (sequence, t) with t = prompt length - 1 + k for response token k, from the rows
    (a pair micro-batch: pair_table's pairs of them)."""
    tool, model = set(), set()
    for b, row in enumerate(mb.rows.tolist()):
        if mb.num_pairs:  # pair_table: pair j is rows 2j (chosen) and 2j+1 (rejected)
            row = 2 * row + (b >= mb.num_pairs)
        r = rows[row]
        p = len(r["prompt_token_ids"])
        for k, m in enumerate(r["response_mask"]):
            (model if m else tool).add((b, p - 1 + k))
    return tool, model


def full_logits_logp(model, mb, target_mask=None):
    """Plain full-logits log-probs (B, L-1) and the logits (retaining their gradient)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    if logits.requires_grad:
        logits.retain_grad()
    target_mask = mb.target_mask if target_mask is None else target_mask
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    return logits, logp.masked_fill(~target_mask, 0.0)


# ---- (a) no gradient at the tool/environment tokens -------------------------------------

@pytest.mark.parametrize("objective", POLICY + ("pairwise",))
def test_the_logits_get_exactly_zero_gradient_where_a_tool_token_is_predicted(models, objective):
    policy, reference = models
    rows = _rows()
    pairwise = objective == "pairwise"
    table = pair_table(rows) if pairwise else policy_table(rows, old=objective != "sft")
    (mb,) = pair_batches(table, 10_000) if pairwise else policy_batches(table, 10_000)
    tool, model = masked_positions(mb, rows)
    expected = torch.zeros_like(mb.target_mask)
    for b, t in model:
        expected[b, t] = True
    assert torch.equal(mb.target_mask, expected)  # the mask's 1s, shifted to next-token positions

    policy.zero_grad(set_to_none=True)
    logits, logp = full_logits_logp(policy, mb)
    with torch.no_grad():
        ref = full_logits_logp(reference, mb)[1]
    mask = mb.target_mask.float()
    cfg = CONFIGS[objective]
    if pairwise:
        k = mb.num_pairs
        loss, _ = get_pair_loss("pairwise")(logp[:k], logp[k:], mask[:k], mask[k:], mb.soft_label, mb.weight, cfg,
                                            ref_chosen_logp=ref[:k], ref_rejected_logp=ref[k:])
    else:
        weights = {}
        if objective != "sft":  # decoupled mode with a token correction: its weights masked too
            weights["is_weight"] = correction_weights(mb.old_logp, mb.behavior_logp, mask,
                                                      CorrectionConfig("token_truncate", cap=1.05))[0]
        loss, _ = get_policy_loss(objective)(logp, mb.old_logp, mb.advantages, mask, cfg, ref_logp=ref, **weights)
    loss.backward()
    grad = logits.grad[:, :-1]
    assert tool and all(torch.count_nonzero(grad[b, t]) == 0 for b, t in tool)
    assert all(torch.count_nonzero(grad[b, t]) > 0 for b, t in model)  # every model token is trained on


def _hidden_grads(policy):
    """A hook on the decoder body that keeps the gradient of its last hidden states."""
    kept = {}

    def hook(module, args, output):
        output.last_hidden_state.retain_grad()
        kept["hidden"] = output.last_hidden_state

    return kept, policy.model.register_forward_hook(hook)


def _ctx(policy, reference, objective: str, correction: CorrectionConfig | None = None) -> StepContext:
    loss = get_pair_loss("pairwise") if objective == "pairwise" else get_policy_loss(objective)
    return StepContext(policy=policy, reference=reference, loss=loss, objective=CONFIGS[objective], temperature=1.0,
                       pad_id=0, device=torch.device("cpu"), autocast=False, measure_gap=True, correction=correction)


@pytest.mark.parametrize("objective", POLICY + ("pairwise",))
def test_the_trainer_step_gives_no_gradient_where_a_tool_token_is_predicted(models, objective):
    """The trainer's own path (chunked log-probs, the step's normaliser): the hidden state that
    predicts a tool token gets exactly zero gradient."""
    policy, reference = models
    rows = _rows()
    pairwise = objective == "pairwise"
    table = pair_table(rows) if pairwise else policy_table(rows, old=objective != "sft")
    (mb,) = pair_batches(table, 10_000) if pairwise else policy_batches(table, 10_000)
    tool, model = masked_positions(mb, rows)
    correction = None if objective in ("sft", "pairwise") else CorrectionConfig("token_truncate", cap=1.05)
    ctx = _ctx(policy, reference, objective, correction)
    kept, handle = _hidden_grads(policy)
    try:
        policy.zero_grad(set_to_none=True)
        accumulate_gradients(ctx, pair_micro_step if pairwise else policy_micro_step, [mb], policy_version=0)
    finally:
        handle.remove()
    grad = kept["hidden"].grad
    assert all(torch.count_nonzero(grad[b, t]) == 0 for b, t in tool)
    assert all(torch.count_nonzero(grad[b, t]) > 0 for b, t in model)


# ---- (b) what sits at the masked positions does not matter -------------------------------

def _step_loss(models, objective: str, table: pa.Table) -> torch.Tensor:
    policy, reference = models
    pairwise = objective == "pairwise"
    batches = pair_batches(table, 10_000) if pairwise else policy_batches(table, 10_000)
    norm = step_normalizer(batches)
    with torch.no_grad():
        step = pair_micro_step if pairwise else policy_micro_step
        return torch.stack([step(_ctx(policy, reference, objective), mb, norm).loss for mb in batches]).sum()


@pytest.mark.parametrize("objective", POLICY + ("pairwise",))
def test_behavior_logprobs_and_trailing_tool_tokens_at_masked_positions_do_not_change_the_loss(models, objective):
    rows = _rows()
    make = pair_table if objective == "pairwise" else policy_table
    loss = _step_loss(models, objective, make(rows))
    other = copy.deepcopy(rows)
    for row in other:  # any value at the masked tokens: only the model's tokens are read
        row["behavior_logprobs"] = [v if m else -40.0 + k for k, (v, m) in
                                    enumerate(zip(row["behavior_logprobs"], row["response_mask"]))]
    other[3]["response_token_ids"][-3:] = [13, 1, 17]  # the trailing tool span: predicts nothing the loss reads
    assert torch.equal(_step_loss(models, objective, make(other)), loss)
    middle = copy.deepcopy(rows)
    middle[0]["response_token_ids"][3:5] = [13, 1]  # a tool span the later model tokens condition on
    assert not torch.equal(_step_loss(models, objective, make(middle)), loss)


# ---- (c) a one-turn trajectory trains exactly like a single-turn row ----------------------

def _train_one_step(models, objective: str, table: pa.Table) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """One optimizer step (three micro-batches) from a fresh copy of the policy: the step's
    metrics, the gradients and the parameters after the step."""
    policy = copy.deepcopy(models[0])
    pairwise = objective == "pairwise"
    ctx = _ctx(policy, models[1], objective)
    batches = pair_batches(table, 40) if pairwise else policy_batches(table, 40)
    assert len(batches) >= 2
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    metrics = accumulate_gradients(ctx, pair_micro_step if pairwise else policy_micro_step, batches, policy_version=0)
    grads = [p.grad.clone() for p in policy.parameters()]
    optimizer.step()
    return metrics, grads, [p.detach().clone() for p in policy.parameters()]


@pytest.mark.parametrize("objective", POLICY + ("pairwise",))
def test_a_one_turn_trajectory_trains_bit_for_bit_like_a_single_turn_row(models, objective):
    one_turn = [[("assistant", [4, 5, 6, 9, 2])], [("assistant", [4, 5, 10, 11, 6, 7, 3, 2])],
                [("assistant", [5, 6, 2])], [("assistant", [9, 4, 5, 6, 7, 8])]]
    rows = _rows(one_turn)
    make = pair_table if objective == "pairwise" else policy_table
    with_mask, without = make(rows, mask=True), make(rows, mask=False)
    assert without.num_columns == with_mask.num_columns - (2 if objective == "pairwise" else 1)
    a, b = _train_one_step(models, objective, with_mask), _train_one_step(models, objective, without)
    assert a[0] == b[0]  # every metric, the loss first
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


# ---- (d) GSPO's sequence ratio -------------------------------------------------------------

def test_gspo_sequence_ratio_is_the_geometric_mean_over_the_model_tokens(models):
    policy = models[0]
    rows = _rows()
    for i, row in enumerate(rows):
        (mb,) = policy_batches(policy_table([row]), 10_000)
        cfg = ObjectiveConfig(eps_low=0.999, eps_high=1e9)  # no clipping: the loss is -s A
        with torch.no_grad():
            logp = _ctx(policy, None, "gspo").logprobs(policy, mb)
            loss, metrics = get_policy_loss("gspo")(logp, mb.old_logp, torch.ones(1), mb.target_mask, cfg)
            # independently: a full forward over the row, log-softmax at each model token
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            logits = policy(input_ids=ids).logits[0].double().log_softmax(-1)
        p = len(row["prompt_token_ids"])
        diffs = [float(logits[p - 1 + k, token]) - row["behavior_logprobs"][k]
                 for k, (token, m) in enumerate(zip(row["response_token_ids"], row["response_mask"])) if m]
        s = math.exp(sum(diffs) / len(diffs))
        assert metrics["ratio_mean"] == pytest.approx(s, rel=1e-5) and float(loss) == pytest.approx(-s, rel=1e-5)
        if 0 in row["response_mask"]:  # the mean over every response token would differ
            everything = [float(logits[p - 1 + k, t]) - lp for k, (t, lp) in
                          enumerate(zip(row["response_token_ids"], row["behavior_logprobs"]))]
            assert math.exp(sum(everything) / len(everything)) != pytest.approx(s, rel=1e-3), i


# ---- (e) the step's counts are the model's tokens ----------------------------------------

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_normaliser_and_the_aggregations_count_only_model_tokens(models, agg):
    policy = models[0]
    rows = _rows()
    table = policy_table(rows)
    batches = policy_batches(table, 40)
    assert len(batches) >= 2
    model_tokens = [sum(r["response_mask"]) for r in rows]
    assert step_normalizer(batches).num_tokens == sum(model_tokens) < sum(len(r["response_mask"]) for r in rows)
    # the sft loss by hand: -log p of each model token, from a full forward of each row alone
    nll = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            logits = policy(input_ids=ids).logits[0].double().log_softmax(-1)
            p = len(row["prompt_token_ids"])
            nll.append([-float(logits[p - 1 + k, t]) for k, (t, m) in
                        enumerate(zip(row["response_token_ids"], row["response_mask"])) if m])
    expected = (sum(map(sum, nll)) / sum(model_tokens) if agg == "token-mean"
                else sum(sum(x) / len(x) for x in nll) / len(nll))
    ctx = StepContext(policy=copy.deepcopy(policy), reference=None, loss=get_policy_loss("sft"),
                      objective=ObjectiveConfig(agg=agg), temperature=1.0, pad_id=0, device=torch.device("cpu"),
                      autocast=False, measure_gap=False)
    metrics = accumulate_gradients(ctx, policy_micro_step, batches, policy_version=0)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["response_tokens"] == sum(model_tokens)


def test_a_mask_of_the_wrong_length_or_values_is_refused():
    rows = _rows()
    table = policy_table(rows)
    short = table.set_column(table.schema.get_field_index("response_mask"), "response_mask",
                             pa.array([r["response_mask"][:-1] for r in rows], pa.list_(pa.int8())))
    with pytest.raises(ValueError, match="^row 0: response_mask has 6 values but response_token_ids has 7 tokens"):
        policy_batches(short, 10_000)
    two = table.set_column(table.schema.get_field_index("response_mask"), "response_mask",
                           pa.array([[1] * 7, [1, 1, 2, 0, 0, 1, 1, 1, 0, 1]] + [r["response_mask"] for r in rows[2:]],
                                    pa.list_(pa.int8())))
    with pytest.raises(ValueError, match=r"^row 1: response_mask has value 2 \(expected 0"):
        policy_batches(two, 10_000)


def test_share_prompts_computes_the_same_log_probs_with_a_mask(models):
    policy = models[0]
    table = policy_table(_rows())
    ctx = _ctx(policy, None, "grpo")
    with torch.no_grad():
        (plain,) = policy_batches(table, 10_000)
        (shared,) = policy_batches(table, 10_000, share_prompts=True)
        assert torch.equal(plain.target_mask, shared.target_mask)
        torch.testing.assert_close(ctx.logprobs(policy, shared), ctx.logprobs(policy, plain), rtol=1e-5, atol=1e-5)


# ---- a real run: committed, labelled, loaded, trained ------------------------------------

def test_a_multi_turn_run_is_labelled_loaded_and_trained_on_the_model_tokens_only(models, toy_dir, tmp_path):
    from curation.stages import filter as filter_stage
    from curation.stages import label as label_stage
    from curation.stages.runner import run_stage
    from store.run_store import RunStore
    from store.schema import SCHEMAS
    from tests.helpers import step_records, trajectory_table
    from training.data import load_training_data
    from training.trainer import train

    rows = []
    for g, prompt in enumerate(("pa", "pb")):
        for i, spans in enumerate(TURNS):
            spans = [(role, [(t + g + i) % 15 + 3 for t in ids]) for role, ids in spans]  # distinct responses
            rows.append(trajectory_row(spans, prompt_id=prompt, sample_idx=i, reward=float(i % 2)))
    samples = trajectory_table(rows)
    scores = pa.Table.from_pylist([{"run_id": "r", "round": 0, "prompt_id": r["prompt_id"],
                                    "sample_idx": r["sample_idx"], "reward": float(r["sample_idx"] % 2),
                                    "scorer": "{}"} for r in rows], schema=SCHEMAS["scores"])
    store = RunStore(tmp_path / "run")
    with store.commit("generate", 0, inputs={}, config={"sampling": {"temperature": 1.0}}) as commit:
        commit.write("samples", samples, part="generate")
    with store.commit("score", 0, inputs={}, config={}) as commit:
        commit.write("scores", scores, part="score")
    run_stage(filter_stage, store.root, 0)
    run_stage(label_stage, store.root, 0)

    data = load_training_data(store.root, "grpo")
    assert data.table.num_rows == len(rows)
    by_key = {(r["prompt_id"], r["sample_idx"]): r["response_mask"] for r in rows}
    assert data.table.column("response_mask").to_pylist() == [
        by_key[key] for key in zip(data.table.column("prompt_id").to_pylist(),
                                   data.table.column("sample_idx").to_pylist())]

    # the step on the loaded rows: no gradient where a tool/environment token is predicted
    policy = copy.deepcopy(models[0])
    ctx = _ctx(policy, models[1], "grpo")
    batches = policy_batches(data.table, 60)
    kept, handle = _hidden_grads(policy)
    grads = []
    try:
        for mb in batches:
            policy.zero_grad(set_to_none=True)
            accumulate_gradients(ctx, policy_micro_step, [mb], policy_version=0)
            grads.append((mb, kept["hidden"].grad))
    finally:
        handle.remove()
    for mb, grad in grads:
        rows_of = [by_key[key] for key in zip(data.table.column("prompt_id").take(mb.rows.numpy()).to_pylist(),
                                              data.table.column("sample_idx").take(mb.rows.numpy()).to_pylist())]
        for b, mask in enumerate(rows_of):
            for k, m in enumerate(mask):
                t = 3 - 1 + k
                assert (torch.count_nonzero(grad[b, t]) > 0) == bool(m), (b, k)

    # and the trainer itself, one step over every row
    cfg = TrainConfig(objective="grpo", batch_size=len(rows), token_budget=60, lr=1e-4)
    train(store.root, cfg, steps=1, model=toy_dir / "model")
    (record,) = step_records(store.root)
    assert record["response_tokens"] == sum(map(sum, by_key.values()))
    assert record["behavior_logp_gap"] > 0 and math.isfinite(record["loss"])


def test_recomputed_old_logprobs_are_the_model_tokens_and_zero_at_the_others(models, tmp_path):
    from store.storage import LocalStorage
    from training.policy import with_recomputed_logprobs

    policy = models[0]
    rows = _rows()
    table = policy_table(rows)
    segment = {"fingerprint": "f" * 64, "start_step": 0}
    out = with_recomputed_logprobs(LocalStorage(tmp_path), table, segment, 0, _ctx(policy, None, "sft"), 40)
    again = with_recomputed_logprobs(LocalStorage(tmp_path), table, segment, 0, _ctx(policy, None, "sft"), 40)
    assert again.column("old_logprobs").equals(out.column("old_logprobs"))  # read back from the cache
    for row, old in zip(rows, out.column("old_logprobs").to_pylist()):
        with torch.no_grad():
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            logits = policy(input_ids=ids).logits[0].double().log_softmax(-1)
        p = len(row["prompt_token_ids"])
        expected = [float(logits[p - 1 + k, t]) if m else 0.0
                    for k, (t, m) in enumerate(zip(row["response_token_ids"], row["response_mask"]))]
        assert old == pytest.approx(expected, abs=1e-5)
        assert [v == 0.0 for v in old] == [m == 0 for m in row["response_mask"]]
