"""curation/stages/label.py: golden advantages for every estimator, their invariants, and the
filter -> label invariant (every row in exactly one of groups or rejects) on real runs."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from curation.stages import filter as filter_stage
from curation.stages import label as label_stage
from curation.stages.filter import FilterConfig
from curation.stages.label import SCALE_REWARDS, LabelConfig, estimator_name, kept_with_rewards, label
from curation.stages.runner import as_dict, run_stage
from store.fingerprints import fingerprint_file
from store.layout import part_name
from store.run_store import RunStore
from store.schema import SCHEMAS, empty
from tests.helpers import commit_inputs, group_rows, rejects_of, rewards_table, samples_and_scores
from training.advantages import GroupedRewards, advantage_names, get_advantage, register_advantage

EPS = 1e-4


def by_group(groups: pa.Table, column: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for row in groups.to_pylist():
        out.setdefault(row["prompt_id"], []).append(row[column])
    return out


GOLDEN = {"a": [1, 0, 0, 1], "b": [0.2, 0.5, 0.9], "flat": [1, 1], "alone": [0.7]}
# a: mean 1/2, sample std sqrt((4 * 1/4) / 3) = sqrt(1/3)
# b: mean 1.6/3; deviations -1/3, -1/30, 11/30; sample std sqrt((1/9 + 1/900 + 121/900) / 2) = sqrt(0.37/3)
STD_A, STD_B = math.sqrt(1 / 3), math.sqrt(0.37 / 3)
CENTRED = {"a": [0.5, -0.5, -0.5, 0.5], "b": [-1 / 3, -1 / 30, 11 / 30], "flat": [0, 0], "alone": [0]}


def assert_close(got: dict[str, list[float]], expected: dict[str, list[float]]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-12), key


def test_group_columns():
    groups = label(rewards_table(GOLDEN), LabelConfig())
    assert groups.schema == SCHEMAS["groups"]
    assert_close(by_group(groups, "group_mean"), {"a": [0.5] * 4, "b": [1.6 / 3] * 3, "flat": [1, 1], "alone": [0.7]})
    assert_close(by_group(groups, "group_std"), {"a": [STD_A] * 4, "b": [STD_B] * 3, "flat": [0, 0], "alone": [0]})
    assert by_group(groups, "group_kept") == {"a": [True] * 4, "b": [True] * 3, "flat": [False] * 2, "alone": [False]}
    assert by_group(groups, "reward") == {k: [float(r) for r in v] for k, v in GOLDEN.items()}


def test_grpo_golden():
    groups = label(rewards_table(GOLDEN), LabelConfig(estimator="grpo"))
    expected = {"a": [c / (STD_A + EPS) for c in CENTRED["a"]], "b": [c / (STD_B + EPS) for c in CENTRED["b"]],
                "flat": [0, 0], "alone": [0]}
    assert_close(by_group(groups, "advantage"), expected)
    assert by_group(groups, "advantage")["a"][0] == pytest.approx(0.5 / (0.5773502691896257 + 1e-4))


def test_dr_grpo_golden():
    groups = label(rewards_table(GOLDEN), LabelConfig(estimator="dr_grpo"))
    assert_close(by_group(groups, "advantage"), CENTRED)


def test_rloo_golden():
    groups = label(rewards_table(GOLDEN), LabelConfig(estimator="rloo"))
    # r minus the mean of the others: a: 1 - 1/3, 0 - 2/3; b: 0.2 - 0.7, 0.5 - 0.55, 0.9 - 0.35
    expected = {"a": [2 / 3, -2 / 3, -2 / 3, 2 / 3], "b": [-0.5, -0.05, 0.55], "flat": [0, 0], "alone": [0]}
    assert_close(by_group(groups, "advantage"), expected)


def test_batch_golden():
    groups = label(rewards_table(GOLDEN), LabelConfig(estimator="batch"))
    # the 7 centred values of the kept groups a and b (mean 0): sample std sqrt((1 + 2.22/9) / 6)
    std_batch = math.sqrt((4 * 0.25 + (1 / 9 + 1 / 900 + 121 / 900)) / 6)
    expected = {k: [c / (std_batch + EPS) for c in v] for k, v in CENTRED.items()}
    assert_close(by_group(groups, "advantage"), expected)
    # zero-variance groups are not part of std_batch: dropping them changes no advantage
    only_kept = label(rewards_table({"a": GOLDEN["a"], "b": GOLDEN["b"]}), LabelConfig(estimator="batch"))
    assert_close(by_group(only_kept, "advantage"), {"a": expected["a"], "b": expected["b"]})


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_scale_rewards_golden(scale):
    """TRL's scale_rewards with the grpo estimator: r - mean over the group's std, nothing, or
    the std of r - mean over the round's kept groups; the same labels as grpo, dr_grpo, batch."""
    std_batch = math.sqrt((4 * 0.25 + (1 / 9 + 1 / 900 + 121 / 900)) / 6)
    by_scale = {"group": {"a": STD_A + EPS, "b": STD_B + EPS}, "none": {"a": 1.0, "b": 1.0},
                "batch": {"a": std_batch + EPS, "b": std_batch + EPS}}[scale]
    expected = {k: [c / by_scale.get(k, 1.0) for c in v] for k, v in CENTRED.items()}
    scaled = label(rewards_table(GOLDEN), LabelConfig(scale_rewards=scale))
    assert_close(by_group(scaled, "advantage"), expected)
    shorthand = label(rewards_table(GOLDEN), LabelConfig(estimator=SCALE_REWARDS[scale]))
    assert scaled.equals(shorthand)
    assert label(rewards_table(GOLDEN), LabelConfig(estimator=SCALE_REWARDS[scale], scale_rewards=scale)).equals(scaled)
    # batch needs the whole round, whichever way it is named
    assert label_stage.sliceable(LabelConfig(scale_rewards=scale)) == (scale != "batch")


