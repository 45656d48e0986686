"""curation/stages/filter.py: every reason, their order, earlier rejects, and the stage on a real run."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from curation.stages import filter as filter_stage
from curation.stages.common import group_ids
from curation.stages.filter import FilterConfig
from curation.stages.runner import run_stage
from store.fingerprints import fingerprint_file
from store.layout import part_name
from store.run_store import RunStore
from store.schema import KEYS, SCHEMAS, SchemaError, empty
from tests.helpers import commit_inputs, group_rows, rejects_of, samples_and_scores

# ---- builders (label and pair tests use them too) -----------------------------------------


def filter_samples(samples: pa.Table, scores: pa.Table, rejects_so_far: pa.Table, cfg: FilterConfig) -> pa.Table:
    """The rejects the filter's transform writes for these tables."""
    out = filter_stage.transform({"samples": samples, "scores": scores, "rejects": rejects_so_far}, cfg)
    assert out.rows_out == out.rows_in - out.tables["rejects"].num_rows
    return out.tables["rejects"]


def reasons(rejects: pa.Table) -> dict[tuple[str, int], str]:
    return {(r["prompt_id"], r["sample_idx"]): r["reason"] for r in rejects.to_pylist()}


def run_filter(rows: list[dict], cfg: FilterConfig, earlier: pa.Table | None = None) -> dict[tuple[str, int], str]:
    samples, scores = samples_and_scores(rows)
    rejects = filter_samples(samples, scores, earlier if earlier is not None else empty("rejects"), cfg)
    assert set(rejects.column("stage").to_pylist()) <= {"filter"}
    return reasons(rejects)


# ---- each reason --------------------------------------------------------------------------


def test_defaults_drop_zero_variance_single_sample_groups_and_duplicates():
    rows = group_rows({"all_right": [1, 1, 1], "mixed": [1, 0, 1], "alone": [1.0], "all_wrong": [0, 0]})
    rows[4]["finish_reason"] = "length"  # mixed/1: truncated, kept by default
    rows[3]["response"] = rows[5]["response"] = "same"  # mixed/0 and mixed/2: mixed/2 is a duplicate
    got = run_filter(rows, FilterConfig())
    assert got == {("all_right", 0): "zero_variance", ("all_right", 1): "zero_variance",
                   ("all_right", 2): "zero_variance", ("all_wrong", 0): "zero_variance",
                   ("all_wrong", 1): "zero_variance", ("alone", 0): "group_too_small",
                   ("mixed", 2): "duplicate"}
    assert ("mixed", 2) not in run_filter(rows, FilterConfig(drop_duplicates=False))


def test_unscored_null_reward_and_missing_scores_row():
    rows = group_rows({"p": [1, 0, None, 0.5]})
    rows[3]["scored"] = False
    assert run_filter(rows, FilterConfig()) == {("p", 2): "unscored", ("p", 3): "unscored"}


def test_truncated_too_long_too_short_and_their_order():
    rows = group_rows({"p": [1, 0, 1, 0, 1, 0]})
    for row, n_tokens in zip(rows, [3, 10, 11, 1, 0, 5]):
        row["n_tokens"] = n_tokens
    rows[2]["finish_reason"] = "length"  # also too long: truncated is checked first
    cfg = FilterConfig(drop_truncated=True, max_response_tokens=10, min_response_tokens=2)
    assert run_filter(rows, cfg) == {("p", 2): "truncated", ("p", 3): "too_short", ("p", 4): "too_short"}
    rows[2]["finish_reason"] = "stop"
    assert run_filter(rows, cfg)[("p", 2)] == "too_long"


def test_duplicate_keeps_the_lowest_sample_idx_among_survivors():
    rows = group_rows({"p": [1, 0, 1, 0, 1]})
    for row, text in zip(rows, ["a", "b", "a", "a", "c"]):
        row["response"] = text
    assert run_filter(rows, FilterConfig(drop_duplicates=True)) == {("p", 2): "duplicate", ("p", 3): "duplicate"}
    rows[0]["finish_reason"] = "length"  # the first "a" is gone: the next one is the original
    got = run_filter(rows, FilterConfig(drop_duplicates=True, drop_truncated=True))
    assert got == {("p", 0): "truncated", ("p", 3): "duplicate"}
    rejects = filter_samples(*samples_and_scores(rows), empty("rejects"), FilterConfig(drop_duplicates=True))
    assert rejects.column("detail").to_pylist() == ["same response as sample_idx 0"] * 2


