"""curation/stages/dataset.py: a pair dataset that grows by one Delta version per append, with
each append's provenance, read back by Polars and delta-rs (time travel included), locally
and on moto's S3 server over HTTP; no round twice, also when two appenders race; the CLI's
`export --append-to` and its one-line errors."""

from __future__ import annotations

import subprocess
import sys
import time

import polars as pl
import pytest
from deltalake import DeltaTable

from curation.stages.dataset import append_export, read_dataset_log
from curation.stages.export import ExportConfig
from pipelines.loop.curate import curate
from store.faults import PAUSE_ENV
from store.location import RunLocation
from tests.helpers import ENV, REPO, error_line, groupforge_in_process, hand_made_run


def _curated(run, rounds):
    hand_made_run(run, rounds=rounds)
    curate(run, rounds=list(rounds))
    return run


@pytest.fixture(params=["local", "s3"])
def dataset(request, tmp_path):
    """(the dataset's location, the storage options its readers get)."""
    if request.param == "local":
        return str(tmp_path / "datasets" / "pairs"), None
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket()}/datasets/pairs", server.env()


def test_each_append_is_one_version_with_its_provenance_and_no_round_twice(dataset, tmp_path):
    target, options = dataset
    run = _curated(tmp_path / "run", (0,))
    cfg = ExportConfig(append_to=target)
    first = append_export(run, cfg)
    assert (first.version, first.rounds) == (0, [0]) and first.rows == 2  # p1 and p2 pair (max_min); p0 is flat

    _curated(run, (1,))  # the next refresh made round 1
    second = append_export(run, cfg)
    assert (second.version, second.rounds, second.rows) == (1, [1], 2)
    again = append_export(run, cfg)  # a rerun after a kill, or a refresh with nothing new
    assert again.version is None and read_dataset_log(target).next_version == 2

    table = DeltaTable(target, storage_options=options)
    assert table.version() == 1
    history = {h["version"]: h for h in table.history()}
    info = history[1]["groupforge"]
    assert info["run"] == RunLocation.of(run).key and info["rounds"] == [1] and info["rows"] == 2
    assert info["format"] == "preference" and info["groupforge"].startswith("groupforge ")
    assert info["spec_sha256"] is None and info["prompt_files"] == []  # a run made by the stage commands
    assert info["export"]["rounds"] == [1] and info["export"]["pair"]  # the export's own provenance

    # time travel: version 0 holds round 0, version 1 both rounds
    rounds_at = {v: sorted(pl.read_delta(target, version=v, storage_options=options)["round"].to_list())
                 for v in (0, 1)}
    assert rounds_at == {0: [0, 0], 1: [0, 0, 1, 1]}
    table.load_as_version(0)
    assert table.to_pyarrow_table().column("round").to_pylist() == [0, 0]
    latest = pl.scan_delta(target, storage_options=options).collect()
    assert latest.columns[:5] == ["prompt_id", "prompt", "round", "chosen", "rejected"]
    assert (latest["chosen"] == "4").all() and (latest["rejected"] != "4").all()  # the right answer is chosen


def test_two_appenders_racing_append_each_round_once(tmp_path):
    """The first appender pauses with its rows built; a second appends the same rounds
    meanwhile and wins version 0; the first's write of version 0 fails (the table is there), it
    reads the table again and finds nothing left to append."""
    run = _curated(tmp_path / "run", (0, 1))
    target = tmp_path / "pairs"
    pause = tmp_path / "pause"
    pause.mkdir()
    env = {**ENV, PAUSE_ENV: f"dataset.rows_built:1:{pause}"}
    first = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "export", str(run), "--append-to", str(target)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (pause / "paused").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
        time.sleep(0.05)
    won = append_export(run, ExportConfig(append_to=str(target)))
    assert (won.version, won.rounds) == (0, [0, 1])
    (pause / "resume").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert "nothing to append" in out
    assert DeltaTable(str(target)).version() == 0
    assert sorted(pl.read_delta(str(target))["round"].to_list()) == [0, 0, 1, 1]
    assert len(list(target.glob("*.parquet"))) == 1  # the loser wrote no file


def test_the_cli_appends_and_says_what(tmp_path):
    run = _curated(tmp_path / "run", (0,))
    target = tmp_path / "pairs"
    done = groupforge_in_process("export", run, "--append-to", target)
    assert done.returncode == 0, done.stderr
    assert f"appended rounds [0] (2 rows, preference) to {target} as version 0" in done.stdout
    again = groupforge_in_process("export", run, "--append-to", target)
    assert again.returncode == 0 and "nothing to append" in again.stdout


@pytest.mark.parametrize("args,message", [
    (["--append-to", "ftp://host/pairs"], "--append_to: Value error, 'ftp://host/pairs' is not a folder or an "
                                          "object-store URL"),
    (["--append-to", "{tmp}/pairs", "--out", "{tmp}/x.parquet"], "--out cannot go with it"),
    (["--append-to", "{tmp}/pairs", "--format", "prompt_only"], "format prompt_only has no rounds to append"),
])
def test_bad_append_arguments_are_one_line(args, message, tmp_path):
    run = _curated(tmp_path / "run", (0,))
    done = groupforge_in_process("export", run, *[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 2 and message in error_line(done), done.stderr


def test_another_formats_columns_are_refused(tmp_path):
    run = _curated(tmp_path / "run", (0, 1))
    target = str(tmp_path / "pairs")
    append_export(run, ExportConfig(append_to=target, rounds=[0]))
    with pytest.raises(ValueError, match="the table's columns differ from this preference \\(conversational\\)"):
        append_export(run, ExportConfig(append_to=target, style="conversational"))
    assert [h["groupforge"]["rounds"] for h in DeltaTable(target).history()] == [[0]]
