"""pipelines/studies/ratio_spread.py: the bucket statistics against hand computations (the worked example
of docs/objectives.md), on-policy invariance, and a real toy run measured from its checkpoints
and checked against a plain transformers computation."""

from __future__ import annotations

import math
import shutil
import statistics

import numpy as np
import pytest

from pipelines.studies.ratio_spread import COLUMNS, RatioSpreadSkip, length_buckets, ratio_spread, ratio_spread_for_run
from tests.helpers import groupforge_in_process

# docs/objectives.md, "2. Log-probabilities and importance ratios": logp - old_logp of the
# worked group's four responses (lengths 3, 3, 2, 4).
WORKED = [[0.1, 0.25, -0.3497], [-0.3, 0.05, 0.01], [0.1, 0.02], [0.1, 0.4, 0.0, -0.4]]


def _spread(samples, buckets=None, **clip):
    rows = ratio_spread(np.concatenate([np.asarray(s, dtype=float) for s in samples]),
                        [len(s) for s in samples], buckets, **clip).to_pylist()
    return {row["length_lo"]: row for row in rows}


def test_worked_example_by_hand():
    rows = _spread(WORKED, buckets=[1, 2, 4])
    assert sorted(rows) == [2, 4]  # no response of length 1: no row for bucket 1

    # bucket 2..3: responses 0, 1, 2
    short = rows[2]
    ratios = [math.exp(d) for s in WORKED[:3] for d in s]
    seq = [math.exp(sum(s) / len(s)) for s in WORKED[:3]]
    assert seq == pytest.approx([1.0001, 0.9231, 1.0618], abs=1e-4)  # s_i of the doc's gspo table
    assert (short["length_hi"], short["samples"], short["tokens"]) == (3, 3, 8)
    assert short["mean_length"] == pytest.approx(8 / 3)
    assert short["token_ratio_mean"] == pytest.approx(statistics.fmean(ratios), abs=1e-12)
    assert short["token_ratio_std"] == pytest.approx(statistics.pstdev(ratios), abs=1e-12)
    within = [statistics.pstdev([math.exp(d) for d in s]) for s in WORKED[:3]]
    assert short["token_ratio_within_std"] == pytest.approx(statistics.fmean(within), abs=1e-12)
    assert short["seq_ratio_mean"] == pytest.approx(statistics.fmean(seq), abs=1e-12)
    assert short["seq_ratio_std"] == pytest.approx(statistics.pstdev(seq), abs=1e-12)
    assert (short["token_ratio_std"], short["seq_ratio_std"]) == pytest.approx((0.180323, 0.056746), abs=1e-6)
    # grpo's 0.2 / 0.2 range: 1.2840, 0.7049 and 0.7408 are outside; gspo's 3e-4 / 4e-4: 0.9231 and 1.0618
    assert short["token_clip_frac"] == 3 / 8 and short["seq_clip_frac"] == 2 / 3

    # bucket 4..: response 3 alone; its sequence ratio is the geometric mean of its token ratios
    long = rows[4]
    ratios = [math.exp(d) for d in WORKED[3]]
    assert (long["length_hi"], long["samples"], long["tokens"]) == (None, 1, 4)
    assert long["seq_ratio_mean"] == pytest.approx(math.prod(ratios) ** (1 / 4), abs=1e-12)
    assert long["seq_ratio_mean"] == pytest.approx(math.exp(0.025), abs=1e-12)
    assert long["seq_ratio_std"] == 0.0  # one sample
    assert long["token_ratio_std"] == pytest.approx(statistics.pstdev(ratios), abs=1e-12)
    assert long["token_ratio_within_std"] == pytest.approx(long["token_ratio_std"], abs=1e-12)
    assert long["token_clip_frac"] == 2 / 4 and long["seq_clip_frac"] == 1.0  # 1.4918, 0.6703; s = 1.0253


