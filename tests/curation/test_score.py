"""The score stage: the pure function on small tables, and `run` on real toy runs (the HF
generator, real Parquet, DuckDB reads). A user's reward module counts its calls in a file,
which is the evidence that reruns compute only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from curation.stages import score as score_stage
from curation.stages.runner import run_stage
from curation.stages.score import RewardSpec, ScoreConfig
from store.layout import part_name
from store.run_store import RunStore
from store.schema import SCHEMAS, SchemaError
from tests.helpers import make_toy_run

USER_MODULE = "gf_user_rewards_s"


def config_digest(kwargs: dict) -> str:
    """The kwargs part of a scorer fingerprint: sha256 of the canonical JSON, 12 hex digits."""
    return hashlib.sha256(json.dumps(kwargs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def user_module(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent('''
        import os, time

        def counting(prompts, completions, log, **kwargs):
            """Length of the completion; appends 'prompt_id/sample_idx' to `log` per call."""
            with open(log, "a") as f:
                for pid, idx in zip(kwargs["prompt_id"], kwargs["sample_idx"]):
                    f.write(f"{kwargs['round'][0]}/{pid}/{idx}\\n")
            return [float(len(c)) for c in completions]

        def trl_columns(prompts, completions, **kwargs):
            """1.0 when it gets TRL's arguments with the stage's columns, else raises."""
            expected = {"reference", "metadata", "prompt_id", "sample_idx", "run_id", "round", "group_size",
                        "finish_reason", "policy_version", "response_token_ids", "completion_ids"}
            assert expected <= set(kwargs), sorted(expected - set(kwargs))
            assert all(len(v) == len(completions) for v in kwargs.values())
            assert kwargs["finish_reason"][0] in ("stop", "length")
            assert kwargs["completion_ids"] == kwargs["response_token_ids"]
            if isinstance(prompts[0], list):  # chat: TRL's conversational format
                assert completions[0][0]["role"] == "assistant"
                return [float(len(prompts[0]))]
            return [None if r is None else float(c.strip() == r) for c, r in zip(completions, kwargs["reference"])]

        def misbehaving(prompts, completions, **kwargs):
            c = completions[0]
            if c == "HANG":
                time.sleep(60)
            if c == "EXIT":
                os._exit(7)
            if c == "RAISE":
                raise RuntimeError("reward exploded")
            if c == "NAN":
                return [float("nan")]
            if c == "INF":
                return [float("-inf")]
            if c == "MEMORY":  # grows until the worker's address-space limit
                hoard = []
                while True:
                    hoard.append(bytearray(16 * 2**20))
            if c == "BURN":  # busy, within its wall-clock timeout, past its CPU-time limit
                while True:
                    pass
            if c == "PRINT":
                print("a reward that talks " * 1000)
            if c == "LONG":
                return [0.5, 0.5]
            if c == "DICT":
                return {"score": 0.5}
            return [0.5]
    '''))
    sys.path.insert(0, str(folder))
    yield USER_MODULE
    sys.path.remove(str(folder))
    sys.modules.pop(USER_MODULE, None)


def score(samples: pa.Table, prompts: pa.Table, rewards: list[RewardSpec], existing: pa.Table | None = None,
          workers: int | None = None, **limits) -> tuple[pa.Table, pa.Table]:
    """(scores, rejects) of the score stage's transform, reusing `existing` scores."""
    tables = {"samples": samples, "prompts": prompts, **({"scores": existing} if existing is not None else {})}
    out = score_stage.transform(tables, ScoreConfig(rewards=rewards, workers=workers, **limits))
    assert (out.rows_in, out.rows_out) == (samples.num_rows, out.tables["scores"].num_rows)
    return out.tables["scores"], out.tables["rejects"]


