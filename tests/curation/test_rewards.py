"""Reward functions: golden values for every shipped reward, the registry, the worker pool.

The reward model is a tiny random LlamaForSequenceClassification built here with the toy's
tokenizer; its scores are checked against a plain forward pass, one text at a time.
"""

from __future__ import annotations

import pickle
import sys
import textwrap
import time

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from curation.rewards import get_reward, list_rewards, register_reward, reward_fingerprint, reward_version
from curation.rewards.math_answers import MathVerify
from curation.rewards.pool import run_inline, run_isolated
from curation.rewards.reward_model import RewardModel
from curation.rewards.rules import ExactMatch, LengthPenalty, OverlongPenalty, RegexFormat
from tests.helpers import build_reward_model, plain_forward

USER_MODULE = "gf_user_rewards_r"


@pytest.fixture(scope="module")
def user_module(tmp_path_factory) -> str:
    """A user's reward module on sys.path, as a TRL user would write it."""
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / f"{USER_MODULE}.py").write_text(textwrap.dedent('''
        import os, time

        def contains_reference(prompts, completions, **kwargs):
            return [None if ref is None else float(ref in c) for c, ref in zip(completions, kwargs["reference"])]

        def scaled_length(prompts, completions, scale=1.0, **kwargs):
            return [scale * len(c) for c in completions]

        class Constant:
            def __init__(self, value=0.5):
                self.value = value
            def __call__(self, prompts, completions, **kwargs):
                return [self.value] * len(completions)

        def misbehaving(prompts, completions, **kwargs):
            c = completions[0]
            if c == "HANG":
                time.sleep(60)
            if c == "EXIT":
                os._exit(3)
            if c == "RAISE":
                raise ValueError("boom")
            if c == "TEXT":
                return ["high"]
            if c == "KILL":
                os.kill(os.getpid(), 9)
            return [1.0]
    '''))
    sys.path.insert(0, str(folder))
    yield USER_MODULE
    sys.path.remove(str(folder))
    sys.modules.pop(USER_MODULE, None)


def rows(completions, references=None, token_lengths=None) -> pa.Table:
    """An `inputs` table as the score stage builds it (plain-text prompts)."""
    n = len(completions)
    return pa.table({
        "prompt": ["q"] * n,
        "messages": pa.nulls(n, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        "response": completions,
        "reference": references if references is not None else [None] * n,
        "prompt_id": [f"p{i}" for i in range(n)],
        "sample_idx": pa.array([0] * n, pa.int32()),
        "response_token_ids": pa.array([[7] * k for k in (token_lengths or [1] * n)], pa.list_(pa.int32())),
    })


# ---- rules --------------------------------------------------------------------------


def test_exact_match_golden():
    f = get_reward("exact_match")
    got = f(["q"] * 5, ["42", " 42\n", "4 2", "41", "x"], reference=["42", "42", "42", "42", None])
    assert got == [1.0, 1.0, 0.0, 0.0, None]
    chat = f([[{"role": "user", "content": "q"}]], [[{"role": "assistant", "content": "42 "}]], reference=["42"])
    assert chat == [1.0]


def test_exact_match_vectorized_golden():
    got = ExactMatch().vectorized(pa.chunked_array([["42", " 42\n", "41", "7"]]),
                                  reference=pa.chunked_array([["42", "42", "42", None]]))
    assert got.type == pa.float64()
    assert got.to_pylist() == [1.0, 1.0, 0.0, None]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="ab1 \t\n\u00a0\u3000", max_size=6),
                          st.none() | st.text(alphabet="ab1 \t\n\u00a0\u3000", max_size=6)), min_size=1, max_size=20))
def test_exact_match_vectorized_equals_python(pairs):
    completions, references = [p[0] for p in pairs], [p[1] for p in pairs]
    python = ExactMatch()(["q"] * len(pairs), completions, reference=references)
    arrow = ExactMatch().vectorized(pa.chunked_array([completions], pa.string()),
                                    reference=pa.chunked_array([references], pa.string()))
    assert arrow.to_pylist() == python


def test_regex_golden():
    think = get_reward("regex")
    assert think(["q"] * 4, ["<think>a\nb</think> 42", "42", "<think>a</think><think>b</think>", " <think>a</think>"]) \
        == [1.0, 0.0, 0.0, 0.0]
    answer = get_reward("regex", pattern=r"answer: \d+", mode="search", flags="i")
    assert answer(["q"] * 3, ["so ANSWER: 12", "answer: x", "answer:12"]) == [1.0, 0.0, 0.0]
    full = RegexFormat(pattern=r"\d+", mode="fullmatch", flags="")
    assert full(["q"] * 3, ["123", "123 ", ""]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="mode"):
        RegexFormat(mode="find")
    with pytest.raises(ValueError, match="flag"):
        RegexFormat(flags="q")