def test_clip_ranges_and_default_buckets():
    # One range for both: at grpo's 0.2 no sequence of the worked group is outside
    rows = _spread(WORKED, buckets=[1, 2, 4], token_clip=(0.2, 0.2), sequence_clip=(0.2, 0.2))
    assert rows[2]["seq_clip_frac"] == 0.0 and rows[4]["seq_clip_frac"] == 0.0
    # eps_low and eps_high are separate: only the high side of 1.0618 / 1.0253 is outside (0.05, 0.02)
    rows = _spread(WORKED, buckets=[1, 2, 4], sequence_clip=(0.1, 0.02))
    assert rows[2]["seq_clip_frac"] == 1 / 3 and rows[4]["seq_clip_frac"] == 1.0

    assert length_buckets(1) == [1] and length_buckets(5) == [1, 2, 4] and length_buckets(8) == [1, 2, 4, 8]
    one_token = [[0.1], [-0.2], [0.3, 0.3], [0.0] * 9]
    rows = _spread(one_token)  # default edges 1, 2, 4, 8
    assert sorted(rows) == [1, 2, 8] and rows[1]["length_hi"] == 1 and rows[2]["length_hi"] == 3
    one = rows[1]  # one-token responses: the sequence ratio is the token ratio, nothing varies within
    assert one["token_ratio_within_std"] == 0.0
    assert one["seq_ratio_std"] == pytest.approx(one["token_ratio_std"], abs=1e-15)
    assert one["seq_ratio_std"] == pytest.approx((math.exp(0.1) - math.exp(-0.2)) / 2, abs=1e-15)
    assert rows[2]["token_ratio_within_std"] == 0.0 and rows[2]["seq_ratio_mean"] == pytest.approx(math.exp(0.3))
    assert rows[8]["samples"] == 1 and rows[8]["mean_length"] == 9.0


def test_on_policy_every_ratio_is_one():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=200)
    behavior = -rng.exponential(2.0, size=int(lengths.sum())).astype(np.float32).astype(np.float64)
    rows = ratio_spread(behavior - behavior, lengths).to_pylist()
    assert sum(r["samples"] for r in rows) == 200 and sum(r["tokens"] for r in rows) == lengths.sum()
    for row in rows:
        assert row["token_ratio_mean"] == 1.0 and row["seq_ratio_mean"] == 1.0
        assert row["token_ratio_std"] == row["token_ratio_within_std"] == row["seq_ratio_std"] == 0.0
        assert row["token_clip_frac"] == row["seq_clip_frac"] == 0.0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="lengths sum to 3"):
        ratio_spread([0.0, 0.0], [1, 2])
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        ratio_spread([0.0], [1, 0])
    with pytest.raises(ValueError, match="sample 1: a log-ratio is -inf"):
        ratio_spread([0.0, 0.1, -np.inf], [1, 2])
    with pytest.raises(ValueError, match="buckets start at length 2"):
        ratio_spread([0.0], [1], buckets=[2, 4])
    with pytest.raises(ValueError, match="ascending"):
        ratio_spread([0.0], [1], buckets=[1, 1])


# ---- a real run -------------------------------------------------------------------------------

SPEC = """
[run]
name = "spread"
rounds = 2
steps_per_round = 2
seed = 1
checkpoint_every = 1

[model]
path = "{toy}/model"

[prompts]
train = ["{toy}/train.parquet"]
eval = "{toy}/eval.parquet"
per_round = 16
eval_limit = 8

[generator]
backend = "hf"
group_size = 4
max_tokens = 6
temperature = 0.8
top_k = 12

[filter]
drop_duplicates = false

[train]
objective = "grpo"
batch_size = 32
token_budget = 256
lr = 5e-5
"""
TEMPERATURE, TOP_K = 0.8, 12


