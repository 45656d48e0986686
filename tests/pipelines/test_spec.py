"""Pipeline specs: every shipped spec validates; bad specs fail with the key and the file."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from pipelines.spec import PipelineSpec, dump_toml, load_spec, parse_overrides, resolved_toml
from pipelines.studies.compare_spec import check_comparable, load_compare
from tests.helpers import REPO, groupforge_in_process

SPECS = sorted((REPO / "pipelines" / "specs").glob("*.toml"))


def test_the_expected_specs_are_shipped():
    names = {p.name for p in SPECS}
    for name in ("toy-grpo.toml", "toy-gspo.toml", "toy-pairwise.toml", "toy-sft.toml", "compare.toml",
                 "gpu-math-grpo.toml", "gpu-cluster.toml", "compare-scratchpad.toml", "toy-tools.toml",
                 "smollm2-tools.toml",
                 *(f"toy-scratchpad-{objective}.toml" for objective in ("grpo", "gspo", "pairwise", "sft"))):
        assert name in names, name


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_shipped_spec_validates(path, toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)  # spec paths are relative to the repo root, where `make demo` runs
    toy = ("runs/toy-scratchpad" if "scratchpad" in path.name else
           "runs/toy-reverse-512" if "family" in path.name else "runs/toy")
    if path.name.startswith("compare"):
        specs, out = load_compare([path], check_files=toy == "runs/toy")
        assert {s.train.objective for s in specs.values()} == {"grpo", "gspo", "pairwise", "sft"}
        assert {s.run.rounds for s in specs.values()} == {tomllib.loads(path.read_text())["compare"]["rounds"]}
        assert {s.model.path for s in specs.values()} == {f"{toy}/model"}
        return
    gpu = path.name.startswith("gpu-")
    if path.name.startswith("smollm2"):  # the real model (make real-model); its prompts are written by make demo-real
        spec = load_spec(path, check_files=False)
        tools = path.name == "smollm2-tools.toml"  # the tool warm start's folder (make demo-real-tools)
        assert spec.model.path == "runs/models/SmolLM2-135M-Instruct" + ("-tools" if tools else "")
        assert spec.train.token_budget is None
        assert [r.name for r in spec.score.rewards] == ["math"] and spec.eval.metric == "math"
        assert (spec.env is not None and spec.env.tools == ["calculator"]) == tools
        return
    if path.name == "toy-tools.toml":  # the tool toy: make toy-tools (test_tool_toy.py builds a small one)
        spec = load_spec(path, check_files=False)
        assert spec.model.path == "runs/toy-tools/model" and spec.env.tools == ["calculator"]
        assert spec.env.tools_prompt == "template" and spec.eval.metric == "exact_match"
        return
    # the GPU example names a model this machine lacks; the scratchpad and family toys are built by their own tests
    spec = load_spec(path, check_files=not gpu and toy == "runs/toy")
    assert isinstance(spec, PipelineSpec)
    if gpu:
        assert spec.generator.backend == "vllm" and spec.generator.dtype == "bfloat16"
        assert spec.train.dtype == "bfloat16"
        if path.name == "gpu-cluster.toml":  # 4 engines + 4 trainer ranks, a GPU each: 8 GPUs
            g, t = spec.generator, spec.train
            assert g.uses_ray and g.engines * g.engine_gpus + t.nproc * t.rank_gpus == 8
            assert t.strategy == "fsdp2" and spec.run.overlap == 1
            from curation.generate.stage import RAY_KEYS

            assert set(RAY_KEYS) <= set(g.generator_kwargs("vllm"))
    else:
        assert spec.model.path == f"{toy}/model"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


GOOD = """
[run]
name = "t"
[model]
path = "runs/toy/model"
[prompts]
train = ["runs/toy/train.parquet"]
eval = "runs/toy/eval.parquet"
"""


@pytest.mark.parametrize("extra,message", [
    ("[train]\nlearning_rate = 1e-4\n", "train.learning_rate: Extra inputs are not permitted"),
    ("[generator]\ngroup_size = 'eight'\n", "generator.group_size: Input should be a valid integer"),
    ("[filter]\nmin_group_size = -1\n", "filter.min_group_size"),
    ("[colour]\nx = 1\n", "colour: Extra inputs are not permitted"),
    ("[train]\nrounds = [1]\n", "train.rounds is set by the round loop"),
    ("[train]\nseed = 1\n", "train.seed is set by the round loop from run.seed"),
    ("[train]\nseed = 0\n", "train.seed is set by the round loop from run.seed"),  # even at the default
    ("[train]\ntrust_remote_code = true\n", "set [model] trust_remote_code"),
    ("[generator]\nseed = 1\n", "generator.seed: Extra inputs are not permitted"),
    ("[generator]\ngroup_size = 0\n", "generator.group_size: Value error, group_size must be >= 1, got 0"),
    ("[generator]\ntemperature = 0.0\n", "generator.temperature: Value error, temperature must be > 0"),
    ("[generator]\ngpu_memory_utilization = 1.5\n", "generator.gpu_memory_utilization: Input should be less"),
    ("[eval]\nevery = 0\n", "eval.every: Input should be greater than or equal to 1"),
    ("[generator]\nengines = 0\n", "generator.engines: Input should be greater than or equal to 1"),
    ("[generator]\nengine_cpus = 0\n", "generator.engine_cpus: Input should be greater than 0"),
    ("[train]\nnproc = 2\n", "train.nproc = 2 needs train.strategy = 'ddp' or 'fsdp2'"),
    ("[train]\nrollout_correction = 'token_mask'\n", "needs old_logprobs = 'recompute'"),
    ("[env]\nname = 'tools'\ntool = ['calculator']\n", "env.tool: Extra inputs are not permitted"),
    ("[env]\nmax_turns = 0\n", "env.max_turns: Input should be greater than or equal to 1"),
    ("[env]\ntools = 'calculator'\n", "env.tools: Input should be a valid list"),
    ("[env]\ntools = ['calculator', 'calculator']\n", "env.tools: Value error, tool 'calculator' is listed twice"),
    ("[env]\ntool_timeout_s = 0\n", "env.tool_timeout_s: Input should be greater than 0"),
])
def test_bad_specs_name_the_key_and_the_file(tmp_path, toy_dir, monkeypatch, extra, message):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, GOOD + extra)
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("run_keys,message", [
    ("checkpoint_every = 0", "run.checkpoint_every: Input should be greater than or equal to 1"),
    ("refill = {min_kept_groups = 8}", "run.refill.max_extra_prompts: Field required"),
    ("refill = {min_kept_groups = 8, max_extra_prompts = 8, max_prompts = 1}",
     "run.refill.max_prompts: Extra inputs are not permitted"),
    ("overlap = 1", "run.overlap = 1 samples while the trainer trains, so the engines must run in other processes"),
    ("overlap = 2", "run.overlap: Input should be less than or equal to 1"),
])
def test_bad_run_keys_name_the_key_and_the_file(tmp_path, toy_dir, monkeypatch, run_keys, message):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, GOOD.replace('name = "t"', f'name = "t"\n{run_keys}'))
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_loop_options_default_off_and_round_trip_through_the_resolved_spec(tmp_path, toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_spec(_write(tmp_path, GOOD))
    assert (spec.eval.every, spec.run.checkpoint_every, spec.run.refill) == (1, 1, None)
    text = GOOD.replace('name = "t"', 'name = "t"\ncheckpoint_every = 4\n'
                        'refill = {min_kept_groups = 24, max_extra_prompts = 64}') + "[eval]\nevery = 5\n"
    spec = load_spec(_write(tmp_path, text))
    assert (spec.eval.every, spec.run.checkpoint_every) == (5, 4)
    assert spec.run.refill.model_dump() == {"min_kept_groups": 24, "max_extra_prompts": 64, "max_calls": 4}
    resolved = _write(tmp_path, resolved_toml(spec))  # what RUN/spec.toml holds
    assert load_spec(resolved) == spec


def test_the_env_section_is_optional_and_round_trips_through_the_resolved_spec(tmp_path, toy_dir, monkeypatch):
    """No [env]: single-turn, and RUN/spec.toml has no [env] (its bytes as before the section
    existed); an [env] with its keys loads, and loads back the same from the resolved spec."""
    monkeypatch.chdir(REPO)
    plain = load_spec(_write(tmp_path, GOOD))
    assert plain.env is None and "[env]" not in resolved_toml(plain) and "env" not in plain.model_dump(
        exclude_none=True)
    text = GOOD + ("[env]\nname = 'tools'\ntools = ['calculator']\nmax_turns = 3\nmax_tokens = 256\n"
                   "tool_timeout_s = 2.5\nkwargs = {level = 2}\n")
    spec = load_spec(_write(tmp_path, text))
    assert spec.env.model_dump(include={"name", "tools", "max_turns", "max_tokens", "tool_timeout_s", "kwargs"}) == {
        "name": "tools", "tools": ["calculator"], "max_turns": 3, "max_tokens": 256, "tool_timeout_s": 2.5,
        "kwargs": {"level": 2}}
    resolved = resolved_toml(spec)
    assert resolved.replace("\n[env]\n", "\n[X]\n", 1).count("[X]") == 1  # one [env] section
    assert load_spec(_write(tmp_path, resolved)) == spec
    assert load_spec(_write(tmp_path, GOOD), overrides=["env.tools=['calculator']"]).env.tools == ["calculator"]


def test_overrides_set_keys_of_any_section_and_bad_ones_fail(tmp_path, toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    assert parse_overrides(["train.lr=1e-4", "prompts.per_round=64", "generator.backend=hf",
                            "prompts.choice.strategy=informative"]) == {
        "train": {"lr": 1e-4}, "prompts": {"per_round": 64, "choice": {"strategy": "informative"}},
        "generator": {"backend": "hf"}}
    for bad in ("lr=1", "train.lr", "train..lr=1"):
        with pytest.raises(ValueError, match="section.key=value"):
            parse_overrides([bad])
    spec = load_spec(_write(tmp_path, GOOD), overrides=["run.rounds=7", "prompts.choice.strategy=informative"])
    assert spec.run.rounds == 7 and spec.prompts.choice.strategy == "informative"
    assert spec.train == load_spec(_write(tmp_path, GOOD)).train  # the rest of the file as it was
    with pytest.raises(ValueError, match="train.nope"):
        load_spec(_write(tmp_path, GOOD), overrides=["train.nope=1"])


def test_missing_model_folder_and_cli_exit_code(tmp_path, toy_dir):
    path = _write(tmp_path, GOOD.replace("runs/toy/model", "runs/no-such-model"))
    out = groupforge_in_process("run", path, "--run-dir", tmp_path / "r")
    assert out.returncode == 2
    assert "model.path runs/no-such-model: not a Hugging Face model folder" in out.stderr
    assert not (tmp_path / "r").exists()  # nothing created for a spec that fails validation
    out = groupforge_in_process("run", _write(tmp_path, GOOD + "[run]\n"), "--run-dir", tmp_path / "r")
    assert out.returncode == 2 and "not valid TOML" in out.stderr
    out = groupforge_in_process("run", _write(tmp_path, GOOD), "--set", "run.rounds=zero", "--run-dir", tmp_path / "r")
    assert out.returncode == 2 and "run.rounds" in out.stderr and not (tmp_path / "r").exists()


def test_compare_rejects_unequal_budgets(toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    a = load_spec(REPO / "pipelines/specs/toy-grpo.toml")
    b = a.model_copy(update={"run": a.run.model_copy(update={"name": "other", "rounds": a.run.rounds + 1})})
    with pytest.raises(ValueError, match="differs from a in run.rounds"):
        check_comparable({"a": a, "b": b})


def test_generator_section_gives_the_sampling_and_generator_settings(toy_dir, monkeypatch):
    from curation.generate.base import GENERATOR_DEFAULTS, SamplingConfig

    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "pipelines/specs/toy-grpo.toml")
    sampling = spec.generator.sampling(spec.run.seed)
    assert sampling == SamplingConfig(group_size=8, max_tokens=8, temperature=1.0, seed=spec.run.seed)
    # the values a generate manifest records are those of before (existing runs stay up to date)
    assert sampling.as_dict() == {"group_size": 8, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                  "seed": 0}
    assert spec.generator.backend == "auto"  # resolved when the generator starts (resolve_backend)
    assert spec.generator.generator_kwargs("vllm") == {"dtype": "float32", "max_model_len": None,
                                                       "gpu_memory_utilization": 0.5, "tensor_parallel_size": 1}
    assert spec.generator.generator_kwargs("hf") == {"dtype": "float32", "max_model_len": None}
    assert spec.generator.gpu_memory_utilization == GENERATOR_DEFAULTS.gpu_memory_utilization


def test_importing_the_spec_loads_neither_torch_nor_matplotlib():
    code = ("import sys, pipelines.spec, pipelines.cli.main; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["..", ".", "../up", ".hidden"])
def test_a_run_name_cannot_leave_the_runs_folder(tmp_path, toy_dir, monkeypatch, name):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, GOOD.replace('name = "t"', f'name = "{name}"'))
    with pytest.raises(ValueError, match="run.name: String should match pattern"):
        load_spec(path)


# ---- every key wrong once --------------------------------------------------------------------

def _section_model(annotation: object) -> type:
    """The model of a spec section (`EnvConfig | None` -> EnvConfig: an optional section)."""
    models = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return models[0]


def _leaf_keys() -> list[tuple[str, str, object]]:
    """(section, key, pydantic FieldInfo) of every key of every spec section."""
    return [(section, key, field) for section, info in PipelineSpec.model_fields.items()
            for key, field in _section_model(info.annotation).model_fields.items()]


FREE_TABLES = {("env", "kwargs")}
"""Keys that take any table (a custom environment's settings, read by its factory)."""


def _with(section: str, key: str, value: object) -> str:
    """GOOD with [section] key = value (replacing GOOD's own, adding the section if need be)."""
    data = tomllib.loads(GOOD)
    data.setdefault(section, {})[key] = value
    return dump_toml(data)


def _bound(field) -> tuple[str, object] | None:
    """A value just outside the first numeric bound of `field` (ge, gt, le, lt), if it has one."""
    for meta in field.metadata:
        for name, outside in (("ge", lambda b: b - 1), ("gt", lambda b: b), ("le", lambda b: b + 1),
                              ("lt", lambda b: b)):
            bound = getattr(meta, name, None)
            if bound is not None:
                return name, outside(bound)
    return None


@pytest.mark.parametrize("section,key", [(s, k) for s, k, _ in _leaf_keys() if (s, k) not in FREE_TABLES],
                         ids=lambda x: x)
def test_every_spec_key_with_a_wrong_type_is_named_with_the_file(section, key, tmp_path, toy_dir, monkeypatch):
    """A table where a key wants a number, string, list or setting (or, for a key that takes a
    table, a table with an unknown key): the error names section.key and the spec file."""
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, _with(section, key, {"not_a_key": 1}))
    with pytest.raises(ValueError) as err:
        load_spec(path, check_files=False)
    assert f"{section}.{key}" in str(err.value) and str(path) in str(err.value), str(err.value)