def tables(responses: list[str], references: dict[str, str | None], group_size: int = 2,
           round: int = 0) -> tuple[pa.Table, pa.Table]:
    """samples (groups of `group_size` in prompt order) and prompts tables."""
    prompt_ids = list(references)
    n = len(responses)
    samples = pa.Table.from_pydict({
        "run_id": ["r"] * n, "round": [round] * n,
        "prompt_id": [prompt_ids[i // group_size] for i in range(n)],
        "sample_idx": [i % group_size for i in range(n)], "group_size": [group_size] * n,
        "prompt_token_ids": [[1, 2]] * n, "response": responses,
        "response_token_ids": [[5] * (1 + i) for i in range(n)],
        "behavior_logprobs": [[-0.5] * (1 + i) for i in range(n)],
        "finish_reason": ["stop"] * n, "policy_version": [0] * n, "generator": ["test"] * n, "seed": [1] * n,
    }, schema=SCHEMAS["samples"])
    prompts = pa.table({"prompt_id": prompt_ids, "prompt": [f"{p}?" for p in prompt_ids],
                        "reference": list(references.values())})
    return samples, prompts


# ---- the pure function --------------------------------------------------------------


def test_exact_match_scores_and_weighted_total():
    samples, prompts = tables(["4", " 4 ", "5", "x", "y", "z"], {"a": "4", "b": "5", "c": None})
    specs = [RewardSpec(name="exact_match", weight=2.0),
             RewardSpec(name="length_penalty", column="brevity", weight=0.5,
                        kwargs={"target_tokens": 2, "per_token": 1.0})]
    scores, rejects = score(samples, prompts, specs)
    assert rejects.num_rows == 0
    assert scores.column("exact_match").to_pylist() == [1.0, 1.0, 1.0, 0.0, None, None]
    assert scores.column("brevity").to_pylist() == [0.0, 0.0, -1.0, -2.0, -3.0, -4.0]
    # reward = sum over the non-null columns of weight * value
    assert scores.column("reward").to_pylist() == [2.0, 2.0, 1.5, -1.0, -1.5, -2.0]
    assert set(scores.column("scorer").to_pylist()) == {json.dumps(
        {"brevity": "length_penalty@1#" + config_digest({"per_token": 1.0, "target_tokens": 2}),
         "exact_match": "exact_match@1#44136fa355b3"}, sort_keys=True)}
    assert scores.schema.field("exact_match").type == pa.float64()
    keys = ["prompt_id", "sample_idx"]
    assert scores.select(keys).to_pylist() == samples.select(keys).to_pylist()


def test_reward_is_null_only_when_every_column_is_null():
    samples, prompts = tables(["4", "5"], {"a": None})
    scores, _ = score(samples, prompts, [RewardSpec(name="exact_match")])
    assert scores.column("exact_match").to_pylist() == [None, None]
    assert scores.column("reward").to_pylist() == [None, None]


def test_trl_function_by_module_path(user_module):
    samples, prompts = tables(["4", "5 ", "5", "6"], {"a": "4", "b": "5"})
    scores, rejects = score(samples, prompts, [RewardSpec(name=f"{user_module}:trl_columns", column="trl")], workers=2)
    assert rejects.to_pylist() == []
    assert scores.column("trl").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.column("reward").to_pylist() == [1.0, 0.0, 1.0, 0.0]


def test_trl_function_gets_chat_prompts_as_messages(user_module):
    samples, _ = tables(["hi", "yo"], {"a": None})
    messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]]
    prompts = pa.table({"prompt_id": ["a"], "messages": messages, "reference": pa.nulls(1, pa.string())})
    scores, rejects = score(samples, prompts, [RewardSpec(name=f"{user_module}:trl_columns")], workers=1)
    assert rejects.num_rows == 0
    assert scores.column(f"{user_module}_trl_columns").to_pylist() == [2.0, 2.0]  # two prompt messages