@pytest.fixture(scope="module")
def toy_run(toy_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("spread")
    spec = folder / "spec.toml"
    spec.write_text(SPEC.format(toy=toy_dir))
    run_dir = folder / "run"
    done = groupforge_in_process("run", spec, "--run-dir", run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


def _plain_log_ratios(model_dir, sample) -> np.ndarray:
    """logp - behavior_logprobs of one sample from a full forward pass: logits / T, the top-k
    largest kept (and the sampled token), log_softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt, response = sample["prompt_token_ids"], sample["response_token_ids"]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
    target = torch.tensor(response)
    keep = logits >= logits.topk(TOP_K, dim=-1).values[:, -1:]
    keep[torch.arange(len(response)), target] = True
    logp = logits.masked_fill(~keep, float("-inf")).log_softmax(-1)[torch.arange(len(response)), target]
    return logp.double().numpy() - np.asarray(sample["behavior_logprobs"], dtype=np.float64)


@pytest.mark.slow
def test_toy_run_spread_from_its_checkpoints(toy_run, toy_dir):
    from pipelines.studies.ratio_spread import token_log_ratios
    from store.run_files import MetricsLog
    from store.run_store import RunStore
    from training.checkpoint import load_model

    records = {r["round"]: r for r in MetricsLog(toy_run).rounds()}
    assert [records[r]["policy_version"] for r in (0, 1, 2)] == [0, 2, 4]
    table = ratio_spread_for_run(toy_run)
    assert tuple(table.column_names) == COLUMNS
    rows = table.to_pylist()
    assert sorted({r["round"] for r in rows}) == [1, 2]
    store = RunStore(toy_run)
    for round, (step, version) in {1: (2, 0), 2: (4, 2)}.items():
        mine = [r for r in rows if r["round"] == round]
        samples = store.read_columns("samples", ["response_token_ids"], round)
        assert {(r["checkpoint_step"], r["samples_policy_version"]) for r in mine} == {(step, version)}
        assert sum(r["samples"] for r in mine) == samples.num_rows == records[round]["samples"] == 64
        assert sum(r["tokens"] for r in mine) == sum(len(t) for t in samples.column(0).to_pylist())
        for r in mine:
            assert all(math.isfinite(r[c]) for c in COLUMNS[7:])
            # trained: off-policy, so ratios spread (a spread needs two tokens, or two samples)
            assert r["token_ratio_std"] > 0 or r["tokens"] < 2
            assert r["seq_ratio_std"] > 0 or r["samples"] < 2
        assert any(r["tokens"] >= 2 and r["samples"] >= 2 for r in mine)

    # Round 1 from step-2, recomputed with plain transformers: one sample token by token, then the whole round
    samples = store.read_columns("samples", ["prompt_token_ids", "response_token_ids", "behavior_logprobs",
                                             "policy_version"], 1)
    model = load_model(toy_run / "checkpoints" / "step-2")
    d, lengths = token_log_ratios(model, samples, temperature=TEMPERATURE, top_k=TOP_K)
    sample = samples.slice(5, 1).to_pylist()[0]
    start = int(lengths[:5].sum())
    np.testing.assert_allclose(d[start : start + lengths[5]], _plain_log_ratios(toy_run / "checkpoints" / "step-2",
                                                                               sample), rtol=0, atol=1e-5)
    plain = [_plain_log_ratios(toy_run / "checkpoints" / "step-2", s) for s in samples.to_pylist()]
    expected = ratio_spread(np.concatenate(plain), [len(p) for p in plain], length_buckets(6)).to_pylist()
    got = [r for r in rows if r["round"] == 1]
    assert [r["length_lo"] for r in got] == [r["length_lo"] for r in expected]
    for g, e in zip(got, expected):
        for column in e:
            assert g[column] == pytest.approx(e[column], abs=1e-5), column

    # At the weights that sampled round 1 (the start model, policy_version 0) the ratios are 1 up to
    # float error, under the sampling temperature and top_k; under another temperature they are not.
    assert set(samples.column("policy_version").to_pylist()) == {0}
    start_model = load_model(toy_dir / "model")
    on_policy, _ = token_log_ratios(start_model, samples, temperature=TEMPERATURE, top_k=TOP_K)
    assert np.abs(on_policy).max() < 1e-4
    wrong, _ = token_log_ratios(start_model, samples, temperature=1.0, top_k=TOP_K)
    assert np.abs(wrong).max() > 1e-2


@pytest.mark.slow
def test_rounds_without_a_checkpoint_are_skipped(toy_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(toy_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-2")
    assert sorted({r["round"] for r in ratio_spread_for_run(run_dir).to_pylist()}) == [2]  # default: what can be
    with pytest.warns(RatioSpreadSkip) as caught:
        table = ratio_spread_for_run(run_dir, rounds=[1, 7], buckets=[1, 4])
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "round 1 skipped: no checkpoint of steps 1..2" in messages[0]
    assert "round 7 skipped: no samples" in messages[1]
    assert table.num_rows == 0 and tuple(table.column_names) == COLUMNS