def test_scale_rewards_names_one_estimator_and_leaves_old_configs_hashes_alone():
    assert estimator_name(LabelConfig()) == "grpo" and estimator_name(LabelConfig(estimator="rloo")) == "rloo"
    assert estimator_name(LabelConfig(scale_rewards="none")) == "dr_grpo"
    # unset, it is not in the dump that a stage's config hash is taken of
    assert as_dict(LabelConfig()) == {"estimator": "grpo", "eps": 1e-4}
    assert as_dict(LabelConfig(scale_rewards="batch"))["scale_rewards"] == "batch"
    with pytest.raises(ValidationError, match=r"estimator 'dr_grpo' is grpo with scale_rewards = 'none', not "
                                              r"'group': set estimator = 'grpo' and scale_rewards = 'group'"):
        LabelConfig(estimator="dr_grpo", scale_rewards="group")
    with pytest.raises(ValidationError, match=r"scale_rewards applies to the grpo estimator .*not 'rloo'"):
        LabelConfig(estimator="rloo", scale_rewards="none")
    with pytest.raises(ValidationError, match=r"Input should be 'group', 'batch' or 'none'"):
        LabelConfig(scale_rewards="std")


def test_batch_statistics_are_per_round():
    both = pa.concat_tables([rewards_table({"a": [1, 0]}), rewards_table({"a": [10, 0, 5]}, round=1)])
    groups = label(both, LabelConfig(estimator="batch", eps=0))
    round0 = [a for a, r in zip(groups.column("advantage").to_pylist(), groups.column("round").to_pylist()) if r == 0]
    assert round0 == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])  # centred +-0.5, std sqrt(1/2)


def test_rows_keep_their_order_and_keys():
    table = rewards_table(GOLDEN).take([5, 0, 8, 1, 2, 9, 3, 4, 6, 7])  # groups not adjacent
    groups = label(table, LabelConfig())
    assert groups.select(["run_id", "round", "prompt_id", "sample_idx", "reward"]).to_pylist() == table.to_pylist()
    assert_close(by_group(groups.sort_by([("prompt_id", "ascending"), ("sample_idx", "ascending")]), "advantage"),
                 by_group(label(rewards_table(GOLDEN), LabelConfig()), "advantage"))


def test_null_rewards_and_unknown_keys_are_errors():
    table = rewards_table({"a": [1, 0]})
    with pytest.raises(ValueError, match="1 are null"):
        label(table.set_column(4, "reward", pa.array([1.0, None])), LabelConfig())
    with pytest.raises(ValidationError, match="estimator"):
        LabelConfig(estimator="ppo")
    with pytest.raises(ValidationError, match="epsilon"):
        LabelConfig(epsilon=1e-6)


# ---- properties ----------------------------------------------------------------------------