def test_group_checks_see_only_the_survivors_of_sample_checks():
    rows = group_rows({"a": [1, 0, 1], "b": [1, 0, 0]})
    rows[1]["finish_reason"] = "length"  # a: 1, 1 left -> zero variance
    rows[3]["finish_reason"] = rows[4]["finish_reason"] = "length"  # b: one sample left
    got = run_filter(rows, FilterConfig(drop_truncated=True))
    assert got == {("a", 1): "truncated", ("a", 0): "zero_variance", ("a", 2): "zero_variance",
                   ("b", 0): "truncated", ("b", 1): "truncated", ("b", 2): "group_too_small"}


def test_group_too_small_comes_before_zero_variance_and_pass_rate():
    rows = group_rows({"small": [1, 1], "ok": [1, 0, 0, 1]})
    got = run_filter(rows, FilterConfig(min_group_size=3, pass_rate_max=0.9))
    assert got == {("small", 0): "group_too_small", ("small", 1): "group_too_small"}
    assert run_filter(rows, FilterConfig(min_group_size=1))[("small", 0)] == "zero_variance"
    got = run_filter(rows, FilterConfig(min_group_size=1, drop_zero_variance=False, pass_rate_max=0.9))
    assert got == {("small", 0): "pass_rate", ("small", 1): "pass_rate"}
    assert run_filter(rows, FilterConfig(min_group_size=1, drop_zero_variance=False)) == {}


def test_pass_rate_band_is_open_on_both_sides():
    rows = group_rows({"quarter": [1, 0, 0, 0], "half": [1, 0, 1, 0], "three_quarters": [1, 1, 1, 0]})
    cfg = FilterConfig(pass_rate_min=0.25, pass_rate_max=0.75)
    got = run_filter(rows, cfg)
    assert {p for p, _ in got} == {"quarter", "three_quarters"} and set(got.values()) == {"pass_rate"}
    assert len(got) == 8
    assert {p for p, _ in run_filter(rows, FilterConfig(pass_rate_min=0.3))} == {"quarter"}
    assert {p for p, _ in run_filter(rows, FilterConfig(pass_rate_max=0.7))} == {"three_quarters"}
    detail = filter_samples(*samples_and_scores(rows), empty("rejects"), FilterConfig(pass_rate_min=0.3))
    assert detail.column("detail").to_pylist() == ["group mean reward 0.25"] * 4


def test_every_detail_text():
    rows = group_rows({"zeros": [0.0, 0.0], "negative_zeros": [-0.0, -0.0], "halves": [0.5, 0.5], "alone": [1.0, None],
                       "cut": [1, 0, 1], "dup": [1, 0, 1, 0.25], "long": [1, 0, 1]})
    for row in rows:
        row["n_tokens"] = 12 if (row["prompt_id"], row["sample_idx"]) == ("long", 2) else 3
        row["finish_reason"] = "length" if (row["prompt_id"], row["sample_idx"]) == ("cut", 0) else "stop"
        row["response"] = "same" if (row["prompt_id"], row["sample_idx"]) in (("dup", 1), ("dup", 3)) else "x" + str(
            row["sample_idx"])
    rejects = filter_samples(*samples_and_scores(rows), empty("rejects"),
                             FilterConfig(drop_truncated=True, max_response_tokens=10))
    got = {(r["prompt_id"], r["sample_idx"]): (r["reason"], r["detail"]) for r in rejects.to_pylist()}
    assert got == {
        ("zeros", 0): ("zero_variance", "every reward is 0.0"), ("zeros", 1): ("zero_variance", "every reward is 0.0"),
        ("negative_zeros", 0): ("zero_variance", "every reward is -0.0"),
        ("negative_zeros", 1): ("zero_variance", "every reward is -0.0"),
        ("halves", 0): ("zero_variance", "every reward is 0.5"),
        ("halves", 1): ("zero_variance", "every reward is 0.5"),
        ("alone", 0): ("group_too_small", "1 sample(s) left"), ("alone", 1): ("unscored", None),
        ("cut", 0): ("truncated", None),
        ("dup", 3): ("duplicate", "same response as sample_idx 1"),
        ("long", 2): ("too_long", "12 response tokens"),
    }


