"""Export to TRL formats: real run tables in, Parquet that `datasets` loads out."""

from __future__ import annotations

import pyarrow as pa
import pytest

from curation.stages.export import ExportConfig, run
from curation.store.run_store import RunStore
from curation.store.runlog import EXPORTS_DIR

PROMPTS = {"p1": "12+30=", "p2": "40+2="}
RESPONSES = {("p1", 0): "42", ("p1", 1): "41", ("p1", 2): "40", ("p2", 0): "42", ("p2", 1): "7"}
REWARDS = {("p1", 0): 1.0, ("p1", 1): 0.0, ("p1", 2): 0.0, ("p2", 0): 1.0, ("p2", 1): 0.0}


def make_run(root) -> RunStore:
    store = RunStore(root)
    keys = sorted(RESPONSES)
    n = len(keys)
    samples = {
        "run_id": ["r"] * n, "round": pa.array([0] * n, pa.int32()), "prompt_id": [k[0] for k in keys],
        "sample_idx": pa.array([k[1] for k in keys], pa.int32()), "group_size": pa.array([3] * n, pa.int32()),
        "prompt_token_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())), "response": [RESPONSES[k] for k in keys],
        "response_token_ids": pa.array([[5, 2]] * n, pa.list_(pa.int32())),
        "behavior_logprobs": pa.array([[-0.1, -0.2]] * n, pa.list_(pa.float32())), "finish_reason": ["stop"] * n,
        "policy_version": pa.array([0] * n, pa.int64()), "generator": ["g"] * n, "seed": pa.array([1] * n, pa.int64()),
    }
    means = {"p1": 1 / 3, "p2": 0.5}
    groups = {
        "run_id": ["r"] * n, "round": pa.array([0] * n, pa.int32()), "prompt_id": [k[0] for k in keys],
        "sample_idx": pa.array([k[1] for k in keys], pa.int32()), "reward": [REWARDS[k] for k in keys],
        "advantage": [REWARDS[k] - means[k[0]] for k in keys], "group_mean": [means[k[0]] for k in keys],
        "group_std": [0.5] * n, "group_kept": [True] * n,
    }
    pairs = {
        "run_id": ["r", "r"], "round": pa.array([0, 0], pa.int32()), "prompt_id": ["p1", "p2"],
        "chosen_idx": pa.array([0, 0], pa.int32()), "rejected_idx": pa.array([2, 1], pa.int32()),
        "chosen_reward": [1.0, 1.0], "rejected_reward": [0.0, 0.0], "margin": [1.0, 1.0],
        "soft_label": [0.9, 0.9], "weight": [1.0, 1.0],
    }
    prompts = {"prompt_id": list(PROMPTS), "prompt": list(PROMPTS.values()), "reference": ["42", "42"]}
    with store.commit("generate", 0, inputs={}, config={}) as c:
        c.write("samples", samples)
        c.write("prompts", prompts, part="x")
    with store.commit("label", 0, inputs={}, config={}) as c:
        c.write("groups", groups)
    with store.commit("pair", 0, inputs={}, config={}) as c:
        c.write("pairs", pairs)
    return store


def load(path):
    from datasets import load_dataset

    return load_dataset("parquet", data_files=str(path), split="train")


def test_preference_standard_and_conversational(tmp_path):
    make_run(tmp_path / "run")
    path, rows = run(tmp_path / "run", ExportConfig(format="preference"))
    ds = load(path)
    assert rows == 2 and ds.num_rows == 2
    # written atomically (runlog.write_atomic): no temporary file left, readable by everyone
    assert path == tmp_path / "run" / EXPORTS_DIR / "preference-standard.parquet"
    assert [p.name for p in path.parent.iterdir()] == [path.name] and path.stat().st_mode & 0o777 == 0o644
    assert ds[0]["prompt"] == "12+30=" and ds[0]["chosen"] == "42" and ds[0]["rejected"] == "40"
    assert ds[1]["prompt"] == "40+2=" and ds[1]["chosen"] == "42" and ds[1]["rejected"] == "7"
    path, _ = run(tmp_path / "run", ExportConfig(format="preference", style="conversational"))
    ds = load(path)
    assert ds[0]["prompt"] == [{"role": "user", "content": "12+30="}]
    assert ds[0]["chosen"] == [{"role": "assistant", "content": "42"}]
    assert ds[0]["rejected"] == [{"role": "assistant", "content": "40"}]


def test_prompt_only_unpaired_and_sft(tmp_path):
    make_run(tmp_path / "run")
    ds = load(run(tmp_path / "run", ExportConfig(format="prompt_only"))[0])
    assert sorted(ds["prompt"]) == sorted(PROMPTS.values())
    ds = load(run(tmp_path / "run", ExportConfig(format="unpaired"))[0])
    assert ds.num_rows == 5
    labels = {(r["prompt_id"], r["sample_idx"]): r["label"] for r in ds}
    assert labels == {k: REWARDS[k] > 0 for k in RESPONSES}
    ds = load(run(tmp_path / "run", ExportConfig(format="sft"))[0])
    assert sorted(ds["completion"]) == ["42", "42"]


def test_export_of_missing_table_is_a_clear_error(tmp_path):
    store = RunStore(tmp_path / "empty")
    with pytest.raises(ValueError, match="the pairs table is empty"):
        run(store.root, ExportConfig(format="preference"))
    with pytest.raises(Exception, match="format"):
        ExportConfig(format="dpo")



def test_an_export_path_with_dotdot_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'..' is refused in an export path"):
        run(tmp_path / "run", ExportConfig(format="preference"), tmp_path / "run" / ".." / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