def test_rewards_past_their_memory_or_cpu_limit_or_returning_junk_reject_only_their_rows(user_module, capfd):
    """The worker limits (ScoreConfig memory_mb, cpu_seconds): a reward that hoards memory gets a
    MemoryError in its worker, one that spins past its CPU seconds is stopped (well before its
    wall-clock timeout); wrong lengths and types are rejected with what was wrong; a reward that
    prints does not reach stdout. The other rows are scored."""
    responses = ["ok", "MEMORY", "ok", "BURN", "LONG", "ok", "DICT", "PRINT"]
    samples, prompts = tables(responses, {"a": "ok", "b": "ok", "c": "ok", "d": "ok"})
    specs = [RewardSpec(name="exact_match"), RewardSpec(name=f"{user_module}:misbehaving", column="bad", timeout_s=30)]
    tic = time.monotonic()
    scores, rejects = score(samples, prompts, specs, workers=2, memory_mb=512, cpu_seconds=1)
    assert time.monotonic() - tic < 25  # the spinning item was stopped at ~1 CPU second, not 30 s of wall
    got = {(r["prompt_id"], r["sample_idx"]): r["detail"] for r in rejects.to_pylist()}
    assert got == {("a", 1): "bad: MemoryError", ("b", 1): "bad: over the CPU-time limit of 1s",
                   ("c", 0): "bad: ValueError: reward function returned 2 scores for 1 completions",
                   ("d", 0): "bad: TypeError: reward function returned dict, expected a list of floats"}
    assert scores.select(["prompt_id", "sample_idx"]).to_pylist() == [
        {"prompt_id": "a", "sample_idx": 0}, {"prompt_id": "b", "sample_idx": 0}, {"prompt_id": "c", "sample_idx": 1},
        {"prompt_id": "d", "sample_idx": 1}]
    out, err = capfd.readouterr()
    assert "a reward that talks" not in out and "a reward that talks" in err


def test_hanging_crashing_raising_and_nan_rewards_are_rejected_quickly(user_module):
    responses = ["ok", "HANG", "ok", "EXIT", "RAISE", "ok", "NAN", "INF"]
    samples, prompts = tables(responses, {"a": "ok", "b": "ok", "c": "ok", "d": "ok"})
    specs = [RewardSpec(name="exact_match"), RewardSpec(name=f"{user_module}:misbehaving", column="bad", timeout_s=1.0)]
    tic = time.monotonic()
    scores, rejects = score(samples, prompts, specs, workers=2)
    assert time.monotonic() - tic < 15  # the 60 s sleep was cut off at 1 s
    assert scores.select(["prompt_id", "sample_idx"]).to_pylist() == [
        {"prompt_id": "a", "sample_idx": 0}, {"prompt_id": "b", "sample_idx": 0}, {"prompt_id": "c", "sample_idx": 1}]
    assert scores.column("reward").to_pylist() == [1.5, 1.5, 1.5]
    got = {(r["prompt_id"], r["sample_idx"]): r["detail"] for r in rejects.to_pylist()}
    assert got == {("a", 1): "bad: timeout after 1s", ("b", 1): "bad: reward worker died (exit code 7)",
                   ("c", 0): "bad: RuntimeError: reward exploded", ("d", 0): "bad: nan", ("d", 1): "bad: -inf"}
    assert set(rejects.column("stage").to_pylist()) == {"score"}
    assert set(rejects.column("reason").to_pylist()) == {"invalid_reward"}
    assert rejects.schema == SCHEMAS["rejects"]


def test_existing_scores_are_reused_per_column(user_module, tmp_path):
    samples, prompts = tables(["4", "5", "5", "6"], {"a": "4", "b": "5"})
    log = tmp_path / "calls.txt"
    counting = RewardSpec(name=f"{user_module}:counting", column="n", kwargs={"log": str(log)})
    first, _ = score(samples, prompts, [RewardSpec(name="exact_match")])
    second, _ = score(samples, prompts, [RewardSpec(name="exact_match"), counting], existing=first, workers=1)
    assert len(log.read_text().splitlines()) == 4
    third, _ = score(samples, prompts, [RewardSpec(name="exact_match", weight=3.0), counting], existing=second)
    assert len(log.read_text().splitlines()) == 4  # a weight change recomputes only `reward`
    assert third.column("reward").to_pylist() == [4.0, 1.0, 4.0, 1.0]
    # a sample the existing scores lack is the only one computed
    fourth, _ = score(samples, prompts, [RewardSpec(name="exact_match"), counting], existing=second.slice(0, 3))
    assert log.read_text().splitlines()[4:] == ["0/b/1"]
    assert fourth.column("n").to_pylist() == [1.0, 1.0, 1.0, 1.0]