def test_earlier_rejects_are_left_out_by_sample_and_by_prompt():
    rows = group_rows({"a": [1, 0, 0], "b": [None, 1, 0], "c": [1, 1, 0]})
    earlier = pa.concat_tables([rejects_of([("a", 1), ("b", 0)]),
                                rejects_of([("c", None)], stage="generate", reason="prompt_too_long")])
    got = run_filter(rows, FilterConfig(), earlier)
    # a: 1, 0 left (kept); b: the null reward was rejected by score already; c: whole prompt gone
    assert got == {}
    got = run_filter(rows, FilterConfig(min_group_size=3), earlier)
    assert got == {("a", 0): "group_too_small", ("a", 2): "group_too_small",
                   ("b", 1): "group_too_small", ("b", 2): "group_too_small"}


def test_row_order_and_scores_order_do_not_change_the_result():
    rng = random.Random(3)
    rows = [{"prompt_id": f"p{p}", "sample_idx": i, "reward": rng.choice([0.0, 0.5, 1.0, None]),
             "n_tokens": rng.randint(0, 9), "response": rng.choice("abc"),
             "finish_reason": rng.choice(["stop", "length"])} for p in range(30) for i in range(5)]
    cfg = FilterConfig(drop_truncated=True, drop_duplicates=True, max_response_tokens=8, min_response_tokens=1,
                       min_group_size=2, pass_rate_min=0.3, pass_rate_max=0.7)
    samples, scores = samples_and_scores(rows)
    earlier = rejects_of([("p1", 2), ("p4", None)])
    expected = reasons(filter_samples(samples, scores, earlier, cfg))
    assert set(expected.values()) == {"unscored", "truncated", "too_long", "too_short", "duplicate",
                                      "zero_variance", "group_too_small", "pass_rate"}
    order = list(range(len(rows)))
    rng.shuffle(order)  # groups no longer in runs of adjacent rows: the general group_ids path
    shuffled = filter_samples(samples.take(order), scores.take(order[::-1]), earlier, cfg)
    assert reasons(shuffled) == expected
    in_order = [(r["prompt_id"], r["sample_idx"]) for r in samples.take(order).select(list(KEYS)).to_pylist()]
    assert [(r["prompt_id"], r["sample_idx"]) for r in shuffled.to_pylist()] == [k for k in in_order if k in expected]


def test_group_ids_name_groups_by_run_id_round_and_prompt_id():
    table = pa.table({"run_id": ["r", "r", "s", "r", "r"], "round": pa.array([0, 0, 0, 1, 0], pa.int32()),
                      "prompt_id": ["p", "q", "p", "p", "p"]})
    for order in ([0, 1, 2, 3, 4], [0, 4, 1, 2, 3], [3, 0, 2, 4, 1]):
        ids = dict(zip(order, group_ids(table.take(order)).to_list()))
        assert ids[0] == ids[4] and len(set(ids.values())) == 4
    adjacent = pa.table({"run_id": ["r"] * 5, "round": pa.array([0] * 5, pa.int32()), "prompt_id": list("ppqss")})
    assert group_ids(adjacent).to_list() == [0, 0, 1, 2, 2]  # the fast path: runs of adjacent rows


def test_a_sample_scored_twice_is_an_error():
    samples, scores = samples_and_scores(group_rows({"p": [1, 0]}))
    with pytest.raises(ValueError, match="appears more than once"):
        filter_samples(samples, pa.concat_tables([scores, scores.slice(0, 1)]), empty("rejects"), FilterConfig())