@pytest.mark.parametrize("section", list(PipelineSpec.model_fields))
def test_an_unknown_key_in_every_section_is_named_with_the_file(section, tmp_path, toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, _with(section, "no_such_key", 1))
    with pytest.raises(ValueError) as err:
        load_spec(path, check_files=False)
    assert f"{section}.no_such_key: Extra inputs are not permitted" in str(err.value) and str(path) in str(err.value)


BOUNDED = [(s, k, _bound(f)) for s, k, f in _leaf_keys() if _bound(f) is not None]


@pytest.mark.parametrize("section,key,bound", BOUNDED, ids=[f"{s}.{k}" for s, k, _ in BOUNDED])
def test_every_bounded_spec_key_out_of_range_is_named_with_the_file(section, key, bound, tmp_path, toy_dir,
                                                                     monkeypatch):
    monkeypatch.chdir(REPO)
    name, value = bound
    path = _write(tmp_path, _with(section, key, value))
    with pytest.raises(ValueError) as err:
        load_spec(path, check_files=False)
    words = {"ge": "greater than or equal", "gt": "greater than", "le": "less than or equal", "lt": "less than"}
    assert f"{section}.{key}: Input should be {words[name]}" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("key,value,message", [
    ("model.path", "runs/absent-model", "model.path runs/absent-model"),
    ("prompts.train", ["runs/absent.parquet"], "runs/absent.parquet"),
    ("prompts.eval", "runs/absent-eval.parquet", "runs/absent-eval.parquet"),
])
def test_a_missing_file_in_a_spec_is_named_with_the_key(key, value, message, tmp_path, toy_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, _with(*key.split("."), value))
    with pytest.raises(ValueError) as err:
        load_spec(path)
    assert message in str(err.value) and str(path) in str(err.value), str(err.value)
