"""Multi-turn rollouts in the round loop and the CLI: the `[env]` definition checked with the
model's tokenizer before anything is written (`groupforge run` and `groupforge generate`, exit 2
with one line), and a short `groupforge run` of SmolLM2 (the toy has no chat template) on the
transformers backend against a tool-calling test environment (tests/env_fixtures.py): its
samples have the trajectory columns and its round record the multi-turn keys."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest

from pipelines.models.chat_tasks import write_task
from store.run_files import TRAJECTORY_KEYS
from store.run_store import RunStore
from store.schema import TRAJECTORY_FIELDS
from tests.helpers import groupforge_in_process, round_records

pytestmark = pytest.mark.xdist_group("real_model_hf")

SPEC = """
[run]
name = "multi-turn"
rounds = 1
steps_per_round = 1
seed = 1

[model]
path = "{model}"

[prompts]
train = ["{prompts}/train.parquet"]
eval = "{prompts}/eval.parquet"
per_round = 2
eval_limit = 2

[generator]
backend = "hf"
group_size = 2
max_tokens = 16
temperature = 0.3

[[score.rewards]]
name = "math"

[filter]
drop_zero_variance = false

[train]
batch_size = 4
lr = 1e-5

[eval]
metric = "math"
max_tokens = 8

{env}
"""

SCRIPTED = '[env]\nname = "tests.env_fixtures:ScriptedCalls"\nmax_turns = 2\nmax_tokens = 200\n'


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat-prompts")
    write_task("addition", folder, train=8, eval=2)
    return folder


def _one_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-2000:]
    return lines[0]


BAD_ENVS = [  # (the "registered:" lists also name what other tests of the process registered)
    ('[env]\nname = "no-such-env"\n', "error: [env] unknown environment 'no-such-env'; registered: "),
    ('[env]\ntools = ["no_such_tool"]\n', "error: [env] unknown tool 'no_such_tool'; registered: "),
    ('[env]\ntools = ["tests.env_fixtures:untyped_tool"]\n',
     "error: [env] tool 'untyped_tool': parameter 'x' has no type hint"),
    # SmolLM2's chat template drops `tools`: the model would never see the calculator
    ('[env]\ntools = ["calculator"]\n', "error: [env] the chat template of {model} ignores tools: the prompt it "
                                         "renders does not name calculator"),
]
"""([env] section, the start of the one error line) of definitions no multi-turn generate can use."""


@pytest.mark.parametrize("env,message", BAD_ENVS, ids=["unknown-env", "unknown-tool", "no-hints", "ignored-tools"])
def test_a_bad_environment_is_refused_by_run_and_generate_before_anything_is_written(env, message, real_model,
                                                                                      prompts, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(model=real_model, prompts=prompts, env=env))
    message = message.format(model=real_model)
    run = tmp_path / "run"
    line = _one_error_line(groupforge_in_process("run", spec, "--run-dir", run))
    assert line.startswith(message), line
    assert not run.exists()  # no run folder, so no RUN/_commits "open" row, no log
    out = tmp_path / "generated"
    line = _one_error_line(groupforge_in_process(
        "generate", "--model", real_model, "--prompts", prompts / "train.parquet", "--out", out,
        "--env-config", spec, "--backend", "hf"))
    assert line.startswith(message), line
    assert not out.exists()


def test_an_environment_needs_a_chat_template_and_generate_an_env_section(toy_dir, real_model, prompts, tmp_path):
    """The toy's tokenizer has no chat template: a custom environment without tools (no render
    check) is still refused, since the driver renders every turn with it. A --env-config file
    without an [env] section is refused too."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(model=toy_dir / "model", prompts=prompts, env=SCRIPTED)
                    .replace(f"{prompts}/train.parquet", f"{toy_dir}/train.parquet")
                    .replace(f"{prompts}/eval.parquet", f"{toy_dir}/eval.parquet"))
    run = tmp_path / "run"
    line = _one_error_line(groupforge_in_process("run", spec, "--run-dir", run))
    assert line == (f"error: [env] the tokenizer of model folder {toy_dir}/model has no chat template, which a "
                    "multi-turn generate renders every conversation with: use a model whose tokenizer has one")
    assert not run.exists()
    no_env = tmp_path / "no-env.toml"
    no_env.write_text("[generator]\ngroup_size = 2\n")
    out = tmp_path / "generated"
    line = _one_error_line(groupforge_in_process(
        "generate", "--model", real_model, "--prompts", prompts / "train.parquet", "--out", out,
        "--env-config", no_env))
    assert line.startswith(f"error: config {no_env}: no [env] section"), line
    assert not out.exists()


@pytest.mark.slow
def test_a_multi_turn_run_records_its_trajectories(real_model, prompts, tmp_path):
    """One round of 2 prompts x 2 trajectories, each assistant turn answered by a call of a slow
    tool in the tools environment's worker: the samples have the trajectory columns, the round
    record their tool use, turns and stop reasons (as the samples give them), the progress line
    says so, and round 0's record (no samples) has none of the multi-turn keys."""
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(model=real_model, prompts=prompts, env=SCRIPTED))
    run = tmp_path / "run"
    done = groupforge_in_process("run", spec, "--run-dir", run)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = RunStore(run).read("samples")
    assert samples.num_rows == 4 and {f.name for f in TRAJECTORY_FIELDS} <= set(samples.column_names)
    rows = samples.to_pylist()
    start, record = round_records(run)
    assert not set(TRAJECTORY_KEYS) & set(start)
    calls = [row["tool_calls"] for row in rows]
    assert record["tool_calls"] == sum(calls) and record["tool_errors"] == 0
    assert record["tool_use_rate"] == sum(c > 0 for c in calls) / 4
    assert record["mean_turns"] == sum(row["num_turns"] for row in rows) / 4
    reasons = [row["stop_reason"] for row in rows]
    assert record["stop_reasons"] == {reason: reasons.count(reason) for reason in sorted(set(reasons))}
    assert max(row["num_turns"] for row in rows) == 2 and sum(calls) >= 1  # the environment answered
    for row in rows:  # each answered turn: an assistant message with the call, then the tool's result
        messages = json.loads(row["messages_out"])
        answered = [m for m in messages if m["role"] == "tool"]
        assert all(m["content"] == "5" and m["name"] == "slow_add" for m in answered)
        assert row["tool_calls"] == sum(len(m.get("tool_calls", [])) for m in messages)
    assert pc.all(pc.equal(samples.column("round"), 1)).as_py()
    assert "tool use" in done.stdout and f"tool calls {record['tool_calls']}" in done.stdout
    assert (run / "spec.toml").read_text().count("\n[env]\n") == 1  # the resolved spec keeps it
