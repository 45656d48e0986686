"""Dataset cards (curation/card.py): `groupforge export` writes a Hugging Face card next to the
Parquet that `datasets` reads with the data, with provenance taken from the run's manifests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import yaml

from curation.card import CARD_MARKER, METADATA_KEY
from curation.stages.runner import CURATION_STAGES, run_stage
from store.run_store import RunStore
from tests.helpers import groupforge_in_process, make_toy_run


def groupforge(*args) -> subprocess.CompletedProcess:
    return groupforge_in_process(*args)


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_dir) -> Path:
    """Two sampled rounds of 8 toy prompts x 4, curated with the stages' defaults."""
    run = make_toy_run(toy_dir, tmp_path_factory.mktemp("card"), "train", 8, 4, 4, rounds=(0, 1), temperature=1.5)
    with RunStore(run).lock():
        for round in (0, 1):
            for stage in CURATION_STAGES:
                run_stage(stage, run, round)
    return run


def front_matter(card: Path) -> dict:
    text = card.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_export_writes_a_card_that_datasets_reads_with_the_data(run):
    first = groupforge("export", run, "--format", "sft")
    assert first.returncode == 0, first.stderr
    second = groupforge("export", run, "--format", "unpaired", "--style", "conversational", "--round", "1")
    assert second.returncode == 0, second.stderr
    folder = run / "exports"
    card = folder / "README.md"
    assert f"dataset card: {card}" in second.stdout
    meta = front_matter(card)
    assert [c["config_name"] for c in meta["configs"]] == ["sft-standard", "unpaired-conversational"]
    assert [c.get("default", False) for c in meta["configs"]] == [False, True]  # the newest export
    for info in meta["dataset_info"]:
        rows = pq.read_metadata(folder / f"{info['config_name']}.parquet").num_rows
        assert info["splits"][0]["num_examples"] == rows > 0
    assert "license" in meta and meta["license"] is None  # left for the user

    default = datasets.load_dataset(str(folder))["train"]
    unpaired = pq.read_table(folder / "unpaired-conversational.parquet")
    assert default.num_rows == unpaired.num_rows and set(default.column_names) == set(unpaired.column_names)
    assert set(default["round"]) == {1}
    sft = datasets.load_dataset(str(folder), "sft-standard")["train"]
    assert sft.num_rows == pq.read_metadata(folder / "sft-standard.parquet").num_rows
    builder = datasets.load_dataset_builder(str(folder), "sft-standard")
    assert builder.info.splits["train"].num_examples == sft.num_rows  # the card's dataset_info was read


def test_the_provenance_comes_from_the_manifests(run):
    assert groupforge("export", run, "--format", "unpaired", "--round", "1").returncode == 0
    store = RunStore(run)
    record = json.loads(pq.read_schema(run / "exports" / "unpaired-standard.parquet").metadata[METADATA_KEY])
    generate, score = store.load_manifest("generate", 1), store.load_manifest("score", 1)
    assert record["rounds"] == [1]
    assert record["generators"] == [generate["generator"]]
    assert record["weights_sha256"] == [generate["inputs"]["weights"]]
    assert record["sampling"] == [generate["config"]["sampling"]]
    assert record["sampling"][0]["group_size"] == 4
    assert record["rewards"] == [score["scorer"]]
    drops = {}
    for stage in ("generate", *CURATION_STAGES):
        for reason, n in (store.load_manifest(stage, 1) or {}).get("drops", {}).items():
            drops[reason] = drops.get(reason, 0) + n
    assert record["drops"] == drops
    assert "command" not in record  # an export of the same data gives the same bytes
    text = (run / "exports" / "README.md").read_text()
    section = text.split("## Provenance: unpaired-standard")[1]
    assert generate["generator"] in section and score["scorer"]["exact_match"] in section
    assert "| rounds | 1 (1 round) |" in section


def test_a_readme_that_groupforge_did_not_write_is_left_alone(run, tmp_path):
    mine = tmp_path / "README.md"
    mine.write_text("# my notes\n")
    out = tmp_path / "pairs.parquet"
    proc = groupforge("export", run, "--format", "sft", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert mine.read_text() == "# my notes\n" and out.is_file()
    assert f"warning: {mine} was not written by groupforge" in proc.stderr
    mine.unlink()  # without it, the card is written, and a later export rewrites it
    assert groupforge("export", run, "--format", "sft", "--out", out).returncode == 0
    assert CARD_MARKER in mine.read_text()


def test_push_to_hub_offline_is_one_error_line_after_the_local_export(run, tmp_path):
    out = tmp_path / "sft.parquet"
    proc = groupforge("export", run, "--format", "sft", "--out", out, "--push-to-hub", "someone/toy-sft")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: --push-to-hub someone/toy-sft: the Hugging Face Hub is in offline mode "
                     "(HF_HUB_OFFLINE=1); unset it, log in (hf auth login or HF_TOKEN) and rerun"]
    assert out.is_file() and (tmp_path / "README.md").is_file()  # the local export and card are kept
