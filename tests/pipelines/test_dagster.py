"""pipelines/orchestrate/dagster.py: the round loop's steps as Dagster assets, materialized with
`dagster.materialize` for rounds 0 and 1 of a small toy run on moto's S3 server over HTTP, its
prompts a partition glob on the same bucket and its pairs appended to a Delta dataset there;
one step fails once (GROUPFORGE_FAULT ...:raise) and its RetryPolicy reruns it; the bucket
then holds a whole run (the fault tests' invariants), a rerun changes nothing, the refresh
sensor asks for round 2, and a round whose previous round is not done is refused."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

dg = pytest.importorskip("dagster", reason="the dagster extra is not installed: pip install 'groupforge[dagster]'")

import polars as pl  # noqa: E402
from deltalake import DeltaTable  # noqa: E402

from pipelines.orchestrate.dagster import groupforge_definitions  # noqa: E402
from store import faults  # noqa: E402
from tests.faults.test_faults import check_invariants  # noqa: E402
from tests.helpers import OPTIONS_SPEC, commit_rows  # noqa: E402

STEPS = ["prompts", "generate", "score", "filter", "label", "pair", "train", "export"]


@pytest.fixture
def bucket_run(s3_server, toy_dir, tmp_path):
    """(spec file, run URL, dataset URL, bucket): a 1-round toy spec whose train prompts are two
    date partitions on the bucket and whose pairs go to a Delta table there."""
    bucket = s3_server.bucket()
    client = s3_server.client()
    train = pq.read_table(toy_dir / "train.parquet")
    for day, rows in (("2031-01-05", train.slice(0, 40)), ("2031-01-06", train.slice(40, 40))):
        pq.write_table(rows, tmp_path / f"{day}.parquet")
        client.upload_file(str(tmp_path / f"{day}.parquet"), bucket, f"prompts/date={day}/part-0.parquet")
    run, dataset = f"s3://{bucket}/runs/dagster", f"s3://{bucket}/datasets/pairs"
    text = OPTIONS_SPEC.format(toy=toy_dir, rounds=1, checkpoint_every=1, eval_every=1, refill="")
    text = text.replace(f'train = ["{toy_dir}/train.parquet"]', f'train = ["s3://{bucket}/prompts/date=*/"]')
    spec = tmp_path / "spec.toml"
    spec.write_text(text.replace('name = "options"', 'name = "dagster"')
                    + f'\n[export]\nappend_to = "{dataset}"\n')
    return spec, run, dataset, bucket


def _materialize(defs, round: int, instance):
    return dg.materialize(list(defs.assets), resources=defs.resources, partition_key=str(round),
                          instance=instance, raise_on_error=False)


def _events(result, kind: str) -> list[str]:
    return [e.step_key for e in result.all_events if e.event_type_value == kind]


def test_rounds_as_partitions_with_a_retry_on_s3(bucket_run, s3_server, tmp_path, monkeypatch):
    spec, run, dataset, bucket = bucket_run
    defs = groupforge_definitions(spec, run_dir=run, retry_policy=dg.RetryPolicy(max_retries=1))
    assets = {a.key.path[-1]: a for a in defs.assets}
    assert list(assets) == STEPS
    assert assets["score"].metadata_by_key[assets["score"].key]["reads"] == ["samples", "prompts"]
    assert assets["pair"].metadata_by_key[assets["pair"].key]["writes"] == ["pairs"]
    upstream = {name: {k.path[-1] for k in a.asset_deps[a.key]} for name, a in assets.items()}
    assert upstream["filter"] == {"score", "generate"} and upstream["train"] == {"pair", "generate", "label"}
    assert upstream["prompts"] == set() and upstream["export"] == {"train", "pair", "generate"}
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("dagster_rounds", ["0", "1", "2", "3"])

    zero = _materialize(defs, 0, instance)
    assert zero.success

    # round 1: its score step fails once before committing; the RetryPolicy reruns it
    monkeypatch.setenv(faults.FAULT_ENV, "stage.before_commit:1:raise")
    monkeypatch.setattr(faults, "_passed", {})
    one = _materialize(defs, 1, instance)
    monkeypatch.delenv(faults.FAULT_ENV)
    assert one.success
    assert _events(one, "STEP_UP_FOR_RETRY") == ["dagster__score"]
    assert _events(one, "STEP_SUCCESS") == [f"dagster__{step}" for step in STEPS]

    mirror = tmp_path / "mirror"
    keys = s3_server.download(bucket, "runs/dagster", mirror)
    assert "checkpoints/step-2/trainer_state.json" in keys
    check_invariants(mirror)  # every sample once, groups + rejects cover them, logs and files agree
    records = [line for line in (mirror / "metrics.jsonl").read_text().splitlines() if '"event": "round"' in line]
    assert len(records) == 2
    state = (mirror / "pipeline.json").read_text()
    assert f"s3://{bucket}/prompts/date=2031-01-06/part-0.parquet" in state  # the glob, expanded

    # the pairs of round 1, appended as version 0 with the run's provenance
    options = s3_server.env()
    pairs = pl.read_delta(dataset, storage_options=options)
    assert pairs.height > 0 and set(pairs["round"].to_list()) == {1}
    info = DeltaTable(dataset, storage_options=options).history()[0]["groupforge"]
    assert info["run"] == run and info["rounds"] == [1] and len(info["prompt_files"]) == 2

    # a rerun of a done round changes nothing; the sensor asks for round 2; round 3 must wait for it
    again = _materialize(defs, 1, instance)
    assert again.success and DeltaTable(dataset, storage_options=options).version() == 0
    added = set(s3_server.download(bucket, "runs/dagster", tmp_path / "again")) - set(keys)
    assert all(key.startswith("_commits/") for key in added), added  # the job's "open" row only
    before = {row["seq"] for row in commit_rows(mirror)}
    assert [row["kind"] for row in commit_rows(tmp_path / "again") if row["seq"] not in before] == ["open"]
    assert (tmp_path / "again" / "metrics.jsonl").read_bytes() == (mirror / "metrics.jsonl").read_bytes()
    sensor = defs.resolve_sensor_def("dagster_refresh")
    result = sensor(dg.build_sensor_context(instance=instance, definitions=defs))
    assert [r.partition_key for r in result.run_requests] == ["2"]
    assert [list(r.partition_keys) for r in result.dynamic_partitions_requests] == [["2"]]
    early = _materialize(defs, 3, instance)
    assert not early.success and not _events(early, "STEP_UP_FOR_RETRY")
    failure = next(e for e in early.all_events if e.event_type_value == "STEP_FAILURE")
    assert "round 2 of" in failure.event_specific_data.error.message and "is not done" in \
        failure.event_specific_data.error.message
