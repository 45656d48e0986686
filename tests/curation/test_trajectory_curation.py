"""Curation and exports of trajectories (multi-turn samples): score, filter, label, pair and
export on a hand-made multi-turn round committed through RunStore.commit; the export read by
`datasets`; each trajectory filter's rejects; single-turn tables unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from curation.card import write_card
from curation.env.config import EnvConfig
from curation.env.environments import tool_schemas
from curation.rewards.registry import trl_arguments
from curation.stages import filter as filter_stage
from curation.stages.dataset import append_export
from curation.stages.export import ExportConfig, export_rows, run_with_card
from curation.stages.filter import FilterConfig
from curation.stages.label import LabelConfig
from curation.stages.pair import PairConfig
from curation.stages.runner import run_stage
from curation.stages.score import RewardSpec, ScoreConfig
from store.run_store import RunStore
from store.schema import empty, validate
from tests.helpers import samples_and_scores, trajectory_row, trajectory_table

QUESTIONS = {"p0": ("What is 6*7?", "42"), "p1": ("What is 2*5?", "10")}


def call(expression: str, id: str = "call_1") -> dict:
    return {"id": id, "type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def trajectory(prompt_id: str, sample_idx: int, steps: list[tuple[str, str]], tool_errors: int = 0) -> dict:
    """A samples row of a trajectory: `steps` are (assistant text, its tool call's expression or
    "" for none) for the model's turns; a tool turn answers each call (3 assistant tokens per
    model turn, 2 tool tokens per tool turn)."""
    turns, messages = [], []
    for k, (text, expression) in enumerate(steps):
        turns.append(("assistant", [10 + k] * 3))
        message = {"role": "assistant", "content": text}
        if expression:
            message["tool_calls"] = [call(expression, f"call_{k}")]
            turns.append(("tool", [90, 91]))
            result = "error: bad expression" if "?" in expression else str(eval(expression))  # noqa: S307
            messages += [message, {"role": "tool", "tool_call_id": f"call_{k}", "name": "calculator",
                                   "content": result}]
        else:
            messages.append(message)
    row = trajectory_row(turns, prompt_id=prompt_id, sample_idx=sample_idx)
    row.update(group_size=4, response=steps[-1][0], messages_out=json.dumps(messages, sort_keys=True),
               tool_calls=sum(bool(e) for _, e in steps), tool_errors=tool_errors)
    return row


def tool(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


ROWS = [
    trajectory("p0", 0, [(tool("6*7"), "6*7"), ("42", "")]),              # a tool call, right
    trajectory("p0", 1, [("41", "")]),                                    # one turn, wrong
    trajectory("p0", 2, [(tool("6?7"), "6?7"), ("42", "")], tool_errors=1),  # a failed call, right
    trajectory("p0", 3, [(tool("6*7"), "6*7"), (tool("42*1"), "42*1"), ("42", "")]),  # 3 turns, right
    trajectory("p1", 0, [(tool("2*5"), "2*5"), ("10", "")]),              # right, with the tool
    trajectory("p1", 1, [("10", "")]),                                    # right, the same final text
    trajectory("p1", 2, [("12", "")]),                                    # wrong
    trajectory("p1", 3, [("10", "")]),                                    # the same trajectory as 1
]
ENV = EnvConfig(tools=["calculator"], max_turns=3)


def used_tools(prompts, completions, tool_errors, num_turns, **columns) -> list[float]:
    """A TRL reward over trajectories: 1.0 per tool message in the completion, less 1.0 per
    tool error (the prompt must be a message list, the completion the trajectory's)."""
    out = []
    for prompt, completion, errors in zip(prompts, completions, tool_errors):
        assert isinstance(prompt, list) and prompt[0]["role"] == "user", prompt
        assert completion[-1]["role"] == "assistant", completion
        out.append(sum(m["role"] == "tool" for m in completion) - float(errors))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A multi-turn round committed as generate would (its manifest's config has [env]), then
    score (exact_match + used_tools), filter, label and pair."""
    folder = tmp_path_factory.mktemp("traj") / "run"
    store = RunStore(folder)
    prompts = pa.table({"prompt_id": list(QUESTIONS),
                        "messages": [[{"role": "user", "content": q}] for q, _ in QUESTIONS.values()],
                        "reference": [r for _, r in QUESTIONS.values()]})
    with store.commit("generate", 0, inputs={}, config={"env": ENV.model_dump(mode="json")}) as commit:
        commit.write("samples", trajectory_table(ROWS), part="generate")
        commit.write("rejects", empty("rejects"), part="generate")
        commit.write("prompts", prompts, part="hand-made", round=None)
    rewards = [RewardSpec(name="exact_match"),
               RewardSpec(name="tests.curation.test_trajectory_curation:used_tools", column="tools_used", weight=0.1)]
    run_stage("score", folder, 0, ScoreConfig(rewards=rewards, workers=1))
    run_stage("filter", folder, 0, FilterConfig())
    run_stage("label", folder, 0, LabelConfig())
    run_stage("pair", folder, 0, PairConfig(strategy="all_pairs"))
    return folder


def table(run: Path, name: str) -> list[dict]:
    return RunStore(run).read(name).to_pylist()


def test_score_hands_trl_rewards_the_trajectory_and_exact_match_its_last_turn(run):
    scores = {(r["prompt_id"], r["sample_idx"]): r for r in table(run, "scores")}
    assert {k: r["exact_match"] for k, r in scores.items()} == {
        ("p0", 0): 1.0, ("p0", 1): 0.0, ("p0", 2): 1.0, ("p0", 3): 1.0,
        ("p1", 0): 1.0, ("p1", 1): 1.0, ("p1", 2): 0.0, ("p1", 3): 1.0}
    assert {k: r["tools_used"] for k, r in scores.items()} == {
        ("p0", 0): 1.0, ("p0", 1): 0.0, ("p0", 2): 0.0, ("p0", 3): 2.0,
        ("p1", 0): 1.0, ("p1", 1): 0.0, ("p1", 2): 0.0, ("p1", 3): 0.0}
    assert scores[("p0", 3)]["reward"] == pytest.approx(1.2)


def test_a_single_turn_table_gives_rewards_the_arguments_it_always_did():
    samples, _ = samples_and_scores([{"prompt_id": "p", "sample_idx": 0, "reward": 0.0, "response": "4"}])
    base = samples.select(["prompt_id", "sample_idx", "response", "response_token_ids"]).append_column(
        "prompt", pa.array([None], pa.string())).append_column(
        "messages", pa.array([[{"role": "user", "content": "2+2="}]])).append_column("reference", pa.array(["4"]))
    plain = trl_arguments(base)
    assert plain[1] == [[{"role": "assistant", "content": "4"}]]
    from curation.stages.score import _inputs
    prompts = validate(pa.table({"prompt_id": ["p"], "prompt": ["2+2="]}), "prompts")
    with_nulls = samples.append_column("messages_out", pa.nulls(1, pa.string()))
    assert _inputs(with_nulls, prompts).equals(_inputs(samples, prompts))  # null trajectory columns add nothing


def test_duplicates_compare_whole_trajectories_and_label_pair_keep_whole_trajectories(run):
    rejects = {(r["prompt_id"], r["sample_idx"]): r["reason"] for r in table(run, "rejects")}
    assert rejects == {("p1", 3): "duplicate"}  # p1/1 has p1/0's final text but another trajectory: kept
    groups = {(g["prompt_id"], g["sample_idx"]): g for g in table(run, "groups")}
    assert len(groups) == 7 and all(g["group_kept"] for g in groups.values())
    pairs = table(run, "pairs")
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    assert {(p["prompt_id"], p["chosen_idx"], p["rejected_idx"]) for p in pairs} >= {("p0", 3, 1), ("p1", 0, 2)}


def filtered(cfg: FilterConfig, rows: list[dict] = ROWS) -> dict[tuple[str, int], tuple[str, str]]:
    samples = trajectory_table(rows)
    scores = pa.table({"run_id": ["r"] * len(rows), "round": pa.array([0] * len(rows), pa.int32()),
                       "prompt_id": [r["prompt_id"] for r in rows],
                       "sample_idx": pa.array([r["sample_idx"] for r in rows], pa.int32()),
                       "reward": [float(r["sample_idx"]) for r in rows], "scorer": ["{}"] * len(rows)})
    out = filter_stage.transform({"samples": samples, "scores": scores, "rejects": empty("rejects")}, cfg)
    return {(r["prompt_id"], r["sample_idx"]): (r["reason"], r["detail"]) for r in out.tables["rejects"].to_pylist()}


OFF = {"drop_zero_variance": False, "drop_duplicates": False, "min_group_size": 1}


@pytest.mark.parametrize(("cfg", "expected"), [
    ({"max_turns": 2}, {("p0", 3): ("too_many_turns", "3 assistant turns")}),
    ({"drop_tool_errors": True}, {("p0", 2): ("tool_errors", "1 tool errors")}),
    ({"max_model_tokens": 6}, {("p0", 3): ("too_many_model_tokens", "9 model tokens")}),
    ({"min_model_tokens": 4}, {(p, i): ("too_few_model_tokens", "3 model tokens")
                               for p, i in [("p0", 1), ("p1", 1), ("p1", 2), ("p1", 3)]}),
    ({"max_response_tokens": 8}, {("p0", 3): ("too_long", "13 response tokens")}),  # tool tokens count here
])
def test_each_trajectory_filter_writes_its_reason(cfg, expected):
    assert filtered(FilterConfig(**OFF, **cfg)) == expected


def test_the_trajectory_filters_on_a_single_turn_table():
    """A single-turn sample is a one-turn trajectory: max_turns and drop_tool_errors drop nothing,
    the model-token bounds count its response tokens."""
    rows = [{"prompt_id": "p", "sample_idx": i, "reward": float(i), "n_tokens": 2 + i} for i in range(3)]
    samples, scores = samples_and_scores(rows)

    def reasons(cfg):
        out = filter_stage.transform({"samples": samples, "scores": scores, "rejects": empty("rejects")}, cfg)
        return {r["sample_idx"]: (r["reason"], r["detail"]) for r in out.tables["rejects"].to_pylist()}

    assert reasons(FilterConfig(**OFF, max_turns=1, drop_tool_errors=True)) == {}
    assert reasons(FilterConfig(**OFF, max_model_tokens=3)) == {2: ("too_many_model_tokens", "4 model tokens")}
    assert filter_stage.columns(FilterConfig(max_turns=1))["samples"][-3:] == ["num_turns", "response",
                                                                                "messages_out"]


def load(path: Path):
    from datasets import load_dataset
    return load_dataset("parquet", data_files=str(path), split="train")


def test_sft_and_messages_exports_load_with_datasets_as_tool_calling_conversations(run, tmp_path):
    path, rows, card = run_with_card(run, ExportConfig(format="messages", style="conversational"), tmp_path)
    data = load(path)
    assert rows == len(data) and {"messages", "tools"} <= set(data.column_names)
    row = next(r for r in data if r["prompt_id"] == "p0" and r["sample_idx"] == 3)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert row["messages"][0] == {"role": "user", "content": "What is 6*7?"}
    assert row["messages"][1]["tool_calls"] == [call("6*7", "call_0")]  # arguments stay a dict, no nulls added
    assert row["messages"][2] == {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "42"}
    tools = row["tools"] if isinstance(row["tools"], list) else json.loads(row["tools"])
    assert tools == tool_schemas(["calculator"])
    text = card.read_text()
    assert "## Trajectories" in text and "environment ([env])" in text
    sft = load(run_with_card(run, ExportConfig(format="sft", style="conversational"), tmp_path)[0])
    first = next(r for r in sft if r["prompt_id"] == "p0" and r["sample_idx"] == 3)
    assert first["prompt"] == [{"role": "user", "content": "What is 6*7?"}]
    assert first["completion"] == row["messages"][1:]


def test_preference_pairs_are_whole_trajectories(run, tmp_path):
    path, _, _ = run_with_card(run, ExportConfig(format="preference", style="conversational"), tmp_path)
    data = load(path)
    pairs = {(p["prompt_id"], p["chosen_idx"], p["rejected_idx"]) for p in table(run, "pairs")}
    assert {(r["prompt_id"], r["chosen_idx"], r["rejected_idx"]) for r in data} == pairs
    by_key = {(r["prompt_id"], r["sample_idx"]): json.loads(r["messages_out"]) for r in ROWS}
    for row in data:
        assert row["chosen"] == by_key[(row["prompt_id"], row["chosen_idx"])]
        assert row["rejected"] == by_key[(row["prompt_id"], row["rejected_idx"])]
        assert row["prompt"][0]["role"] == "user" and row["tools"]


def test_a_standard_export_of_trajectories_is_one_clear_error(run):
    for fmt in ("preference", "sft", "messages"):
        with pytest.raises(ValueError, match="style='conversational'") as error:
            export_rows(RunStore(run).snapshot(), ExportConfig(format=fmt, style="standard"))
        assert "\n" not in str(error.value)


def test_a_trajectory_export_appends_to_a_delta_table_as_json_text(run, tmp_path):
    from deltalake import DeltaTable

    target = str(tmp_path / "dataset")
    done = append_export(run, ExportConfig(format="messages", style="conversational"), target)
    assert done.version == 0 and done.rows > 0
    assert append_export(run, ExportConfig(format="messages", style="conversational"), target).version is None
    rows = DeltaTable(target).to_pyarrow_table().to_pylist()
    assert json.loads(rows[0]["messages"][0])["role"] == "user" and json.loads(rows[0]["tools"])


def test_the_card_of_a_single_turn_export_has_no_trajectory_section(tmp_path):
    from tests.curation.test_export import make_run

    make_run(tmp_path / "run")
    path, _, card = run_with_card(tmp_path / "run", ExportConfig(format="sft", style="conversational"),
                                  tmp_path / "out")
    assert "## Trajectories" not in card.read_text() and write_card(path.parent) == card