def test_config_rejects_unknown_keys_and_empty_bands():
    with pytest.raises(ValidationError, match="drop_zero_varience"):
        FilterConfig(drop_zero_varience=False)
    with pytest.raises(ValidationError, match="rejects every response"):
        FilterConfig(min_response_tokens=10, max_response_tokens=5)
    with pytest.raises(ValidationError, match="rejects every group"):
        FilterConfig(pass_rate_min=0.5, pass_rate_max=0.5)
    assert FilterConfig.model_fields["drop_truncated"].description


# ---- the stage on a run --------------------------------------------------------------------


def test_run_commits_rejects_with_counts_and_is_idempotent(tmp_path):
    store = RunStore(tmp_path / "run")
    rows = group_rows({"a": [1, 1], "b": [1, 0, None], "c": [0.5, 0.0, 0.2]})
    commit_inputs(store, 0, *samples_and_scores(rows), score_rejects=rejects_of([("c", 2)]))
    report = run_stage(filter_stage, store.root, 0)
    assert not report.skipped and report.rows_in == 7 and report.rows_out == 4
    assert report.drops == {"zero_variance": 2, "unscored": 1}
    store.refresh()
    manifest = store.load_manifest("filter", 0)
    assert manifest["drops"] == report.drops and manifest["rows_in"] == 7
    [rel] = manifest["outputs"]
    assert rel in store.files("rejects", 0) and part_name(rel) == "filter"
    assert reasons(store.read("rejects", 0)) == {("a", 0): "zero_variance", ("a", 1): "zero_variance",
                                                  ("b", 2): "unscored", ("c", 2): "invalid_reward"}
    part = store.root / rel
    before = (part.stat().st_mtime_ns, fingerprint_file(part))
    again = run_stage(filter_stage, store.root, 0)
    assert again.skipped and again.drops == report.drops
    assert (part.stat().st_mtime_ns, fingerprint_file(part)) == before
    # its own output is not an input: the next run is still a skip; a new config is not
    assert run_stage(filter_stage, store.root, 0, FilterConfig()).skipped
    assert not run_stage(filter_stage, store.root, 0, FilterConfig(min_group_size=3)).skipped
    assert not run_stage(filter_stage, store.root, 0, FilterConfig(min_group_size=3), force=True).skipped


def test_a_new_round_leaves_the_old_one_untouched(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 1], "b": [1, 0]})))
    run_stage(filter_stage, store.root, 0)
    store.refresh()
    manifest = store.load_manifest("filter", 0)
    [part] = [store.root / rel for rel in manifest["outputs"]]
    stamp = part.stat().st_mtime_ns
    commit_inputs(store, 1, *samples_and_scores(group_rows({"a": [0, 0, 1]}), round=1))
    assert run_stage(filter_stage, store.root, 0).skipped
    report = run_stage(filter_stage, store.root, 1)
    assert not report.skipped and report.rows_in == 3 and report.drops == {}
    store.refresh()
    assert store.load_manifest("filter", 0) == manifest and part.stat().st_mtime_ns == stamp
    assert store.files("rejects", 0) == manifest["outputs"]
    assert store.read("rejects", 1).num_rows == 0


def test_run_reads_only_valid_samples(tmp_path):
    store = RunStore(tmp_path / "run")
    samples, scores = samples_and_scores(group_rows({"a": [1, 0]}))
    commit_inputs(store, 0, samples, scores)
    with store.commit("other", 0, inputs={}, config={}) as commit:
        commit.write("samples", samples.slice(0, 1))
    bad = store.root / store.load_manifest("other", 0)["outputs"][0]
    pq.write_table(samples.drop(["finish_reason"]), bad)  # a live part replaced after its commit
    with pytest.raises(SchemaError, match=rf"{bad.name}.*finish_reason"):
        run_stage(filter_stage, store.root, 0)


def test_empty_round():
    samples, scores = samples_and_scores([])
    rejects = filter_samples(samples, scores, empty("rejects"), FilterConfig(drop_duplicates=True))
    assert rejects.num_rows == 0 and rejects.schema == SCHEMAS["rejects"]
