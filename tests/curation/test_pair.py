"""curation/stages/pair.py: golden pairs for every strategy, label and weight; the pair rules
as properties; the stage on a real run."""

from __future__ import annotations

import hashlib
import itertools
import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from curation.stages import filter as filter_stage
from curation.stages import label as label_stage
from curation.stages import pair as pair_stage
from curation.stages.label import LabelConfig, label
from curation.stages.pair import PairConfig
from curation.stages.runner import run_stage
from store.fingerprints import fingerprint_file
from store.layout import part_name
from store.run_store import RunStore
from store.schema import SCHEMAS
from tests.helpers import commit_inputs, group_rows, rewards_table, samples_and_scores


def pair(groups: pa.Table, cfg: PairConfig) -> pa.Table:
    """The pairs the pair stage's transform makes of `groups`."""
    out = pair_stage.transform({"groups": groups}, cfg)
    assert out.rows_in == sum(groups.column("group_kept").to_pylist()) and out.rows_out == out.tables["pairs"].num_rows
    return out.tables["pairs"]


def groups_of(rewards: dict[str, list[float]], round: int = 0) -> pa.Table:
    return label(rewards_table(rewards, round), LabelConfig())


def pairs_of(rewards: dict[str, list[float]], **cfg) -> list[tuple[str, int, int]]:
    out = pair(groups_of(rewards), PairConfig(**cfg))
    return [(p["prompt_id"], p["chosen_idx"], p["rejected_idx"]) for p in out.to_pylist()]


GOLDEN = {"a": [1, 0, 0, 1], "b": [0.2, 0.5, 0.9]}


def test_max_min_golden():
    out = pair(groups_of(GOLDEN), PairConfig(strategy="max_min"))
    assert out.schema == SCHEMAS["pairs"]
    # a: best 1.0 at 0 and 3 -> 0; worst 0.0 at 1 and 2 -> 1 (lowest sample_idx among ties)
    assert out.to_pylist() == [
        {"run_id": "r", "round": 0, "prompt_id": "a", "chosen_idx": 0, "rejected_idx": 1, "chosen_reward": 1.0,
         "rejected_reward": 0.0, "margin": 1.0, "soft_label": pytest.approx(1 / (1 + math.exp(-4))), "weight": 1.0},
        {"run_id": "r", "round": 0, "prompt_id": "b", "chosen_idx": 2, "rejected_idx": 0, "chosen_reward": 0.9,
         "rejected_reward": 0.2, "margin": pytest.approx(0.7), "soft_label": pytest.approx(1 / (1 + math.exp(-2.8))),
         "weight": 1.0},
    ]


def test_all_pairs_golden():
    assert pairs_of(GOLDEN, strategy="all_pairs") == [
        ("a", 0, 1), ("a", 0, 2), ("a", 3, 1), ("a", 3, 2), ("b", 1, 0), ("b", 2, 0), ("b", 2, 1)]


def test_top_k_vs_bottom_k_golden():
    assert pairs_of(GOLDEN, strategy="top_k_vs_bottom_k", k=1) == pairs_of(GOLDEN, strategy="max_min")
    # a: top 2 = {0, 3}, bottom 2 = {1, 2}; b: top 2 = {2, 1}, bottom 2 = {0, 1}, and 1 vs 1 is no pair
    assert pairs_of(GOLDEN, strategy="top_k_vs_bottom_k", k=2) == [
        ("a", 0, 1), ("a", 0, 2), ("a", 3, 1), ("a", 3, 2), ("b", 1, 0), ("b", 2, 0), ("b", 2, 1)]
    # c: top 2 = {3 (0.8), 0 (0.5)}, bottom 2 = {2 (0.1), 0 (0.5)}: of the 0.5s, 0 comes first both ways
    assert pairs_of({"c": [0.5, 0.5, 0.1, 0.8, 0.5]}, strategy="top_k_vs_bottom_k", k=2) == [
        ("c", 0, 2), ("c", 3, 0), ("c", 3, 2)]