def test_length_penalty_golden():
    f = LengthPenalty(target_tokens=3, per_token=0.25)
    ids = [[1] * k for k in (0, 3, 4, 7)]
    assert f(["q"] * 4, ["a"] * 4, response_token_ids=ids) == [0.0, 0.0, -0.25, -1.0]
    assert f(["q"] * 4, ["a"] * 4, completion_ids=ids) == [0.0, 0.0, -0.25, -1.0]  # TRL's column name
    vec = f.vectorized(None, response_token_ids=pa.chunked_array([ids], pa.list_(pa.int32())))
    assert vec.to_pylist() == [0.0, 0.0, -0.25, -1.0]
    with pytest.raises(ValueError, match="response_token_ids"):
        f(["q"], ["a"])


def test_overlong_penalty_golden():
    """DAPO: L_max=10, L_cache=4 -> 0 up to 6 tokens, then (6 - L)/4, -1 beyond 10."""
    f = get_reward("overlong_penalty", max_tokens=10, cache_tokens=4)
    lengths = [0, 6, 7, 8, 10, 11, 50]
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    ids = [[1] * k for k in lengths]
    assert f(["q"] * 7, ["a"] * 7, response_token_ids=ids) == expected
    assert f.vectorized(None, response_token_ids=pa.chunked_array([ids], pa.list_(pa.int32()))).to_pylist() == expected
    with pytest.raises(ValueError, match="cache_tokens"):
        OverlongPenalty(max_tokens=4, cache_tokens=8)


# ---- math ---------------------------------------------------------------------------


