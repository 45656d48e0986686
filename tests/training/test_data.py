"""training/data.py: the rows each objective trains on, round selection, the dataset
fingerprint, and errors that name the file or round."""

from __future__ import annotations

import shutil

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from store.run_store import HeldPart, RunStore
from store.schema import SchemaError
from tests.helpers import logged_files, parquet_sql
from training.data import NoTrainingData, count_training_rows, load_training_data, select_rounds


def _sql(query: str) -> list[tuple]:
    return duckdb.sql(query).fetchall()


def _commit_again(run, stage: str, round: int, table: str, data: pa.Table, part: str | None = None,
                  config: dict | None = None) -> None:
    """A commit of `stage` for `round` writing `data` to `table`, with the inputs of the stage's
    newest commit and its config (or `config`)."""
    store = RunStore(run)
    manifest = store.load_manifest(stage, round) or {}
    with store.commit(stage, round, manifest.get("inputs", {}),
                      manifest.get("config", {}) if config is None else config) as commit:
        commit.write(table, data, part=part or stage)


def _sampled_round_2(run) -> None:
    """Round 2 sampled (round 1's samples again) and not curated yet."""
    samples = RunStore(run).read("samples", 1)
    samples = samples.set_column(samples.schema.get_field_index("round"), "round",
                                 pa.array([2] * samples.num_rows, samples.schema.field("round").type))
    _commit_again(run, "generate", 2, "samples", samples)


def test_training_data_joins_samples_and_labels(curated_run):
    policy = load_training_data(curated_run, "grpo")
    kept = _sql(f"SELECT count(*) FROM {parquet_sql(curated_run, 'groups')} WHERE group_kept")[0][0]
    assert policy.num_rows == kept > 0 and policy.rounds == [0, 1] and policy.temperature == 1.0
    t = policy.table
    lengths = [(len(a), len(b)) for a, b in zip(t.column("response_token_ids").to_pylist(),
                                                 t.column("behavior_logprobs").to_pylist())]
    assert all(a == b for a, b in lengths)
    pairs = load_training_data(curated_run, "pairwise", rounds=[1])
    n_pairs = _sql(f"SELECT count(*) FROM {parquet_sql(curated_run, 'pairs', [1])}")[0][0]
    assert pairs.num_rows == n_pairs and pairs.rounds == [1]
    assert all(c != r for c, r in zip(pairs.table.column("chosen_token_ids").to_pylist(),
                                      pairs.table.column("rejected_token_ids").to_pylist()))
    sft = load_training_data(curated_run, "sft")
    assert all(a > 0 for a in sft.table.column("advantage").to_pylist())
    assert load_training_data(curated_run, "grpo", max_staleness=0).rounds == [1]
    assert load_training_data(curated_run, "grpo").fingerprint == policy.fingerprint
    assert pairs.fingerprint != load_training_data(curated_run, "pairwise").fingerprint
    with pytest.raises(ValueError, match=r"round\(s\) \[7\]"):
        load_training_data(curated_run, "grpo", rounds=[7])
    with pytest.raises(NoTrainingData, match="nothing to train on"):
        load_training_data(curated_run, "sft", sft_min_reward=2.0)


@pytest.mark.parametrize("objective", ["grpo", "gspo", "gspo_token", "cispo"])
def test_policy_rows_are_the_kept_groups_in_key_order(curated_run, objective):
    data = load_training_data(curated_run, objective)
    expected = _sql(f"""
        SELECT s.round, s.prompt_id, s.sample_idx, g.advantage, g.reward, s.response_token_ids, s.policy_version
        FROM {parquet_sql(curated_run, 'samples')} s
        JOIN {parquet_sql(curated_run, 'groups')} g
          USING (run_id, round, prompt_id, sample_idx)
        WHERE g.group_kept ORDER BY 1, 2, 3""")
    t = data.table
    got = list(zip(*(t.column(c).to_pylist() for c in ("round", "prompt_id", "sample_idx", "advantage", "reward",
                                                       "response_token_ids", "policy_version"))))
    assert got == [tuple(row) for row in expected]
    assert {"prompt_token_ids", "behavior_logprobs"} <= set(t.column_names)


def test_sft_rows_by_advantage_or_by_reward(curated_run):
    groups = parquet_sql(curated_run, "groups")
    by_advantage = load_training_data(curated_run, "sft")
    assert by_advantage.num_rows == _sql(f"SELECT count(*) FROM {groups} WHERE advantage > 0")[0][0] > 0
    by_reward = load_training_data(curated_run, "sft", sft_min_reward=1.0)
    assert by_reward.num_rows == _sql(f"SELECT count(*) FROM {groups} WHERE reward >= 1.0")[0][0] > 0
    assert set(by_reward.table.column("reward").to_pylist()) == {1.0}
    assert by_reward.fingerprint != by_advantage.fingerprint  # the selection is part of the dataset's name


