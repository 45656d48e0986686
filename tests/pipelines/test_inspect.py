"""pipelines/reports/inspect_run.py: the stage graph (stage, reads, writes, last run, rows in/out) of a run."""

from __future__ import annotations

import io

from rich.console import Console

from curation.generate import stage as generate_stage
from curation.stages import filter as filter_stage
from curation.stages import label as label_stage
from curation.stages import pair as pair_stage
from curation.stages import score as score_stage
from pipelines.loop.curate import curate
from pipelines.reports.inspect_run import number_ranges, print_stage_graph, stage_graph
from store.run_store import RunStore
from tests.helpers import hand_made_run


def test_stage_graph_declares_each_stage_and_sums_its_manifests(tmp_path):
    run = hand_made_run(tmp_path / "run", rounds=(0, 1))
    before = {row.stage: row for row in stage_graph(run)}
    assert list(before) == ["generate", "score", "filter", "label", "pair"]
    assert before["generate"].rounds == [0, 1] and before["generate"].last_run is not None
    assert before["score"].rounds == [] and before["score"].last_run is None and before["score"].rows_in == 0

    curate(run)
    store = RunStore(run)
    rows = stage_graph(run)
    for row, module in zip(rows, (generate_stage, score_stage, filter_stage, label_stage, pair_stage)):
        assert (row.stage, row.reads, row.writes) == (module.STAGE, module.READS, module.WRITES)
        manifests = [store.load_manifest(row.stage, round) for round in (0, 1)]
        assert row.rounds == [0, 1]
        assert row.rows_in == sum(m["rows_in"] for m in manifests)
        assert row.rows_out == sum(m["rows_out"] for m in manifests)
        assert row.last_run == max(m["created_at"] for m in manifests)
    by_stage = {row.stage: row for row in rows}
    assert generate_stage.READS == ("prompts file", "model weights")
    assert by_stage["filter"].reads == ("samples", "scores", "rejects") and by_stage["filter"].writes == ("rejects",)
    assert by_stage["score"].rows_in == 2 * 12 and by_stage["filter"].rows_out == by_stage["label"].rows_in


def test_print_stage_graph_shows_every_stage_and_its_tables(tmp_path):
    run = hand_made_run(tmp_path / "run", rounds=(0, 2, 3))
    curate(run, rounds=[2, 3])
    out = io.StringIO()
    print_stage_graph(run, Console(file=out, width=200))
    lines = {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.count("│") > 6}
    assert list(lines) == ["generate", "score", "filter", "label", "pair"]
    assert "prompts file, model weights" in lines["generate"] and "samples, rejects, prompts" in lines["generate"]
    assert "0, 2-3" in lines["generate"] and "2-3" in lines["pair"] and "groups" in lines["pair"]
    assert "scores, rejects" in lines["score"]


def test_ranges():
    assert number_ranges([]) == "" and number_ranges([4]) == "4" and number_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