def test_math_golden():
    f = MathVerify()
    cases = [
        ("The answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("so $\\frac{2}{4}$", "$\\frac{1}{2}$", 1.0),
        ("1/3", "\\frac{1}{2}", 0.0),
        ("136", "136", 1.0),
        ("It is 1,000 apples", "1000", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{2}", "\\sqrt{4}", 1.0),
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("no idea", "7", 0.0),
        ("7", None, None),
    ]
    got = f(["q"] * len(cases), [c for c, _, _ in cases], reference=[r for _, r, _ in cases])
    assert got == [e for _, _, e in cases]


def test_math_in_the_worker_pool():
    """The stage's way of running it: a process pool, math-verify timeouts off."""
    values, errors = run_isolated(get_reward("math"), rows(["\\boxed{3}", "4", "x"], ["3", "3", "3"]),
                                  timeout_s=30, workers=2)
    assert values == [1.0, 0.0, 0.0] and errors == [None] * 3


# ---- reward model -------------------------------------------------------------------


def test_reward_model_scores_are_the_logit(tmp_path, toy_dir):
    folder = build_reward_model(tmp_path / "rm", toy_dir)
    prompts = ["12+3=", "7+8=", "40+40=", "1+1="]
    completions = ["15", "15", "80000", "2"]
    expected = plain_forward(folder, [p + c for p, c in zip(prompts, completions)], 0)
    batched = get_reward("reward_model", path=str(folder), batch_size=3)(prompts, completions)
    one_by_one = RewardModel(str(folder), batch_size=1)(prompts, completions)
    assert batched == pytest.approx(expected, abs=1e-5)
    assert one_by_one == pytest.approx(expected, abs=1e-5)  # padding does not change a score
    assert len(set(round(x, 4) for x in expected)) > 1  # a random model still separates texts


def test_reward_model_label_by_name(tmp_path, toy_dir):
    folder = build_reward_model(tmp_path / "rm2", toy_dir, num_labels=2)
    expected = plain_forward(folder, ["1+2=3", "1+2=4"], 1)
    assert RewardModel(str(folder), label="good")(["1+2="] * 2, ["3", "4"]) == pytest.approx(expected, abs=1e-5)
    assert RewardModel(str(folder), label=1)(["1+2="] * 2, ["3", "4"]) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="give label"):
        RewardModel(str(folder))(["q"], ["a"])
    with pytest.raises(ValueError, match="no label"):
        RewardModel(str(folder), label="great")(["q"], ["a"])


def test_reward_model_pickles_without_weights_and_versions_by_weights(tmp_path, toy_dir):
    folder = build_reward_model(tmp_path / "rm3", toy_dir)
    rm = RewardModel(str(folder))
    rm(["1+1="], ["2"])
    assert rm._loaded is not None
    clone = pickle.loads(pickle.dumps(rm))
    assert clone._loaded is None and clone(["1+1="], ["2"]) == rm(["1+1="], ["2"])
    assert rm.version.startswith("1+") and len(rm.version) == 14
    assert rm.isolate is False  # runs in the stage's process, batched
    with pytest.raises(FileNotFoundError, match="local"):
        RewardModel(str(tmp_path / "nowhere"))(["q"], ["a"])


# ---- registry -----------------------------------------------------------------------


def test_registry_lists_shipped_rewards():
    names = list_rewards()
    for name in ("exact_match", "math", "regex", "length_penalty", "overlong_penalty", "reward_model"):
        assert name in names and names[name]  # each with a one-line description
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_register_reward_and_reject_a_clash():
    @register_reward("test_constant_two")
    class Two:
        version = "3"

        def __call__(self, prompts, completions, **columns):
            return [2.0] * len(completions)

    assert get_reward("test_constant_two")(["q"], ["a"]) == [2.0]
    assert reward_version(get_reward("test_constant_two")) == "3"
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(Two)


def test_module_function_is_a_trl_reward_unchanged(user_module):
    f = get_reward(f"{user_module}:contains_reference")
    assert f(["q", "q", "q"], ["x=42", "41", "7"], reference=["42", "42", None]) == [1.0, 0.0, None]
    scaled = get_reward(f"{user_module}:scaled_length", scale=0.5)  # kwargs bound
    assert scaled(["q"], ["abcd"]) == [2.0]
    assert get_reward(f"{user_module}:Constant", value=0.25)(["q"], ["a"]) == [0.25]  # a class is instantiated
    with pytest.raises(ValueError, match="cannot import"):
        get_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module_xyz:f")


def test_fingerprints_follow_version_and_kwargs(user_module):
    em = get_reward("exact_match")
    assert reward_fingerprint("exact_match", em, {}) == "exact_match@1#44136fa355b3"
    a = reward_fingerprint("regex", get_reward("regex", pattern="a"), {"pattern": "a"})
    b = reward_fingerprint("regex", get_reward("regex", pattern="b"), {"pattern": "b"})
    assert a != b and a.startswith("regex@1#")
    user = get_reward(f"{user_module}:contains_reference")
    assert reward_version(user).startswith("src-")  # no `version`: a hash of its source


@pytest.mark.parametrize("name, kwargs", [("exact_match", {}), ("math", {}), ("regex", {"pattern": "a+"}),
                                          ("length_penalty", {}), ("overlong_penalty", {})])
def test_shipped_rewards_pickle(name, kwargs):
    f = get_reward(name, **kwargs)
    clone = pickle.loads(pickle.dumps(f))
    args = (["q"], ["aa"])
    columns = {"reference": ["aa"], "response_token_ids": [[1, 2]]}
    assert clone(*args, **columns) == f(*args, **columns)


# ---- the worker pool ----------------------------------------------------------------


def test_pool_isolates_hangs_crashes_and_errors(user_module):
    completions = ["a", "HANG", "b", "EXIT", "c", "RAISE", "TEXT", "d", "KILL"]
    tic = time.monotonic()
    values, errors = run_isolated(get_reward(f"{user_module}:misbehaving"), rows(completions), timeout_s=1.0,
                                  workers=2, chunk_rows=3)
    seconds = time.monotonic() - tic
    assert values == [1.0, None, 1.0, None, 1.0, None, None, 1.0, None]
    assert errors[8] == "reward worker died (signal SIGKILL)"
    assert errors[1] == "timeout after 1s"
    assert errors[3] == "reward worker died (exit code 3)"
    assert errors[5] == "ValueError: boom"
    assert errors[6].startswith("TypeError: reward function returned a str score")
    assert [errors[i] for i in (0, 2, 4, 7)] == [None] * 4
    assert seconds < 20  # not 60: the hanging worker was killed


def test_pool_keeps_rows_in_order_across_chunks_and_workers(user_module):
    completions = ["x" * (i % 13) for i in range(200)]
    values, errors = run_isolated(get_reward(f"{user_module}:scaled_length", scale=2.0), rows(completions),
                                  timeout_s=10, workers=2, chunk_rows=7)
    assert values == [2.0 * len(c) for c in completions] and errors == [None] * 200


def test_pool_refuses_a_closure():
    def local(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(ValueError, match="module level"):
        run_isolated(local, rows(["a"]), timeout_s=1, workers=1)


def test_inline_runner_finds_the_failing_row(user_module):
    values, errors = run_inline(get_reward(f"{user_module}:misbehaving"), rows(["a", "RAISE", "b"]), batch_rows=8)
    assert values == [1.0, None, 1.0]
    assert errors == [None, "ValueError: boom", None]


@pytest.mark.parametrize("module", ["registry", "rules", "math_answers"])
def test_docstring_examples_hold(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"curation.rewards.{module}"))
    assert result.attempted > 0 and result.failed == 0