def test_pair_rows_carry_both_sides_of_each_pair(curated_run):
    data = load_training_data(curated_run, "pairwise")
    t = data.table
    expected = _sql(f"""
        SELECT p.round, p.prompt_id, p.chosen_idx, p.rejected_idx, p.soft_label, p.weight,
               c.response_token_ids, r.response_token_ids, c.behavior_logprobs
        FROM {parquet_sql(curated_run, 'pairs')} p
        JOIN {parquet_sql(curated_run, 'samples')} c
          ON c.round = p.round AND c.prompt_id = p.prompt_id AND c.sample_idx = p.chosen_idx
        JOIN {parquet_sql(curated_run, 'samples')} r
          ON r.round = p.round AND r.prompt_id = p.prompt_id AND r.sample_idx = p.rejected_idx
        ORDER BY 1, 2, 3, 4""")
    columns = ("round", "prompt_id", "chosen_idx", "rejected_idx", "soft_label", "weight", "chosen_token_ids",
               "rejected_token_ids", "chosen_logprobs")
    assert list(zip(*(t.column(c).to_pylist() for c in columns))) == [tuple(row) for row in expected]
    assert len(expected) > 0 and data.rounds == [0, 1]


def test_select_rounds(curated_run):
    store = RunStore(curated_run)
    assert select_rounds(store, "grpo", None, None) == [0, 1]
    assert select_rounds(store, "pairwise", [1, 0, 1], None) == [0, 1]  # sorted, once each
    assert select_rounds(store, "grpo", None, 0) == [1]  # round 0 is one round older than the newest
    assert select_rounds(store, "grpo", None, 1) == [0, 1]
    assert select_rounds(store, "sft", [0], 0) == []  # asked for, but too stale
    with pytest.raises(ValueError, match=r"no groups table for round\(s\) \[3\]; rounds with groups: \[0, 1\] "
                                         r"\(run `groupforge curate` first\)"):
        select_rounds(store, "grpo", [1, 3], None)
    with pytest.raises(ValueError, match=r"no pairs table for round\(s\) \[2\]"):
        select_rounds(store, "pairwise", [2], None)


