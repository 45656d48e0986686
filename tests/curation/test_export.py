"""Export to TRL formats: real run tables in, Parquet that `datasets` loads out."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.card import CARD_MARKER
from curation.stages.export import ExportConfig, export_path, run
from store.run_files import EXPORTS_DIR
from store.run_store import RunStore
from tests.helpers import error_line, groupforge_in_process

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
    # written atomically (storage.write_atomic): no temporary file left, readable by everyone
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


# ---------------------------------------------------------------------------------------------
# --out: a .parquet file, or a folder; either way a folder that `datasets` loads with its card
# ---------------------------------------------------------------------------------------------


def export_cli(cwd, *args) -> subprocess.CompletedProcess:
    """`groupforge export` run from `cwd` (so that a relative --out lands there)."""
    return groupforge_in_process("export", *args, cwd=cwd)


def listing(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if "run" not in p.relative_to(folder).parts}


def test_out_without_a_suffix_is_a_folder_with_the_export_and_its_card(tmp_path):
    from datasets import load_dataset

    make_run(tmp_path / "run")
    proc = export_cli(tmp_path, "run", "--format", "preference", "--out", "pairs")  # a new name
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr  # no README.md anywhere: nothing to warn about
    folder = tmp_path / "pairs"
    assert listing(tmp_path) == {"pairs", "pairs/preference-standard.parquet", "pairs/README.md"}
    assert "to pairs/preference-standard.parquet" in proc.stdout and "dataset card: pairs/README.md" in proc.stdout
    assert CARD_MARKER in (folder / "README.md").read_text()
    ds = load_dataset(str(folder))["train"]
    assert ds["chosen"] == ["42", "42"] and ds["rejected"] == ["40", "7"]

    # an existing folder: the next export goes beside the first one, and the card lists both
    proc = export_cli(tmp_path, "run", "--format", "sft", "--out", folder)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert {p.name for p in folder.iterdir()} == {"preference-standard.parquet", "sft-standard.parquet", "README.md"}
    assert sorted(load_dataset(str(folder), "sft-standard")["train"]["completion"]) == ["42", "42"]
    assert load_dataset(str(folder), "preference-standard")["train"].num_rows == 2


def test_out_ending_in_parquet_is_that_file_and_its_folder_gets_the_card(tmp_path):
    from datasets import load_dataset

    make_run(tmp_path / "run")
    out = tmp_path / "data" / "my-pairs.parquet"  # in a folder that does not exist yet
    proc = export_cli(tmp_path, "run", "--format", "preference", "--out", out)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert listing(tmp_path) == {"data", "data/my-pairs.parquet", "data/README.md"}
    assert load_dataset("parquet", data_files=str(out), split="train")["chosen"] == ["42", "42"]
    card = (tmp_path / "data" / "README.md").read_text()
    assert CARD_MARKER in card and "my-pairs.parquet" in card
    # a card groupforge wrote is rewritten by the next export into the folder
    assert export_cli(tmp_path, "run", "--format", "sft", "--out", tmp_path / "data" / "sft.parquet").returncode == 0
    card = (tmp_path / "data" / "README.md").read_text()
    assert "config_name: my-pairs" in card and "config_name: sft" in card
    assert load_dataset(str(tmp_path / "data"), "my-pairs")["train"]["rejected"] == ["40", "7"]
    assert load_dataset(str(tmp_path / "data"))["train"].column_names[:3] == ["prompt_id", "prompt", "round"]


@pytest.mark.parametrize("form", ["file", "folder"])
def test_a_readme_groupforge_did_not_write_is_kept_and_named(tmp_path, form):
    make_run(tmp_path / "run")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "README.md").write_text("# my notes\n")
    out = folder / "p.parquet" if form == "file" else folder
    proc = export_cli(tmp_path, "run", "--format", "preference", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (folder / "README.md").read_text() == "# my notes\n"
    written = folder / ("p.parquet" if form == "file" else "preference-standard.parquet")
    assert pq.read_metadata(written).num_rows == 2
    assert f"warning: {folder / 'README.md'} was not written by groupforge" in proc.stderr
    assert "dataset card" not in proc.stdout


@pytest.mark.parametrize("out", ["pairs.jsonl", "pairs.csv", "sub/pairs.json"])
def test_out_with_another_suffix_is_one_error_exit_2_and_writes_nothing(tmp_path, out):
    make_run(tmp_path / "run")
    proc = export_cli(tmp_path, "run", "--format", "preference", "--out", out)
    assert proc.returncode == 2
    line = error_line(proc)
    assert line.startswith(f"error: --out {out}: exports are Parquet, not .{out.rsplit('.', 1)[1]}; "
                           "--out accepts a path ending in .parquet, or a folder")
    assert listing(tmp_path) == set()


def test_export_path(tmp_path):
    cfg = ExportConfig(format="sft", style="conversational")
    name = "sft-conversational.parquet"
    (tmp_path / "folder.v2").mkdir()
    (tmp_path / "dir.parquet").mkdir()
    (tmp_path / "file").write_text("")
    assert export_path(tmp_path / "run", cfg) == tmp_path / "run" / EXPORTS_DIR / name
    assert export_path(tmp_path / "run", cfg, tmp_path / "a.parquet") == tmp_path / "a.parquet"
    assert export_path(tmp_path / "run", cfg, tmp_path / "new") == tmp_path / "new" / name
    assert export_path(tmp_path / "run", cfg, tmp_path / "folder.v2") == tmp_path / "folder.v2" / name
    for bad, message in [("x.jsonl", "exports are Parquet, not .jsonl"),
                         ("dir.parquet", "is a folder, not a Parquet"),
                         ("file", "is a file without the .parquet suffix"),
                         ("file/x.parquet", "file is a file, not a folder"),
                         ("file/new", "file is a file, not a folder")]:
        with pytest.raises(ValueError, match=message):
            export_path(tmp_path / "run", cfg, tmp_path / bad)


def test_the_card_lists_the_exports_among_other_files_of_the_folder(tmp_path):
    from datasets import load_dataset

    from curation.stages.export import run_with_card

    make_run(tmp_path / "run")
    folder = tmp_path / "shared"
    (folder / "spark.parquet").mkdir(parents=True)  # a folder of part files
    (folder / "notes.parquet").write_text("not Parquet")
    pq.write_table(pa.table({"x": [1]}), folder / "other.parquet")  # Parquet that groupforge did not write
    path, rows, card = run_with_card(tmp_path / "run", ExportConfig(format="sft"), folder)
    assert path == folder / "sft-standard.parquet" and rows == 2 and card == folder / "README.md"
    assert "config_name: sft-standard" in card.read_text() and "other" not in card.read_text()
    assert sorted(load_dataset(str(folder))["train"]["completion"]) == ["42", "42"]


def _with_round_1(store: RunStore, soft_label: float) -> None:
    pairs = {
        "run_id": ["r"], "round": pa.array([1], pa.int32()), "prompt_id": ["p1"],
        "chosen_idx": pa.array([0], pa.int32()), "rejected_idx": pa.array([1], pa.int32()),
        "chosen_reward": [1.0], "rejected_reward": [0.0], "margin": [1.0], "soft_label": [soft_label], "weight": [1.0],
    }
    with store.commit("pair", 1, inputs={}, config={"soft_label": soft_label}) as c:
        c.write("pairs", pairs)


def test_as_of_a_round_gives_the_bytes_of_an_export_taken_then(tmp_path):
    store = make_run(tmp_path / "run")
    cfg = ExportConfig(format="preference")
    then, _ = run(store.storage.url, cfg, tmp_path / "then.parquet")
    _with_round_1(store, 0.9)
    with store.commit("pair", 0, inputs={}, config={"again": True}) as c:  # round 0 redone, after round 1
        c.write("pairs", store.read("pairs", 0).slice(0, 1))
    _with_round_1(store, 0.7)
    later, _ = run(store.storage.url, cfg, tmp_path / "later.parquet", as_of=0)
    now, rows = run(store.storage.url, cfg, tmp_path / "now.parquet")
    assert later.read_bytes() == then.read_bytes()
    assert rows == 1 and now.read_bytes() != then.read_bytes()  # round 0 redone with one pair
    with pytest.raises(ValueError, match=r"no commit of round 5; rounds committed: \[0, 1\]"):
        run(store.storage.url, cfg, tmp_path / "x.parquet", as_of=5)
