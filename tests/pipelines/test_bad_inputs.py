"""Bad model folders, checkpoints and run folders through the CLI: each gets one `error:` line
naming the file or folder and the problem, exit code 2, no traceback, and nothing written
(README, "Exit codes"). Built here from the toy and one short run, nothing checked in. The CLI
runs in this process, except the commands that start a vLLM engine: those run
`python -m pipelines.cli` in a child process. The prompts-file corpus is
tests/curation/test_bad_prompts.py; spec keys are in test_spec.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from store.run_log import COMMITS
from tests.helpers import FAULTS_SPEC, REPO, edit_commit_row, groupforge_in_process


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The CLI in a child process."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _one_error_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]  # not progress bars
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-2000:]
    return lines[0]


# ---- model folders ----------------------------------------------------------------------------

def _cut(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _config(**changes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


MODEL_CASES = [
    ("no-config", lambda f: (f / "config.json").unlink(), "config.json", "no config.json"),
    ("config-not-json", lambda f: (f / "config.json").write_text("{not json"), "config.json", "not valid JSON"),
    ("no-tokenizer", lambda f: (f / "tokenizer.json").unlink(), "", "no tokenizer"),
    ("not-safetensors", lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 100),
     "model.safetensors", "not a safetensors file, or truncated"),
    ("corrupt-header", lambda f: (f / "model.safetensors").write_bytes(b"\x04" + b"\x00" * 7 + b"{no}" * 100),
     "model.safetensors", "corrupt safetensors header"),
    ("truncated-weights", lambda f: _cut(f / "model.safetensors"), "model.safetensors", "truncated: its tensors end"),
    ("pickled-weights-only", lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"), "",
     "no *.safetensors files (pickled weights are not loaded)"),
    ("needs-remote-code", _config(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), "",
     "groupforge does not run a model folder's code (trust_remote_code is off)"),
    ("unknown-model-type", _config(model_type="no-such-architecture"), "",
     "model_type 'no-such-architecture' is not one this transformers knows"),
]


def _backend_cases() -> list:
    """Both backends for every damage; make_generator checks the folder before either starts, so
    on vllm only the damages a backend reads differently run in `make test` (all: exhaustive)."""
    read_by_backend = {"no-tokenizer", "unknown-model-type", "needs-remote-code"}
    return [pytest.param("hf", *case, id=f"hf-{case[0]}") for case in MODEL_CASES] + [
        pytest.param("vllm", *case, id=f"vllm-{case[0]}",
                     marks=() if case[0] in read_by_backend else pytest.mark.exhaustive) for case in MODEL_CASES]


@pytest.mark.parametrize("backend,name,damage,file,fragment", _backend_cases())
def test_a_bad_model_folder_gets_one_line_naming_it(name, damage, file, fragment, backend, toy_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(toy_dir / "model", model)
    damage(model)
    out = tmp_path / "run"
    cli = _cli if backend == "vllm" else groupforge_in_process  # an engine that fails leaves its state behind
    line = _one_error_line(cli("generate", "--model", str(model), "--prompts", str(toy_dir / "eval.parquet"),
                                "--out", str(out), "--backend", backend, "--max-tokens", "4"))
    assert str(model) in line and file in line and fragment in line, line
    assert not (out / COMMITS).exists() and not list(out.rglob("*.parquet")) if out.exists() else True  # none written


def test_a_tied_embedding_model_samples_the_same_on_both_backends(toy_dir, tmp_path):
    """Not bad: a model whose LM head is its embedding (no lm_head.weight in the file) loads in both
    engines, and they give the same greedy answers, before and after new weights are loaded in
    place (a reload that left vLLM's head stale would answer differently)."""
    model = tmp_path / "tied"
    shutil.copytree(toy_dir / "model", model)
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight").clone()
    save_file(weights, model / "model.safetensors")
    _config(tie_word_embeddings=True)(model)
    from curation.generate.base import tokenize_prompt
    from curation.generate.stage import make_generator

    changed = tmp_path / "tied-changed"  # new weights, the LM head still the embedding
    shutil.copytree(model, changed)
    torch.manual_seed(0)
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}, changed / "model.safetensors")
    answers = []
    for backend in ("hf", "vllm"):
        generator = make_generator(backend, model, dtype="float32")
        ids = [tokenize_prompt(generator.tokenizer, p, None)
               for p in pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:32]]
        before = generator.greedy(ids, max_tokens=4)
        generator.update_weights(changed, policy_version=1)  # in place: the head must follow the embedding
        answers.append((before, generator.greedy(ids, max_tokens=4)))
        generator.close()
    assert answers[0] == answers[1] and any(answers[0][0])
    assert answers[0][0] != answers[0][1]  # the new weights answer differently