REWARD = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(-10, 10, allow_nan=False, width=32))
GROUPS = st.dictionaries(st.sampled_from([f"p{i}" for i in range(8)]), st.lists(REWARD, min_size=1, max_size=9),
                         min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(GROUPS)
def test_properties_of_the_estimators(rewards):
    table = rewards_table(rewards)
    out = {est: label(table, LabelConfig(estimator=est)) for est in ("grpo", "dr_grpo", "rloo", "batch")}
    for prompt, rs in rewards.items():
        kept = max(rs) > min(rs)
        assert by_group(out["grpo"], "group_kept")[prompt] == [kept] * len(rs)
        for est in ("grpo", "dr_grpo", "rloo", "batch"):
            advantages = by_group(out[est], "advantage")[prompt]
            if not kept:
                assert advantages == [0.0] * len(rs)
            elif est in ("grpo", "dr_grpo"):
                assert sum(advantages) == pytest.approx(0, abs=1e-9 * (1 + sum(abs(a) for a in advantages)))
        if kept:  # rloo: r minus the mean of the other samples, as written
            others = [(sum(rs) - r) / (len(rs) - 1) for r in rs]
            expected = [r - o for r, o in zip(rs, others)]
            assert by_group(out["rloo"], "advantage")[prompt] == pytest.approx(expected, rel=1e-9, abs=1e-9)
            assert by_group(out["grpo"], "group_std")[prompt][0] > 0


# ---- filter -> label on a run --------------------------------------------------------------

ROW = st.fixed_dictionaries({
    "reward": st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0])),
    "n_tokens": st.integers(0, 6), "response": st.sampled_from(["x", "y", "z"]),
    "finish_reason": st.sampled_from(["stop", "length"]), "scored": st.booleans(),
    "score_rejected": st.integers(0, 5).map(lambda k: k == 0),
})
RUN = st.dictionaries(st.sampled_from([f"p{i}" for i in range(6)]), st.lists(ROW, min_size=1, max_size=6),
                      min_size=1, max_size=5)
FILTERS = st.builds(FilterConfig, drop_zero_variance=st.booleans(), drop_truncated=st.booleans(),
                    drop_duplicates=st.booleans(), min_group_size=st.integers(1, 4),
                    max_response_tokens=st.one_of(st.none(), st.integers(3, 6)),
                    min_response_tokens=st.one_of(st.none(), st.integers(0, 2)),
                    pass_rate_min=st.one_of(st.none(), st.just(0.2)), pass_rate_max=st.one_of(st.none(), st.just(0.8)))


@settings(max_examples=20, deadline=None)
@given(RUN, FILTERS, st.sampled_from(["grpo", "dr_grpo", "rloo", "batch"]), st.sets(st.sampled_from(["p0", "p1"])))
def test_every_row_ends_in_exactly_one_of_groups_or_rejects(groups, cfg, estimator, whole_prompts_rejected):
    rows = [{"prompt_id": p, "sample_idx": i, **row} for p, rs in groups.items() for i, row in enumerate(rs)]
    earlier = [(r["prompt_id"], r["sample_idx"]) for r in rows if r["score_rejected"]]
    earlier += [(p, None) for p in sorted(whole_prompts_rejected)]
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(tmp)
        commit_inputs(store, 0, *samples_and_scores(rows), score_rejects=rejects_of(earlier))
        filtered = run_stage(filter_stage, store.root, 0, cfg)
        labelled = run_stage(label_stage, store.root, 0, LabelConfig(estimator=estimator))
        store.refresh()  # the stages' commits
        groups_keys = [(g["prompt_id"], g["sample_idx"]) for g in store.read("groups", 0).to_pylist()]
        rejects = store.read("rejects", 0).to_pylist()

    everything = {(r["prompt_id"], r["sample_idx"]) for r in rows}
    by_prompt = {r["prompt_id"] for r in rejects if r["sample_idx"] is None}
    rejected = {(r["prompt_id"], r["sample_idx"]) for r in rejects if r["sample_idx"] is not None}
    rejected |= {key for key in everything if key[0] in by_prompt}
    filter_keys = [(r["prompt_id"], r["sample_idx"]) for r in rejects if r["stage"] == "filter"]
    assert len(groups_keys) == len(set(groups_keys)) and len(filter_keys) == len(set(filter_keys))
    assert not set(groups_keys) & rejected
    assert set(groups_keys) | rejected == everything
    assert not set(filter_keys) & {k for k in earlier if k[1] is not None}  # never rejected twice
    assert labelled.rows_in == labelled.rows_out == len(groups_keys) == filtered.rows_out


def test_kept_with_rewards_needs_the_filter_first():
    samples, scores = samples_and_scores(group_rows({"a": [1, None, 0]}))
    with pytest.raises(ValueError, match="run the filter stage first"):
        kept_with_rewards(samples, scores, empty("rejects"))
    kept, gid = kept_with_rewards(samples, scores, rejects_of([("a", 1)], stage="filter", reason="unscored"))
    assert gid.tolist() == [0, 0]
    assert kept.column("sample_idx").to_pylist() == [0, 2] and kept.column("reward").to_pylist() == [1.0, 0.0]