def test_config_rejects_unknown_keys_and_clashing_columns():
    with pytest.raises(ValidationError, match="extra"):
        ScoreConfig(rewards=[{"name": "exact_match", "wieght": 2}])
    with pytest.raises(ValidationError, match="two rewards write column 'regex'"):
        ScoreConfig(rewards=[{"name": "regex"}, {"name": "regex", "kwargs": {"pattern": "x"}}])
    with pytest.raises(ValidationError, match="reserved"):
        ScoreConfig(rewards=[{"name": "exact_match", "column": "reward"}])
    assert ScoreConfig().rewards == [RewardSpec(name="exact_match", weight=1.0)]
    assert RewardSpec(name="my.pkg:acc").column_name == "my_pkg_acc"


def test_samples_without_a_prompt_and_conflicting_references_fail():
    samples, prompts = tables(["4", "5"], {"a": "4"})
    with pytest.raises(SchemaError, match="not in the prompts table"):
        score(samples, prompts.slice(0, 0), [RewardSpec(name="exact_match")])
    doubled = pa.concat_tables([prompts, pa.table({"prompt_id": ["a"], "prompt": ["a?"], "reference": ["5"]})])
    with pytest.raises(SchemaError, match="different references"):
        score(samples, doubled, [RewardSpec(name="exact_match")])
    # the same prompt listed twice (two prompts parts), once without a reference: one row, with it
    twice = pa.concat_tables([pa.table({"prompt_id": ["a"], "prompt": ["a?"], "reference": pa.nulls(1, pa.string())}),
                              prompts])
    scores, _ = score(samples, twice, [RewardSpec(name="exact_match")])
    assert scores.column("exact_match").to_pylist() == [1.0, 0.0]


# ---- the stage on toy runs ----------------------------------------------------------


@pytest.fixture(scope="module")
def toy_run(toy_dir: Path, tmp_path_factory) -> Path:
    """A run with rounds 0 and 1 of 12 toy prompts x 4 samples (the HF generator)."""
    return make_toy_run(toy_dir, tmp_path_factory.mktemp("toy_run"), "eval", n_prompts=12, group_size=4, max_tokens=8)


@pytest.fixture
def run_dir(toy_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(toy_run, tmp_path / "run"))