def test_max_staleness_zero_against_a_newer_round_of_samples(curated_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(curated_run, run)
    _sampled_round_2(run)  # not curated yet: rounds 0 and 1 are now 2 and 1 rounds old
    assert load_training_data(run, "grpo", max_staleness=1).rounds == [1]
    with pytest.raises(NoTrainingData, match=r"in rounds none .*within max_staleness=0"):
        load_training_data(run, "grpo", max_staleness=0)


@pytest.mark.parametrize("selection", [{}, {"rounds": [1]}, {"max_staleness": 0}, {"sft_min_reward": 1.0}])
def test_count_training_rows_counts_what_load_returns(curated_run, tmp_path, selection):
    for objective in ("grpo", "gspo", "sft", "pairwise"):
        if "sft_min_reward" in selection and objective != "sft":
            continue
        counted = count_training_rows(curated_run, objective, **selection)
        assert counted == load_training_data(curated_run, objective, **selection).num_rows > 0, objective
    # Nothing to train on is 0 rows (load raises NoTrainingData); bad input fails the same way.
    run = tmp_path / "run"
    shutil.copytree(curated_run, run)
    _sampled_round_2(run)
    assert count_training_rows(run, "grpo", max_staleness=0) == 0
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        count_training_rows(run, "ppo")


def test_fingerprint_names_the_rows(curated_run, tmp_path):
    first = load_training_data(curated_run, "grpo").fingerprint
    assert load_training_data(curated_run, "grpo").fingerprint == first
    moved = tmp_path / "elsewhere"
    shutil.copytree(curated_run, moved)
    assert load_training_data(moved, "grpo").fingerprint == first  # content and relative paths, not where
    others = {load_training_data(curated_run, "gspo").fingerprint, load_training_data(curated_run, "sft").fingerprint,
              load_training_data(curated_run, "grpo", rounds=[1]).fingerprint}
    assert len(others | {first}) == 4
    # Relabelled groups (one advantage changed): a different dataset.
    table = RunStore(moved).read("groups", 1)
    advantage = table.column("advantage").to_pylist()
    advantage[0] += 1.0
    relabelled = table.set_column(table.schema.get_field_index("advantage"), "advantage",
                                  pa.array(advantage, table.schema.field("advantage").type))
    _commit_again(moved, "label", 1, "groups", relabelled)
    assert load_training_data(moved, "grpo").fingerprint != first


def test_errors_name_the_file_or_round(curated_run, tmp_path):
    with pytest.raises(ValueError,
                       match=r"unknown objective 'ppo'; known: grpo, gspo, gspo_token, cispo, pairwise, sft"):
        load_training_data(curated_run, "ppo")
    run = tmp_path / "run"
    shutil.copytree(curated_run, run)
    [part] = logged_files(run, "groups", [1])  # overwritten with another table
    good = part.read_bytes()
    pq.write_table(pa.table({"prompt_id": ["p"], "advantage": ["high"]}), part)
    with pytest.raises(SchemaError, match=str(part)):
        load_training_data(run, "grpo")
    part.write_bytes(good)
    samples = RunStore(run).read("samples", 1)
    record = RunStore(run).load_manifest("generate", 1)
    record["config"]["sampling"]["temperature"] = 0.7  # round 1 sampled again at another temperature
    _commit_again(run, "generate", 1, "samples", samples, config=record["config"])
    with pytest.raises(ValueError, match=r"rounds \[0, 1\] were sampled at different temperatures \[0.7, 1.0\]"):
        load_training_data(run, "grpo")
    assert load_training_data(run, "grpo", rounds=[1]).temperature == 0.7
    record["config"]["sampling"].update(temperature=1.0, top_p=0.9, top_k=5)
    _commit_again(run, "generate", 1, "samples", samples, config=record["config"])
    with pytest.raises(ValueError, match=r"sampled with different top_k values \[0.0, 5.0\]"):
        load_training_data(run, "grpo")
    one = load_training_data(run, "grpo", rounds=[1])  # the truncation the trainer applies
    assert (one.top_k, one.top_p) == (5, 0.9)
    assert (load_training_data(run, "grpo", rounds=[0]).top_k, load_training_data(run, "grpo", rounds=[0]).top_p) \
        == (0, 1.0)


def _held(run, tables=("samples", "groups", "pairs")) -> RunStore:
    """The store of a caller that has just committed the run's part files (RunStore(hold=True)):
    its held parts read back from the files."""
    from store.fingerprints import fingerprint_file
    from store.run_store import HeldPart

    store = RunStore(run, hold=True)
    store.held.update({path.relative_to(run).as_posix(): HeldPart(fingerprint_file(path), pq.read_table(path))
                       for table in tables for path in logged_files(run, table)})
    return store


@pytest.mark.parametrize("objective", ["grpo", "sft", "pairwise"])
def test_held_tables_give_the_rows_of_the_files(curated_run, objective):
    store = _held(curated_run)
    from_files = load_training_data(curated_run, objective)
    from_held = load_training_data(store, objective)
    assert from_held.table.equals(from_files.table) and from_held.fingerprint == from_files.fingerprint
    assert count_training_rows(store, objective) == from_files.num_rows


def test_a_held_part_is_read_instead_of_its_file_until_released(curated_run):
    store = _held(curated_run, ("groups",))
    [rel] = RunStore(curated_run).files("groups", 1)
    assert rel in store.held
    groups = store.held[rel].table
    shifted = groups.set_column(groups.schema.get_field_index("advantage"), "advantage",
                                pc.add(groups.column("advantage"), 10.0))
    store.held[rel] = HeldPart(store.held[rel].sha256, shifted)
    assert min(load_training_data(store, "grpo", rounds=[1]).table.column("advantage").to_pylist()) > 5
    store.release()
    assert load_training_data(store, "grpo", rounds=[1]).table.equals(
        load_training_data(curated_run, "grpo", rounds=[1]).table)


def test_a_rewritten_file_is_checked_again(curated_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(curated_run, run)
    assert load_training_data(run, "grpo").num_rows > 0  # every file's schema checked
    [part] = logged_files(run, "groups", [1])
    table = pq.read_table(part)
    pq.write_table(table.set_column(table.schema.get_field_index("advantage"), "advantage",
                                    pa.array(["high"] * table.num_rows)), part)
    with pytest.raises(SchemaError, match=str(part)):
        load_training_data(run, "grpo")


def test_duplicate_keys_join_like_sql(curated_run, tmp_path):
    # A second samples part with the same keys (a copy): each kept groups row now matches two
    # samples rows, as an SQL inner join gives them; a row of a pairs part matches 2 x 2.
    run = tmp_path / "run"
    shutil.copytree(curated_run, run)
    _commit_again(run, "copy", 1, "samples", RunStore(run).read("samples", 1))
    once = load_training_data(curated_run, "grpo", rounds=[1])
    twice = load_training_data(run, "grpo", rounds=[1])
    assert twice.num_rows == 2 * once.num_rows == count_training_rows(run, "grpo", rounds=[1])
    keys = list(zip(*(twice.table.column(c).to_pylist() for c in ("round", "prompt_id", "sample_idx"))))
    assert keys == sorted(keys) and keys[::2] == keys[1::2]
    pairs = load_training_data(run, "pairwise", rounds=[1])
    assert pairs.num_rows == 4 * load_training_data(curated_run, "pairwise", rounds=[1]).num_rows
    assert count_training_rows(run, "pairwise", rounds=[1]) == pairs.num_rows
