"""`groupforge generate --backend vllm` on the toy, in child processes: the console keeps
groupforge's own lines, and what vLLM, transformers, torch and Python warnings print goes to
RUN/logs/generate.log; an error raised inside the engine is one line naming that log, exit 1,
its traceback in the log. The two commands run at once (each starts an engine)."""

from __future__ import annotations

import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import cli_all

SECRET = "do-not-log-8d1f"
"""An environment variable's value that must not reach the log (vLLM logs its config)."""

LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|DEBUG)\b|Warning:|Loading safetensors|\[W\d{4}")
"""A line the libraries print: vLLM's and transformers' records, warnings, C++ warnings, load bars."""


@pytest.fixture(scope="module")
def generated(toy_dir, tmp_path_factory):
    """(the good run folder and its result, the failing run folder and its result)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("command-logs")
    prompts = folder / "prompts.parquet"
    pq.write_table(pq.read_table(toy_dir / "eval.parquet").slice(0, 8), prompts)
    # A tokenizer with 100 tokens the model was never resized for: their ids are past vLLM's
    # (padded) embedding table, which fails inside the engine's forward pass.
    model = folder / "tokenizer-past-the-embedding"
    shutil.copytree(toy_dir / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(100)])
    tokenizer.save_pretrained(model)
    past = folder / "past.parquet"
    pq.write_table(pa.table({"prompt": ["12+<extra_99>="], "reference": ["12"]}), past)
    good, bad = folder / "good", folder / "bad"
    common = ["--backend", "vllm", "-G", "2", "--max-tokens", "4"]
    env = {"GROUPFORGE_TEST_SECRET": SECRET}
    done = cli_all([(["generate", "--model", toy_dir / "model", "--prompts", prompts, "--out", good, *common], env),
                    (["generate", "--model", model, "--prompts", past, "--out", bad, *common], env)])
    return (good, done[0]), (bad, done[1])


def test_the_engines_output_goes_to_the_run_log(generated):
    (run, done), _ = generated
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generate round 0" in done.stdout and "samples" in done.stdout
    printed = [line for line in (done.stdout + done.stderr).splitlines() if LIBRARY_LINE.search(line)]
    assert not printed, printed
    log = (run / "logs" / "generate.log").read_text()
    assert log.startswith("---- groupforge generate, pid ")
    assert re.search(r"^\S+ \S+ WARNING vllm\.", log, re.M) and re.search(r"^\S+ \S+ INFO vllm\.", log, re.M), log
    assert "Initializing a V1 LLM engine" in log
    assert SECRET not in log


def test_an_error_inside_the_engine_is_one_line_naming_the_log(generated):
    _, (run, done) = generated
    log = run / "logs" / "generate.log"
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors == [f"error: the vllm engine failed: IndexError: index out of range in self (details: {log}; "
                      "--debug for the traceback)"], done.stderr[-3000:]
    assert not [line for line in (done.stdout + done.stderr).splitlines() if LIBRARY_LINE.search(line)]
    text = log.read_text()
    assert "ERROR groupforge: the vllm engine failed: IndexError" in text
    assert "Traceback (most recent call last)" in text and "in embedding" in text