def file_states(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of every table and manifest file."""
    return {p.relative_to(run_dir).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in run_dir.rglob("*") if p.is_file() and not p.name.startswith(".")}


def live(run_dir: Path, table: str, round: int, part: str) -> list[Path]:
    """The live files of the stage's part `part` of `table` in `round` (read from the commit log)."""
    return [run_dir / rel for rel in RunStore(run_dir).files(table, round) if part_name(rel) == part]


def regenerate(run_dir: Path, samples: pa.Table, round: int = 0) -> None:
    """Commit new samples for `round` as generate would (its other outputs as they are)."""
    store = RunStore(run_dir)
    manifest = store.load_manifest("generate", round)
    with store.commit("generate", round, manifest["inputs"], {**manifest["config"], "regenerated": True}) as commit:
        commit.write("samples", samples)
        for rel in manifest["outputs"]:
            table = rel.split("/", 1)[0]
            if table != "samples":
                commit.write(table, store.read_part(rel, table), part=part_name(rel),
                             round=None if table == "prompts" else round)


def test_run_scores_a_round_with_exact_match(run_dir):
    report = run_stage(score_stage, run_dir, 0)
    assert (report.skipped, report.rows_in, report.rows_out, report.drops) == (False, 48, 48, {})
    got = duckdb.sql(f"""
        SELECT s.prompt_id, s.sample_idx, s.response, p.reference, c.exact_match, c.reward
        FROM read_parquet('{run_dir}/samples/**/*.parquet', hive_partitioning=true) s
        JOIN read_parquet('{run_dir}/prompts/*.parquet') p USING (prompt_id)
        JOIN read_parquet('{run_dir}/scores/**/*.parquet', hive_partitioning=true) c
          USING (run_id, round, prompt_id, sample_idx)
        WHERE s.round = 0""").fetchall()
    assert len(got) == 48
    for _, _, response, reference, exact, reward in got:
        assert exact == float(response.strip() == reference.strip()) == reward
    assert 0 < sum(row[4] for row in got) < 48  # the toy is partly right
    store = RunStore(run_dir)
    manifest = store.load_manifest("score", 0)
    assert manifest["rows_in"] == 48 and manifest["rows_out"] == 48 and manifest["drops"] == {}
    assert sorted(manifest["inputs"]) == store.files("prompts") + store.files("samples", 0)
    assert manifest["reward_columns"]["exact_match"]["computed"] == 48
    assert live(run_dir, "rejects", 0, "score") == []  # nothing dropped, no part
    assert manifest["outputs"] == store.files("scores", 0) and part_name(manifest["outputs"][0]) == "score"


def test_rerun_is_a_no_op(run_dir):
    run_stage(score_stage, run_dir, 0)
    before = file_states(run_dir)
    report = run_stage(score_stage, run_dir, 0)
    assert report.skipped and report.rows_out == 48
    assert file_states(run_dir) == before  # no file rewritten


def test_new_reward_new_kwargs_and_new_round_compute_only_what_is_missing(run_dir, user_module, tmp_path):
    log = tmp_path / "calls.txt"

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    exact = RewardSpec(name="exact_match")
    counting = RewardSpec(name=f"{user_module}:counting", column="length", kwargs={"log": str(log)}, weight=0.0)
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=[exact]))
    assert calls() == []

    # a second reward: only its column is computed, once per row
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=[exact, counting], workers=2))
    assert len(calls()) == 48 and len(set(calls())) == 48
    manifest = RunStore(run_dir).load_manifest("score", 0)
    counts = {c: (v["computed"], v["reused"]) for c, v in manifest["reward_columns"].items()}
    assert counts == {"exact_match": (0, 48), "length": (48, 0)}
    scores = pq.read_table(*live(run_dir, "scores", 0, "score"))
    assert scores.column("reward").to_pylist() == scores.column("exact_match").to_pylist()  # weight 0

    # a weight change recomputes `reward` only
    heavier = counting.model_copy(update={"weight": 0.5})
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=[exact, heavier]))
    assert len(calls()) == 48
    scores = pq.read_table(*live(run_dir, "scores", 0, "score"))
    for em, n, total in zip(*(scores.column(c).to_pylist() for c in ("exact_match", "length", "reward"))):
        assert total == em + 0.5 * n

    # new kwargs change the fingerprint: that column is rescored, exact_match is not
    def scorer() -> dict:
        return json.loads(pq.read_table(*live(run_dir, "scores", 0, "score")).column("scorer")[0].as_py())

    before = scorer()
    changed = heavier.model_copy(update={"kwargs": {"log": str(log), "unused": 1}})
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=[exact, changed]))
    assert len(calls()) == 96
    after = scorer()
    assert after["exact_match"] == before["exact_match"] and after["length"] != before["length"]

    # a new round: only its rows are scored, round 0 stays as it is
    round0 = {k: v for k, v in file_states(run_dir).items() if "round=0" in k}
    report = run_stage(score_stage, run_dir, 1, ScoreConfig(rewards=[exact, changed]))
    assert report.rows_out == 48 and not report.skipped
    assert len(calls()) == 144 and {c.split("/")[0] for c in calls()[96:]} == {"1"}
    assert {k: v for k, v in file_states(run_dir).items() if "round=0" in k} == round0
    scores = RunStore(run_dir).read("scores")  # noqa: F841 (read by the SQL)
    total = duckdb.sql("SELECT round, count(*) FROM scores GROUP BY round ORDER BY round").fetchall()
    assert total == [(0, 48), (1, 48)]


def test_regenerated_samples_are_rescored(run_dir, user_module, tmp_path):
    log = tmp_path / "calls.txt"
    specs = [RewardSpec(name=f"{user_module}:counting", column="length", kwargs={"log": str(log)}),
             RewardSpec(name="exact_match")]
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=specs, workers=1))
    samples = RunStore(run_dir).read("samples", 0)
    reference = RunStore(run_dir).read("prompts")
    ref_of = dict(zip(reference.column("prompt_id").to_pylist(), reference.column("reference").to_pylist()))
    right = [ref_of[p] for p in samples.column("prompt_id").to_pylist()]  # every response now correct
    regenerate(run_dir, samples.set_column(samples.schema.get_field_index("response"), "response", pa.array(right)))
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=specs, workers=1))
    assert len(log.read_text().splitlines()) == 96  # same keys, new samples file: all rescored
    scores = pq.read_table(*live(run_dir, "scores", 0, "score"))
    assert scores.column("exact_match").to_pylist() == [1.0] * 48