def test_a_model_with_its_own_code_loads_only_when_trusted(toy_dir, tmp_path):
    """A folder whose config.json maps to code in the folder (a Llama under another name): refused
    by default (above), loaded by both the sampler and the trainer with trust_remote_code, and it
    is the same model as the toy's."""
    import textwrap

    from curation.generate.base import tokenize_prompt
    from curation.generate.stage import make_generator
    from training.checkpoint import load_model

    model = tmp_path / "custom"
    shutil.copytree(toy_dir / "model", model)
    (model / "configuration_custom.py").write_text(textwrap.dedent("""
        from transformers import LlamaConfig

        class CustomConfig(LlamaConfig):
            model_type = "custom-llama"
    """))
    (model / "modeling_custom.py").write_text(textwrap.dedent("""
        from transformers import LlamaForCausalLM
        from .configuration_custom import CustomConfig

        class CustomForCausalLM(LlamaForCausalLM):
            config_class = CustomConfig
    """))
    _config(model_type="custom-llama", architectures=["CustomForCausalLM"],
            auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                      "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})(model)
    with pytest.raises(ValueError, match="trust_remote_code is off"):
        load_model(model)
    trained = load_model(model, trust_remote_code=True)
    assert type(trained).__name__ == "CustomForCausalLM"
    answers = []
    for folder, trust in ((model, True), (toy_dir / "model", False)):
        generator = make_generator("hf", folder, dtype="float32", trust_remote_code=trust)
        ids = [tokenize_prompt(generator.tokenizer, p, None)
               for p in pq.read_table(toy_dir / "eval.parquet").column("prompt").to_pylist()[:16]]
        answers.append(generator.greedy(ids, max_tokens=4))
        generator.close()
    assert answers[0] == answers[1]


def test_conversations_for_a_model_without_a_chat_template_are_refused_before_the_run_opens(toy_dir, tmp_path):
    """The toy's tokenizer has no chat template: a prompts file of `messages` is refused by `run`
    (naming the file and the model folder) before the run folder or its commit log is written,
    where it used to fail in round 1 on the round's own copy of the prompts."""
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(toy_dir / "model").chat_template
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+{i}="}],
                                           "reference": str(2 * i)}) + "\n" for i in range(8)))
    spec = tmp_path / "spec.toml"
    spec.write_text(FAULTS_SPEC.format(toy=toy_dir, train=f'"{prompts}"'))
    run = tmp_path / "run"
    line = _one_error_line(groupforge_in_process("run", str(spec), "--run-dir", str(run)))
    assert line == (f"error: prompts file {prompts}: the tokenizer of model folder {toy_dir}/model has no chat "
                    "template, so prompts given as 'messages' cannot be rendered: give a 'prompt' column, or a model "
                    "whose tokenizer has one")
    assert not run.exists()  # no run folder, so no RUN/_commits "open" row


# ---- checkpoints and run folders ----------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(toy_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(spec, run folder) of a 2-round toy run with the transformers generator."""
    folder = tmp_path_factory.mktemp("finished")
    spec = folder / "spec.toml"
    spec.write_text(FAULTS_SPEC.format(toy=toy_dir, train=f'"{toy_dir}/train.parquet"'))
    run = folder / "run"
    done = groupforge_in_process("run", spec, "--run-dir", run)
    assert done.returncode == 0, done.stderr[-3000:]
    return spec, run


@pytest.fixture
def copy(finished, tmp_path) -> tuple[Path, Path]:
    spec, run = finished
    shutil.copytree(run, tmp_path / "run")
    return spec, tmp_path / "run"