def md5_draw(seed: int, prompt_id: str, n: int) -> int:
    """The documented draw: the first 15 hex digits of md5('<seed>:<prompt_id>'), mod n."""
    return int(hashlib.md5(f"{seed}:{prompt_id}".encode()).hexdigest()[:15], 16) % n


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_max_random_golden(seed):
    # a: best 0; lower ones 1, 2 (by sample_idx). b: best 2; lower ones 0, 1.
    expected = [("a", 0, [1, 2][md5_draw(seed, "a", 2)]), ("b", 2, [0, 1][md5_draw(seed, "b", 2)])]
    assert pairs_of(GOLDEN, strategy="max_random", seed=seed) == expected
    # min_margin 0.5 leaves b one lower sample (0.2); a is unchanged
    assert pairs_of(GOLDEN, strategy="max_random", seed=seed, min_margin=0.5) == [expected[0], ("b", 2, 0)]


def test_max_random_draws_spread_over_the_lower_samples():
    rewards = {f"p{i}": [1, 0, 0, 0, 0] for i in range(400)}
    drawn = [rejected for _, _, rejected in pairs_of(rewards, strategy="max_random", seed=3)]
    counts = [drawn.count(i) for i in (1, 2, 3, 4)]
    assert sum(counts) == 400 and min(counts) > 60  # ~100 each
    assert drawn != [r for _, _, r in pairs_of(rewards, strategy="max_random", seed=4)]


def test_min_margin_soft_labels_and_weights():
    assert pairs_of(GOLDEN, strategy="all_pairs", min_margin=0.5) == [
        ("a", 0, 1), ("a", 0, 2), ("a", 3, 1), ("a", 3, 2), ("b", 2, 0)]
    hard = pair(groups_of(GOLDEN), PairConfig(strategy="all_pairs", hard=True)).column("soft_label").to_pylist()
    assert hard == [1.0] * 7
    soft = pair(groups_of(GOLDEN), PairConfig(strategy="all_pairs", tau=0.1))
    margins = [1, 1, 1, 1, 0.3, 0.7, 0.4]
    assert soft.column("margin").to_pylist() == pytest.approx(margins)
    assert soft.column("soft_label").to_pylist() == pytest.approx([1 / (1 + math.exp(-m / 0.1)) for m in margins])
    by_margin = pair(groups_of(GOLDEN), PairConfig(strategy="all_pairs", weight="margin"))
    assert by_margin.column("weight").to_pylist() == pytest.approx(margins)
    by_group = pair(groups_of(GOLDEN), PairConfig(strategy="all_pairs", weight="group"))
    assert by_group.column("weight").to_pylist() == pytest.approx([1 / 4] * 4 + [1 / 3] * 3)


def test_ties_and_dropped_groups_never_pair():
    assert pairs_of({"flat": [1, 1, 1], "tie": [0.5, 0.5, 0.2]}, strategy="all_pairs", min_margin=0) == [
        ("tie", 0, 2), ("tie", 1, 2)]
    groups = groups_of(GOLDEN)
    dropped = groups.set_column(8, "group_kept", pa.array([False] * 4 + [True] * 3))
    assert [p["prompt_id"] for p in pair(dropped, PairConfig(strategy="all_pairs")).to_pylist()] == ["b"] * 3


def test_rows_come_by_group_in_order_of_appearance():
    groups = pa.concat_tables([groups_of({"z": [0, 1]}), groups_of({"a": [1, 0]}), groups_of({"m": [1, 0]}, round=1)])
    assert [(p["round"], p["prompt_id"]) for p in pair(groups, PairConfig()).to_pylist()] == [
        (0, "z"), (0, "a"), (1, "m")]


def test_config_rejects_unknown_keys():
    with pytest.raises(ValidationError, match="strategy"):
        PairConfig(strategy="best_of_n")
    with pytest.raises(ValidationError, match="margin"):
        PairConfig(margin=0.1)
    with pytest.raises(ValidationError, match="tau"):
        PairConfig(tau=0)


# ---- properties ----------------------------------------------------------------------------

REWARD = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(-5, 5, allow_nan=False, width=32))
GROUPS = st.dictionaries(st.sampled_from([f"p{i}" for i in range(6)]), st.lists(REWARD, min_size=1, max_size=8),
                         min_size=1, max_size=5)
