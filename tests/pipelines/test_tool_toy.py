"""The tool demo's parts: the tool toy (its tokens, chat template and warm start), the greedy eval
of multi-turn runs, and the real model's tool warm start (its conversations and labels).

The demo's curves (accuracy with tools vs without) are bench/tools.py's; these tests check that
the parts do what the curves rely on, on a build small enough for the suite (seconds)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from curation.env.calls import ToolCall, parse_tool_calls
from curation.env.config import EnvConfig
from curation.env.environments import check_environment, tool_schemas
from curation.generate.turns import environment_token_ids, prompt_token_ids
from pipelines.toy.tool_toy import (
    TOOL_WORDS,
    ToolToyConfig,
    build_tool_toy,
    call_text,
    calls_tool,
    conversation,
    make_tool_tokenizer,
    problems,
)
from tests.helpers import REPO

TOY_TOOLS = REPO / "pipelines" / "specs" / "toy-tools.toml"
TINY = ToolToyConfig(n_train=256, n_eval=16, steps=3, batch_size=32, hidden_size=64, num_heads=2,
                     intermediate_size=128, tool_share=0.5)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tool_tokenizer(TINY)


def test_a_call_is_a_handful_of_tokens_and_parses_as_a_hermes_call(tokenizer):
    ids = tokenizer.encode(call_text("347*58"), add_special_tokens=False)
    assert len(ids) == 4 + len("347*58")  # <tool_call>, the JSON head, the expression, its tail, </tool_call>
    assert tokenizer.decode(ids) == call_text("347*58")
    assert parse_tool_calls(call_text("347*58")) == [ToolCall("calculator", {"expression": "347*58"})]


def test_the_template_renders_the_tools_and_the_environment_accepts_it(tokenizer):
    config = EnvConfig(tools=["calculator"])
    assert check_environment(config, tokenizer)  # the template names the tool only when given it
    schemas = tool_schemas(["calculator"])
    with_tools = tokenizer.decode(prompt_token_ids(tokenizer, [{"role": "user", "content": "347*58="}], schemas))
    without = tokenizer.decode(prompt_token_ids(tokenizer, [{"role": "user", "content": "347*58="}], None))
    assert (with_tools, without) == ("<bos>[calculator]347*58=", "<bos>347*58=")


@pytest.mark.parametrize("tools,call", [(True, True), (True, False), (False, False)])
def test_a_supervised_conversation_is_the_template_rendering_with_only_the_model_tokens_labelled(tokenizer, tools,
                                                                                             call):
    ids, labels = conversation(tokenizer, "347*58=", "20126", tools=tools, call=call)
    messages = [{"role": "user", "content": "347*58="}]
    if call:
        messages += [{"role": "assistant", "content": call_text("347*58")}, {"role": "tool", "content": "20126"}]
    messages += [{"role": "assistant", "content": "20126"}]
    schemas = tool_schemas(["calculator"]) if tools else None
    rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=True, return_dict=False)
    assert ids == list(rendered)
    supervised = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])
    assert supervised == (call_text("347*58") + "<eos>" if call else "") + "20126<eos>"
    if call:  # the multi-turn driver appends the tool's turn exactly as the warm start saw it
        tool_ids = environment_token_ids(tokenizer, messages[:2], [messages[2]], schemas, "<eos>")
        start = len(prompt_token_ids(tokenizer, messages[:1], schemas)) + len(
            tokenizer.encode(call_text("347*58"), add_special_tokens=False)) + 1
        assert ids[start:start + len(tool_ids)] == tool_ids and tokenizer.decode(tool_ids) == "(20126)"


def test_the_split_is_seeded_disjoint_and_the_tool_share_is_kept():
    train, eval_ = problems(TINY, seed=0)
    again, _ = problems(TINY, seed=0)
    assert train.equals(again) and (train.num_rows, eval_.num_rows) == (256, 16)
    assert not set(train.column("prompt").to_pylist()) & set(eval_.column("prompt").to_pylist())
    for prompt, reference in zip(train.column("prompt").to_pylist(), train.column("reference").to_pylist()):
        a, b = (int(x) for x in prompt.rstrip("=").split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and reference == str(a * b)
    share = sum(calls_tool(p, 0, 0.1) for p in train.column("prompt").to_pylist()) / train.num_rows
    assert 0.05 < share < 0.15


def test_the_build_writes_a_model_with_its_template_and_is_reused(tmp_path):
    from transformers import AutoTokenizer

    out = build_tool_toy(tmp_path / "toy", config=TINY)
    meta = json.loads((out / "toy.json").read_text())
    assert meta["config"] == TINY.model_dump() and meta["warm_start"]["conversations"] == 2 * 256
    assert 0.0 <= meta["eval_tool_call_probability"] <= 1.0
    assert pq.read_table(out / "eval.parquet").column_names == ["prompt", "reference"]
    loaded = AutoTokenizer.from_pretrained(out / "model")
    assert loaded.chat_template == make_tool_tokenizer(TINY).chat_template
    assert all(word in loaded.get_vocab() for word in TOOL_WORDS)
    stamp = (out / "toy.json").stat().st_mtime_ns
    assert build_tool_toy(tmp_path / "toy", config=TINY) == out and (out / "toy.json").stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def tiny_toy(tmp_path_factory):
    return build_tool_toy(tmp_path_factory.mktemp("tool-toy") / "toy", config=TINY)


def _spec(tmp_path, toy, env: str, name: str = "tools"):
    from pipelines.spec import load_spec

    path = tmp_path / f"{name}.toml"
    path.write_text(TOY_TOOLS.read_text().replace("runs/toy-tools/", f"{toy}/"))
    return path, load_spec(path, overrides=[f"env.name={env}", "prompts.eval_limit=16"] if env else [])


def test_a_multi_turn_eval_through_a_one_turn_environment_is_the_greedy_eval(tmp_path, tiny_toy):
    """The greedy trajectories (top_k 1) against an environment that ends every trajectory after
    the first turn give exactly the texts greedy decoding gives."""
    from curation.generate.stage import make_generator
    from pipelines.loop.steps import eval_set, greedy_trajectories

    _, spec = _spec(tmp_path, tiny_toy, "tests.env_fixtures:OneTurn")
    generator = make_generator("hf", str(tiny_toy / "model"))
    try:
        prompts = eval_set(spec, generator)
        trajectories = greedy_trajectories(spec, generator, prompts)
        prompt_texts = pq.read_table(tiny_toy / "eval.parquet").column("prompt").to_pylist()
        greedy = generator.greedy([generator.tokenize(p, None) for p in prompt_texts], spec.eval.max_tokens)
    finally:
        generator.close()
    assert prompts.prompts == [[{"role": "user", "content": p}] for p in prompt_texts]
    assert [t[-1]["content"] for t in trajectories] == greedy and len(greedy) == 16
    assert all(len(t) == 1 and t[0]["role"] == "assistant" for t in trajectories)


def test_the_tools_spec_runs_a_round_on_the_tool_toy(tmp_path, tiny_toy):
    """toy-tools.toml on a small tool toy: round 0 evaluates greedy trajectories, round 1 samples,
    curates and trains them and records the tool use."""
    from tests.helpers import groupforge_in_process, round_records

    path, _ = _spec(tmp_path, tiny_toy, "")
    run = tmp_path / "run"
    done = groupforge_in_process("run", path, "--run-dir", run, "--set", "run.rounds=1", "--set", "prompts.per_round=8",
                                 "--set", "prompts.eval_limit=8", "--set", "run.steps_per_round=1",
                                 "--set", "train.batch_size=32")
    assert done.returncode == 0, done.stderr[-3000:]
    records = round_records(run)
    assert [r["round"] for r in records] == [0, 1]
    assert records[0]["eval_accuracy"] is not None and records[1]["eval_accuracy"] is not None
    assert records[1]["samples"] == 64 and 0.0 <= records[1]["tool_use_rate"] <= 1.0
    assert records[1]["mean_turns"] >= 1.0 and sum(records[1]["stop_reasons"].values()) == 64