def test_force_rescored_everything(run_dir, user_module, tmp_path):
    log = tmp_path / "calls.txt"
    config = ScoreConfig(rewards=[RewardSpec(name=f"{user_module}:counting", kwargs={"log": str(log)})], workers=1)
    run_stage(score_stage, run_dir, 0, config)
    assert run_stage(score_stage, run_dir, 0, config).skipped
    assert not run_stage(score_stage, run_dir, 0, config, force=True).skipped
    assert len(log.read_text().splitlines()) == 96


def test_run_writes_rejects_and_drop_counts(run_dir, user_module):
    config = ScoreConfig(rewards=[RewardSpec(name="exact_match"),
                                  RewardSpec(name=f"{user_module}:misbehaving", column="bad", timeout_s=1.0)])
    samples = RunStore(run_dir).read("samples", 0)
    responses = samples.column("response").to_pylist()
    responses[:3] = ["NAN", "RAISE", "HANG"]
    regenerate(run_dir, samples.set_column(samples.schema.get_field_index("response"), "response",
                                           pa.array(responses)))
    report = run_stage(score_stage, run_dir, 0, config)
    assert (report.rows_in, report.rows_out, report.drops) == (48, 45, {"invalid_reward": 3})
    rejects = pq.read_table(*live(run_dir, "rejects", 0, "score")).to_pylist()
    assert [r["detail"] for r in rejects] == ["bad: nan", "bad: RuntimeError: reward exploded", "bad: timeout after 1s"]
    assert RunStore(run_dir).load_manifest("score", 0)["drops"] == {"invalid_reward": 3}
    # generate dropped nothing, so it wrote no rejects part; score's is the only one
    rejects_folder = run_dir / "rejects/round=0"
    assert [p for p in rejects_folder.iterdir()] == live(run_dir, "rejects", 0, "score")
    # a rerun that drops nothing takes the part of the attempt before out of the live files (kept on disk)
    regenerate(run_dir, samples)
    report = run_stage(score_stage, run_dir, 0, config)
    assert (report.rows_out, report.drops) == (48, {})
    store = RunStore(run_dir)
    assert store.files("rejects", 0) == [] and sorted(p.name for p in rejects_folder.iterdir()) == sorted(
        rel.rsplit("/", 1)[-1] for rel in store.state.retired if rel.startswith("rejects/round=0/"))
    assert RunStore(run_dir).read("rejects", 0).num_rows == 0


def test_run_needs_samples(tmp_path):
    with pytest.raises(FileNotFoundError, match="no samples for round 3"):
        run_stage(score_stage, tmp_path / "empty", 3)


def test_reward_model_through_the_stage(run_dir, toy_dir, tmp_path):
    from tests.helpers import build_reward_model, plain_forward

    folder = build_reward_model(tmp_path / "rm", toy_dir)
    reward_model = RewardSpec(name="reward_model", column="rm", kwargs={"path": str(folder)})
    run_stage(score_stage, run_dir, 0, ScoreConfig(rewards=[reward_model]))
    got = duckdb.sql(f"""
        SELECT p.prompt || s.response AS text, c.rm FROM read_parquet('{run_dir}/scores/**/*.parquet') c
        JOIN read_parquet('{run_dir}/samples/**/*.parquet') s USING (run_id, round, prompt_id, sample_idx)
        JOIN read_parquet('{run_dir}/prompts/*.parquet') p USING (prompt_id)
        ORDER BY prompt_id, sample_idx""").fetchall()
    expected = plain_forward(folder, [text for text, _ in got[:6]], 0)
    assert [rm for _, rm in got[:6]] == pytest.approx(expected, abs=1e-5)
    assert all(math.isfinite(rm) for _, rm in got)