def test_run_is_idempotent_and_a_new_round_leaves_the_old_one_alone(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0, 0, 1], "b": [1, 1]})))
    run_stage(filter_stage, store.root, 0)
    report = run_stage(label_stage, store.root, 0)
    assert not report.skipped and report.rows_in == report.rows_out == 4
    store.refresh()
    manifest = store.load_manifest("label", 0)
    assert manifest["rows_in"] == 4 and manifest["drops"] == {} and manifest["outputs"] == store.files("groups", 0)
    assert [part_name(rel) for rel in manifest["outputs"]] == ["label"]
    part = store.root / manifest["outputs"][0]
    stamp = (part.stat().st_mtime_ns, fingerprint_file(part))
    assert run_stage(label_stage, store.root, 0).skipped
    assert (part.stat().st_mtime_ns, fingerprint_file(part)) == stamp

    store.refresh()
    commit_inputs(store, 1, *samples_and_scores(group_rows({"c": [0.2, 0.5, 0.9]}), round=1))
    run_stage(filter_stage, store.root, 1)
    assert not run_stage(label_stage, store.root, 1).skipped
    assert run_stage(label_stage, store.root, 0).skipped
    store.refresh()
    assert store.load_manifest("label", 0) == manifest and store.files("groups", 0) == manifest["outputs"]
    assert (part.stat().st_mtime_ns, fingerprint_file(part)) == stamp
    assert store.read("groups").num_rows == 7

    # new rejects (the filter rerun with another config) make label rerun
    run_stage(filter_stage, store.root, 0, FilterConfig(min_group_size=5))
    rerun = run_stage(label_stage, store.root, 0)
    assert not rerun.skipped and rerun.rows_out == 0
    assert not run_stage(label_stage, store.root, 0, LabelConfig(estimator="rloo")).skipped


def test_empty_inputs_give_empty_tables():
    assert label(rewards_table({}), LabelConfig()).num_rows == 0
    samples, scores = samples_and_scores([])
    assert kept_with_rewards(samples, scores, empty("rejects"))[0].num_rows == 0


def test_transform_labels_the_unrejected_samples_and_counts_kept_groups():
    samples, scores = samples_and_scores(group_rows({"a": [1, 0, 0.5], "b": [1, 1], "c": [0.2, 0.9]}))
    rejects = rejects_of([("a", 2), ("c", None)], stage="filter", reason="duplicate")
    out = label_stage.transform({"samples": samples, "scores": scores, "rejects": rejects}, LabelConfig())
    groups = out.tables["groups"]
    assert list(out.tables) == ["groups"] and (out.rows_in, out.rows_out) == (4, 4)
    assert out.extra == {"rows_in_kept_groups": 2} and out.drops == {}
    assert [(g["prompt_id"], g["sample_idx"], g["group_kept"]) for g in groups.to_pylist()] == [
        ("a", 0, True), ("a", 1, True), ("b", 0, False), ("b", 1, False)]
    assert groups.equals(label(kept_with_rewards(samples, scores, rejects)[0], LabelConfig()))


# ---- the estimator registry ------------------------------------------------------------------

@register_advantage("test_sign")
def sign_advantage(rows: GroupedRewards, eps: float) -> np.ndarray:
    """A = sign(r - mean): an estimator registered outside groupforge's own module."""
    return np.sign(rows.reward - rows.mean)


def test_the_registry_knows_every_estimator_and_names_them_on_an_unknown_one():
    assert advantage_names()[:4] == ("grpo", "dr_grpo", "rloo", "batch")
    assert [get_advantage(name).whole_round for name in ("grpo", "dr_grpo", "rloo", "batch")] == [
        False, False, False, True]
    assert label_stage.sliceable(LabelConfig(estimator="rloo")) and not label_stage.sliceable(
        LabelConfig(estimator="batch"))
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'ppo'; known: grpo, dr_grpo, rloo, batch"):
        get_advantage("ppo")
    with pytest.raises(ValidationError, match="known: grpo, dr_grpo, rloo, batch"):
        LabelConfig(estimator="ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(sign_advantage)


def test_a_registered_estimator_runs_through_the_label_transform():
    samples, scores = samples_and_scores(group_rows({"a": [1, 0, 0.5], "b": [1, 1], "c": [0.2, 0.9, 0.9]}))
    tables = {"samples": samples, "scores": scores, "rejects": empty("rejects")}
    groups = label_stage.transform(tables, LabelConfig(estimator="test_sign")).tables["groups"]
    # a: mean 0.5 -> signs 1, -1, 0; b: all equal -> 0 (not kept); c: mean 2/3 -> -1, 1, 1
    assert by_group(groups, "advantage") == {"a": [1.0, -1.0, 0.0], "b": [0.0, 0.0], "c": [-1.0, 1.0, 1.0]}
    assert label_stage.sliceable(LabelConfig(estimator="test_sign"))