def _newest_checkpoint(run: Path) -> Path:
    return max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _files_and_bytes(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("name,damage,fragment", [
    ("truncated-weights", lambda c: _cut(c / "model.safetensors"), "truncated: its tensors end"),
    ("missing-optimizer-state", lambda c: (c / "optimizer" / "state.safetensors").unlink(),
     "no optimizer/state.safetensors (the optimizer state)"),
    ("truncated-optimizer-state", lambda c: _cut(c / "optimizer" / "state.safetensors"), "truncated: its tensors end"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_bad_checkpoint_stops_the_resumed_run_with_its_name(name, damage, fragment, copy):
    spec, run = copy
    checkpoint = _newest_checkpoint(run)
    damage(checkpoint)
    before = _files_and_bytes(run)
    line = _one_error_line(groupforge_in_process("run", str(spec), "--run-dir", str(run), "--rounds", "+1"))
    assert str(checkpoint) in line and fragment in line, line
    after = _files_and_bytes(run)
    changed = {k for k in before.keys() & after.keys() if before[k] != after[k]} - {"spec.toml", "pipeline.json"}
    tables = {k for k in after.keys() - before.keys() if k.endswith(".parquet") and not k.startswith("_rounds/")}
    assert not changed and not tables, f"the failed resume wrote {sorted(changed | tables)}"


def _live_part(run: Path, table: str, round: int) -> Path:
    """The one live part file of `table` for `round`, as the run's log lists it."""
    from store.run_store import RunStore

    (rel,) = RunStore(run).files(table, round)
    return run / rel


def _commit_seq(run: Path, stage: str, round: int) -> int:
    """The row of `_commits` of the stage's newest commit for `round`."""
    from store.run_store import RunStore

    return RunStore(run).state.commits[(stage, round)]


def _edit_manifest_of(run: Path, stage: str, round: int, edit) -> Path:
    """`edit(manifest)` on the `_commits` row of the stage's newest commit for `round`; the
    file that holds the row."""
    def row(r: dict) -> dict:
        manifest = json.loads(r["manifest"])
        edit(manifest)
        return {**r, "manifest": json.dumps(manifest)}

    return edit_commit_row(run, _commit_seq(run, stage, round), row)


def _reseal(manifest: dict) -> None:
    from store.verify import seal_of

    manifest.pop("seal")
    manifest["seal"] = seal_of(manifest)


def _truncate_part(run: Path) -> Path:
    part = _live_part(run, "samples", 1)
    _cut(part)
    return part


def _edit_manifest(run: Path) -> Path:
    """A commit's manifest changed by hand: its seal no longer matches."""
    return _edit_manifest_of(run, "score", 1, lambda m: m.update(rows_out=m["rows_out"] + 1))


def _not_json(run: Path) -> Path:
    return edit_commit_row(run, _commit_seq(run, "filter", 1), lambda r: {**r, "manifest": r["manifest"][:40]})


def _foreign_part(run: Path) -> Path:
    part = run / "samples" / "round=2" / "part-x.parquet"
    shutil.copy(_live_part(run, "samples", 2), part)
    return part


def _newer_format(run: Path) -> Path:
    """A manifest a newer groupforge wrote: sealed as it should be, of run format 4."""
    def newer(manifest: dict) -> None:
        manifest["format_version"] = 4
        _reseal(manifest)

    return _edit_manifest_of(run, "label", 2, newer)


def _renamed_column(run: Path) -> Path:
    """A live part file rewritten with a column renamed, and its log entry updated to match
    (sha256, size and seal), so only the table contract can tell."""
    import hashlib

    part = _live_part(run, "groups", 1)
    table = pq.read_table(part)
    pq.write_table(table.rename_columns(["advantage_x" if c == "advantage" else c for c in table.column_names]),
                   part)
    rel = part.relative_to(run).as_posix()
    record = {"sha256": hashlib.sha256(part.read_bytes()).hexdigest(), "size": part.stat().st_size}

    def match(manifest: dict) -> None:
        manifest["output_files"][rel] = record
        _reseal(manifest)

    _edit_manifest_of(run, "label", 1, match)
    for version in (run / "groups" / "_delta_log").glob("*.json"):  # the Delta log's add, by hand too
        lines = version.read_text().splitlines()
        for i, line in enumerate(lines):
            action = json.loads(line)
            if action.get("add", {}).get("path") == rel.split("/", 1)[1]:
                action["add"]["size"] = record["size"]
                lines[i] = json.dumps(action)
        version.write_text("\n".join(lines) + "\n")
    return part


def _linked_exports(run: Path) -> Path:
    outside = run.parent / "elsewhere"
    outside.mkdir()
    (run / "exports").symlink_to(outside)
    return run / "exports"


def _linked_round(run: Path) -> Path:
    outside = run.parent / "elsewhere-round"
    shutil.move(run / "groups" / "round=2", outside)
    (run / "groups" / "round=2").symlink_to(outside)
    return run / "groups" / "round=2"


RUN_CASES = [
    ("truncated-part", _truncate_part, "bytes, but its commit recorded"),
    ("edited-manifest", _edit_manifest, "edited after its commit"),
    ("log-entry-not-json", _not_json, "its manifest is not JSON"),
    ("foreign-part", _foreign_part, "that the run's log does not list (a foreign file"),
    ("newer-format", _newer_format, "written by a newer groupforge (run format 4;"),
    ("renamed-column", _renamed_column, "missing column 'advantage'"),
    ("exports-symlinked-out", _linked_exports, "outside the run folder"),
    ("round-symlinked-out", _linked_round, "outside the run folder"),
]


# the others go through inspect and run (the same check)
EVERY_COMMAND = {"truncated-part", "foreign-part", "log-entry-not-json"}


DAMAGED = [(*case, command) for case in RUN_CASES
           for command in (["inspect", "report", "export", "verify", "run"] if case[0] in EVERY_COMMAND else
                           ["inspect", "export"] if case[0] == "renamed-column" else ["inspect", "run"])]


@pytest.mark.parametrize("name,damage,fragment,command", DAMAGED, ids=[f"{c[0]}-{c[3]}" for c in DAMAGED])
def test_a_damaged_run_folder_is_named_by_every_command(name, damage, fragment, command, copy):
    spec, run = copy
    path = damage(run)
    before = _files_and_bytes(run)
    args = {"inspect": ["inspect", str(run)], "report": ["report", str(run)], "verify": ["verify", str(run)],
            "export": ["export", str(run), "--format", "unpaired"],
            "run": ["run", str(spec), "--run-dir", str(run), "--rounds", "+1"]}[command]
    line = _one_error_line(groupforge_in_process(*args))
    assert str(path) in line and fragment in line, line
    assert _files_and_bytes(run).keys() <= before.keys() | {"spec.toml"}, "a command wrote into the damaged run"


def test_verify_deep_finds_a_changed_byte_that_keeps_the_size(copy):
    _, run = copy
    done = groupforge_in_process("verify", str(run))
    assert done.returncode == 0 and "match" in done.stdout, done.stderr
    size, unit = re.search(r"\d+ manifests, \d+ files \(([0-9.,]+) (KiB|MiB)\) match", done.stdout).groups()
    size = float(size.replace(",", ""))  # a small run's files in KiB, not "0.0 MiB"
    assert size >= 1.0 and (unit == "MiB" or size < 1024), done.stdout
    part = _live_part(run, "scores", 1)
    data = bytearray(part.read_bytes())
    data[8] ^= 0xFF  # in the first column chunk's data, not the footer
    part.write_bytes(bytes(data))
    assert groupforge_in_process("verify", str(run)).returncode == 0  # size and footer unchanged: only the bytes tell
    line = _one_error_line(groupforge_in_process("verify", str(run), "--deep"))
    assert str(part) in line and "sha256 differs" in line


def test_a_table_written_by_hand_reads_as_its_contract_demands(tmp_path):
    """Not through the CLI: RunStore.read names the file and column of a part with a wrong type."""
    from store.run_store import RunStore

    store = RunStore(tmp_path / "run")
    (tmp_path / "run" / "scores" / "round=0").mkdir(parents=True)
    pq.write_table(pa.table({"round": pa.array([0], pa.int32()), "prompt_id": ["x"], "sample_idx": [0],
                             "reward": ["high"]}), tmp_path / "run" / "scores" / "round=0" / "part-x.parquet")
    with pytest.raises(ValueError, match=r"part-x.parquet.*reward"):
        store.read("scores")


def test_a_run_name_whose_folder_is_a_symlink_out_of_runs_is_refused(finished, tmp_path, monkeypatch):
    from pipelines.loop.run import run_pipeline

    spec, _ = finished
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "e2e").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"run folder runs/e2e \(run.name 'e2e'\) is a symlink to .*outside runs/"):
        run_pipeline(spec)
    assert list((tmp_path / "elsewhere").iterdir()) == []
