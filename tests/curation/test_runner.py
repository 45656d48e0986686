"""curation/stages/runner.py: what every stage declares, and run_stage's steps (up-to-date
check, main input, column reads, hooks, declared outputs) on real run folders."""

from __future__ import annotations

import builtins
import json
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel

from curation.stages.common import rejects_table
from curation.stages.runner import CURATION_STAGES, StageOutput, run_stage, stage_module
from store.fingerprints import fingerprint_file
from store.layout import part_name
from store.run_store import RunStore
from store.schema import KEYS, SCHEMAS, TRAJECTORY_FIELDS
from tests.helpers import commit_inputs, group_rows, samples_and_scores


@pytest.mark.parametrize("name", CURATION_STAGES)
def test_every_stage_declares_its_tables_config_columns_and_transform(name):
    module = stage_module(name)
    assert module.STAGE == name and module.__name__ == f"curation.stages.{name}"
    assert isinstance(module.READS, tuple) and isinstance(module.WRITES, tuple)
    assert set(module.READS) <= set(SCHEMAS) and set(module.WRITES) <= set(SCHEMAS)
    assert issubclass(module.CONFIG, BaseModel) and callable(module.transform)
    columns = module.columns(module.CONFIG())
    assert list(columns) == list(module.READS)
    for table, names in columns.items():
        known = set(SCHEMAS[table].names) | ({f.name for f in TRAJECTORY_FIELDS} if table == "samples" else set())
        assert names is None or set(names) <= known, (table, names)


def test_filter_reads_only_the_columns_its_filters_use():
    from curation.stages.filter import FilterConfig, columns

    assert columns(FilterConfig(drop_duplicates=False))["samples"] == list(KEYS)
    every = FilterConfig(drop_truncated=True, min_response_tokens=1)
    assert columns(every)["samples"] == [*KEYS, "finish_reason", "response_token_ids", "response", "messages_out"]
    trajectories = FilterConfig(drop_duplicates=False, max_model_tokens=9, max_turns=2, drop_tool_errors=True)
    assert columns(trajectories)["samples"] == [*KEYS, "response_token_ids", "response_mask", "num_turns",
                                                "tool_errors"]


def test_unknown_stage_and_missing_main_input(tmp_path):
    with pytest.raises(ValueError, match="unknown curation stage 'filte'"):
        run_stage("filte", tmp_path, 0)
    with pytest.raises(FileNotFoundError, match="has no samples for round 0; run generate first"):
        run_stage("filter", tmp_path / "run", 0)
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0]})))
    with pytest.raises(FileNotFoundError, match="has no groups for round 0; run label first"):
        run_stage("pair", store.root, 0)


def fake_stage(**attributes) -> types.ModuleType:
    """A stage module that reads the keys of samples and rejects every sample (reason 'fake')."""
    module = types.ModuleType("fake_stage")
    module.STAGE, module.READS, module.WRITES = "fake", ("samples",), ("rejects",)
    module.CONFIG = dict
    module.columns = lambda cfg: {"samples": list(KEYS)}
    module.seen = []

    def transform(tables, cfg):
        module.seen.append(tables)
        keys = tables["samples"].to_pydict()
        rejects = rejects_table(keys["run_id"], keys["round"], keys["prompt_id"], keys["sample_idx"], "fake", "fake")
        return StageOutput({"rejects": rejects}, rows_in=len(keys["run_id"]), rows_out=0, extra={"note": cfg.get("a")})

    module.transform = transform
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_run_stage_reads_transforms_commits_and_then_skips(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0, 1], "b": [0, 0]})))
    stage = fake_stage()
    report = run_stage(stage, store.root, 0, {"a": 1})
    assert (report.stage, report.skipped, report.rows_in, report.rows_out, report.drops) == ("fake", False, 5, 0,
                                                                                           {"fake": 5})
    assert stage.seen[0]["samples"].column_names == list(KEYS)  # only the declared columns
    store.refresh()
    manifest = store.load_manifest("fake", 0)
    assert manifest["config"] == {"a": 1} and manifest["note"] == 1 and manifest["drops"] == {"fake": 5}
    assert list(manifest["inputs"]) == store.files("samples", 0) == store.load_manifest("generate", 0)["outputs"]
    assert [part_name(rel) for rel in manifest["outputs"]] == ["fake"]
    assert manifest["outputs"] == [rel for rel in store.files("rejects", 0) if part_name(rel) == "fake"]
    again = run_stage(stage, store.root, 0, {"a": 1})
    assert (again.skipped, again.rows_in, again.rows_out, again.drops) == (True, 5, 0, {"fake": 5})
    assert len(stage.seen) == 1
    assert not run_stage(stage, store.root, 0, {"a": 2}).skipped and len(stage.seen) == 2


