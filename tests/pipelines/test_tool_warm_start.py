"""The real model's tool warm start (pipelines/models/tool_warm_start.py): its conversations are
the chat template's rendering with only the assistant turns labelled, the calls parse as the
tools environment reads them, and `groupforge model tool-warm-start` writes a model folder
that loads, its weights moved by the steps."""

from __future__ import annotations

import json

import pytest

from curation.env.calls import ToolCall, parse_tool_calls
from curation.env.config import EnvConfig
from curation.env.environments import make_environment
from pipelines.models.chat_tasks import task_rows
from pipelines.models.tool_warm_start import conversation, expression_of
from tests.helpers import groupforge_in_process as groupforge
from training.supervised import supervised_ids

pytestmark = pytest.mark.xdist_group("real_model_hf")


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


def test_the_expression_is_read_from_the_question():
    assert expression_of("What is 347 * 586? Reply with just the number.") == "347 * 586"
    assert expression_of("What is 85 - 37?") == "85 - 37"
    with pytest.raises(ValueError, match="no arithmetic expression"):
        expression_of("Which is larger?")


@pytest.mark.parametrize("calls", [True, False])
def test_a_conversation_is_the_template_rendering_with_only_the_assistant_turns_labelled(tokenizer, calls):
    row = task_rows("long-multiply", 1, seed=3)[0]
    with make_environment(EnvConfig(tools=["calculator"], tools_prompt="system")) as environment:
        messages = conversation(row, environment, calls)
    assert messages[0]["role"] == "system" and "calculator" in messages[0]["content"]
    ids, labels = supervised_ids(tokenizer, messages, None)
    assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    supervised = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])
    answer = row["reference"] + "<|im_end|>\n"
    if calls:
        call = messages[-3]["content"]
        a, b = (int(x) for x in expression_of(row["messages"][0]["content"]).split(" * "))
        assert parse_tool_calls(call) == [ToolCall("calculator", {"expression": f"{a} * {b}"})]
        assert messages[-2] == {"role": "tool", "content": str(a * b)} and row["reference"] == str(a * b)
        assert supervised == call + "<|im_end|>\n" + answer
    else:
        assert supervised == answer and [m["role"] for m in messages] == ["system", "user", "assistant"]
    plain = conversation(row, None, False)
    assert [m["role"] for m in plain] == ["user", "assistant"]


def test_the_command_writes_a_model_folder_that_loads(tmp_path, real_model):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "tools-model"
    done = groupforge("model", "tool-warm-start", "--model", real_model, "--out", out, "--prompts", "2",
                      "--steps", "1", "--batch-size", "2", "--lr", "1e-4")
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((out / "tool_warm_start.json").read_text())
    assert (meta["steps"], meta["prompts"], meta["task"]) == (1, 2, "long-multiply")
    before, after = load_file(real_model / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    again = groupforge("model", "tool-warm-start", "--model", real_model, "--out", out)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