CONFIGS = st.builds(PairConfig, strategy=st.sampled_from(["max_min", "all_pairs", "max_random", "top_k_vs_bottom_k"]),
                    k=st.integers(1, 4), min_margin=st.sampled_from([0.0, 1e-6, 0.25, 0.5]),
                    seed=st.integers(0, 3), weight=st.sampled_from(["uniform", "margin", "group"]))


@settings(max_examples=50, deadline=None)
@given(GROUPS, CONFIGS)
def test_pair_rules_hold(rewards, cfg):
    out = pair(groups_of(rewards), cfg).to_pylist()
    seen = set()
    for p in out:
        rs = rewards[p["prompt_id"]]
        assert p["chosen_idx"] != p["rejected_idx"]
        assert p["chosen_reward"] == rs[p["chosen_idx"]] and p["rejected_reward"] == rs[p["rejected_idx"]]
        assert p["chosen_reward"] > p["rejected_reward"]
        assert p["chosen_reward"] >= p["rejected_reward"] + cfg.min_margin
        assert p["margin"] == p["chosen_reward"] - p["rejected_reward"] and 0.5 <= p["soft_label"] <= 1
        key = (p["prompt_id"], p["chosen_idx"], p["rejected_idx"])
        assert key not in seen
        seen.add(key)
    possible = {(g, i, j) for g, rs in rewards.items() for i, j in itertools.permutations(range(len(rs)), 2)
                if rs[i] > rs[j] and rs[i] >= rs[j] + cfg.min_margin}
    assert seen <= possible
    if cfg.strategy == "all_pairs":
        assert seen == possible
    if cfg.strategy in ("max_min", "max_random"):  # one pair per group that has one, from its best sample
        assert {g for g, _, _ in seen} == {g for g, _, _ in possible}
        for g, i, _ in seen:
            assert i == rewards[g].index(max(rewards[g]))
    if cfg.strategy == "max_random":  # a function of (seed, prompt_id) and the group only
        reordered = pair(groups_of(dict(reversed(list(rewards.items())))), cfg).to_pylist()
        assert {(p["prompt_id"], p["chosen_idx"], p["rejected_idx"]) for p in reordered} == seen


# ---- the stage on a run --------------------------------------------------------------------


def test_run_is_idempotent_and_a_new_round_leaves_the_old_one_alone(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows(GOLDEN)))
    run_stage(filter_stage, store.root, 0)
    run_stage(label_stage, store.root, 0)
    report = run_stage(pair_stage, store.root, 0)
    assert not report.skipped and report.rows_in == 7 and report.rows_out == 2
    store.refresh()
    manifest = store.load_manifest("pair", 0)
    assert manifest["rows_out"] == 2 and manifest["outputs"] == store.files("pairs", 0)
    assert [part_name(rel) for rel in manifest["outputs"]] == ["pair"]
    part = store.root / manifest["outputs"][0]
    stamp = (part.stat().st_mtime_ns, fingerprint_file(part))
    assert run_stage(pair_stage, store.root, 0).skipped
    assert (part.stat().st_mtime_ns, fingerprint_file(part)) == stamp

    store.refresh()
    commit_inputs(store, 1, *samples_and_scores(group_rows({"c": [0, 1, 1]}), round=1))
    run_stage(filter_stage, store.root, 1)
    run_stage(label_stage, store.root, 1)
    assert run_stage(pair_stage, store.root, 1).rows_out == 1
    assert run_stage(pair_stage, store.root, 0).skipped
    store.refresh()
    assert store.load_manifest("pair", 0) == manifest and store.files("pairs", 0) == manifest["outputs"]
    assert (part.stat().st_mtime_ns, fingerprint_file(part)) == stamp
    assert [p["prompt_id"] for p in store.read("pairs").to_pylist()] == ["a", "b", "c"]

    again = run_stage(pair_stage, store.root, 0, PairConfig(strategy="all_pairs"))
    assert not again.skipped and again.rows_out == 7


@pytest.mark.parametrize("strategy", ["max_min", "all_pairs", "max_random", "top_k_vs_bottom_k"])
def test_no_groups_no_pairs(strategy):
    out = pair(groups_of({}), PairConfig(strategy=strategy))
    assert out.num_rows == 0 and out.schema == SCHEMAS["pairs"]