def test_hooks_hashed_config_and_reused_tables(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0]})))
    earlier = pa.table({"x": [1]})
    calls = []

    def reused_tables(store_, round, inputs):
        calls.append((store_.location, round, sorted(inputs)))
        return {"earlier": earlier}

    stage = fake_stage(hashed_config=lambda cfg: {k: v for k, v in cfg.items() if k != "workers"},
                       reused_tables=reused_tables)
    run_stage(stage, store.root, 0, {"a": 1, "workers": 4})
    store.refresh()
    assert store.load_manifest("fake", 0)["config"] == {"a": 1}
    assert stage.seen[-1]["earlier"] is earlier
    assert calls == [(str(store.root), 0, store.files("samples", 0))]
    assert run_stage(stage, store.root, 0, {"a": 1, "workers": 2}).skipped  # workers are not hashed
    run_stage(stage, store.root, 0, {"a": 1}, force=True)
    assert "earlier" not in stage.seen[-1] and len(calls) == 1  # force: nothing reused


def test_a_transform_must_return_the_tables_it_declares(tmp_path):
    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0]})))
    stage = fake_stage(WRITES=("rejects", "pairs"))
    with pytest.raises(RuntimeError, match=r"returned tables \['rejects'\], declared \['rejects', 'pairs'\]"):
        run_stage(stage, store.root, 0, {})
    assert store.load_manifest("fake", 0) is None


def test_inputs_are_fingerprinted_from_the_log_without_reading_the_files(tmp_path, monkeypatch):
    """The runner takes the sha256 each commit recorded in the commit log for a part; runs
    of an older groupforge (no log, manifests without output_files) still work: their files
    are hashed once, when the run is read (and recorded when a writer takes them in)."""
    from curation.stages.runner import input_fingerprints

    store = RunStore(tmp_path / "run")
    commit_inputs(store, 0, *samples_and_scores(group_rows({"a": [1, 0, 1], "b": [0, 0]})))
    rels = store.files("samples", 0) + store.files("scores", 0)
    expected = {rel: fingerprint_file(store.root / rel) for rel in rels}
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or real_open(file, *a, **k))
    monkeypatch.setattr(pq, "ParquetFile", lambda *a, **k: pytest.fail("read a part file"))
    reader = RunStore(store.root)
    assert input_fingerprints(reader, ("samples", "scores"), 0) == expected and len(expected) == 2
    assert not [path for path in opened if path.endswith(".parquet")]
    monkeypatch.undo()

    old = tmp_path / "old"  # as an older groupforge wrote the run
    for rel in rels:
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_bytes((store.root / rel).read_bytes())
    (old / "_manifests").mkdir()
    for stage in ("generate", "score"):
        manifest = {k: v for k, v in store.load_manifest(stage, 0).items() if k not in ("output_files", "seal")}
        manifest["outputs"] = [rel for rel in manifest["outputs"] if rel in rels]
        (old / "_manifests" / f"{stage}-round=0.json").write_text(json.dumps(manifest))
    assert input_fingerprints(RunStore(old), ("samples", "scores"), 0) == expected


def test_a_store_that_holds_its_commits_feeds_the_next_stage_from_memory(tmp_path, monkeypatch):
    """The round loop's store (hold=True) keeps what each stage committed; the next stage reads
    it from memory, its fingerprints from the held sha256, and its output is the files' output."""
    from curation.stages import filter as filter_stage
    from store import fingerprints

    store = RunStore(tmp_path / "run", hold=True)
    samples, scores = samples_and_scores(group_rows({"a": [1, 0, 1], "b": [0, 0], "c": [1, 1]}))
    for stage, tables in (("generate", {"samples": samples, "rejects": SCHEMAS["rejects"].empty_table()}),
                          ("score", {"scores": scores, "rejects": SCHEMAS["rejects"].empty_table()})):
        with store.commit(stage, 0, inputs={}, config={}) as commit:
            for table, data in tables.items():
                commit.write(table, data, part=stage)
    # no rows dropped: no rejects part (filter reads the empty rejects table without a file)
    assert sorted(store.held) == store.files("samples", 0) + store.files("scores", 0)
    run_stage(filter_stage, store.root, 0, force=True)  # through a plain store: from the files
    plain = RunStore(store.root)
    [part] = [rel for rel in plain.files("rejects", 0) if part_name(rel) == "filter"]
    from_files = pq.read_table(store.root / part)
    expected_sha = plain.part_fingerprints([part])[part]
    assert expected_sha == fingerprint_file(store.root / part)
    store.refresh()
    for reader in ("read_table", "read_schema", "read_metadata", "ParquetFile"):
        monkeypatch.setattr(pq, reader, lambda *a, **k: pytest.fail("read a file it holds"))
    monkeypatch.setattr(fingerprints, "fingerprint_file", lambda *a: pytest.fail("hashed a file it holds"))
    report = run_stage(filter_stage, store, 0, force=True)
    assert not report.skipped and store.held[part].table.num_rows > 0
    assert store.held[part].table.equals(from_files) and store.held[part].sha256 == expected_sha
    store.release()
    assert store.held == {}
