"""store/run_files.py: the atomic write, JSON files, the metrics log and the round record, on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from store.run_files import (
    METRICS_FILE,
    PHASES,
    TRAJECTORY_KEYS,
    MetricsLog,
    RoundRecord,
    load_pipeline_state,
    read_json,
    round_prompts_rel,
    save_pipeline_state,
    to_json,
    write_json_atomic,
)
from store.storage import write_atomic

# ---- write_atomic --------------------------------------------------------------------------


def test_write_atomic_text_bytes_and_a_writer_function(tmp_path):
    assert write_atomic(tmp_path / "deep" / "a.txt", "héllo\n") == tmp_path / "deep" / "a.txt"  # parent created
    assert (tmp_path / "deep" / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    write_atomic(tmp_path / "c.bin", lambda f: (f.write(b"ab"), f.write(b"cd")))
    assert (tmp_path / "c.bin").read_bytes() == b"abcd"
    write_atomic(tmp_path / "a.txt", "old")
    write_atomic(tmp_path / "a.txt", "new")  # replaces
    assert (tmp_path / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.bin", "deep"]


def test_write_atomic_mode(tmp_path):
    old_umask = os.umask(0o077)  # a private umask must not make run files private
    try:
        write_atomic(tmp_path / "shared.txt", "x")
        write_atomic(tmp_path / "private.txt", "x", mode=0o600)
        write_atomic(tmp_path / "umask.txt", "x", mode=None)
    finally:
        os.umask(old_umask)
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "private.txt").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "umask.txt").stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = write_atomic(tmp_path / "state.json", "old")

    def fails(f):
        f.write(b"half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomic(path, fails)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


# ---- JSON files ----------------------------------------------------------------------------


def test_json_is_indented_sorted_and_writes_paths(tmp_path):
    assert to_json({"b": 1, "a": tmp_path}) == json.dumps({"a": str(tmp_path), "b": 1}, indent=2) + "\n"
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        to_json({"a": object()})
    write_json_atomic(tmp_path / "x.json", {"k": [1, 2]})
    assert read_json(tmp_path / "x.json") == {"k": [1, 2]}


def test_read_json_errors_name_the_file(tmp_path):
    assert read_json(tmp_path / "missing.json") is None
    (tmp_path / "cut.json").write_text('{"target_rounds": ')
    with pytest.raises(ValueError, match=f"{tmp_path / 'cut.json'}: not valid JSON"):
        read_json(tmp_path / "cut.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{tmp_path / 'list.json'}: expected a JSON object, found list"):
        read_json(tmp_path / "list.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="binary.json: not valid JSON"):
        read_json(tmp_path / "binary.json")


def test_pipeline_state_and_round_prompts_rel(tmp_path):
    assert load_pipeline_state(tmp_path) == {}
    save_pipeline_state(tmp_path, {"target_rounds": 3, "prompt_files": ["a.parquet"]})
    assert load_pipeline_state(tmp_path) == {"target_rounds": 3, "prompt_files": ["a.parquet"]}
    assert json.loads((tmp_path / "pipeline.json").read_text())["target_rounds"] == 3
    assert round_prompts_rel(4) == "_rounds/round=4/prompts.parquet"


# ---- the metrics log -----------------------------------------------------------------------


def step(n: int, **extra) -> dict:
    return {"event": "step", "step": n, "loss": 1.0 / n, **extra}


def test_metrics_log_skips_and_counts_cut_lines_and_the_last_record_wins(tmp_path):
    log = MetricsLog(tmp_path)
    assert log.path == tmp_path / METRICS_FILE and not log.exists()
    assert log.rounds() == [] and log.steps() == [] and log.round_record(0) is None
    with pytest.raises(ValueError, match=f"{tmp_path / METRICS_FILE}: no metrics file"):
        log.read()

    log.append(RoundRecord(round=0, eval_accuracy=0.25))
    for record in (step(2), step(1, loss=9.0), step(1), {"event": "generate", "round": 1},
                   RoundRecord(round=1, eval_accuracy=0.5, steps=2), RoundRecord(round=1, eval_accuracy=0.75)):
        log.append(record)
    with open(log.path, "a") as f:  # a kill mid-write, a stray value, a record without a number
        f.write('[1, 2]\n{"event": "step", "step": "3"}\n\n{"event": "round", "round": 2, "eval_acc')
    rounds, steps, skipped = log.read()
    assert [r["round"] for r in rounds] == [0, 1] and rounds[1]["eval_accuracy"] == 0.75 and rounds[1]["steps"] == 0
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["loss"] == 1.0  # the rewritten step 1
    assert skipped == 3
    assert log.round_record(1)["eval_accuracy"] == 0.75 and log.round_record(2) is None


def test_drop_steps_after_keeps_other_records_in_order(tmp_path):
    log = MetricsLog(tmp_path)
    log.drop_steps_after(0)  # no file: nothing to do
    assert not log.exists()
    for record in (step(1), RoundRecord(round=1, eval_accuracy=0.5), step(2), step(3), {"event": "note"}, step(4)):
        log.append(record)
    with open(log.path, "a") as f:
        f.write('{"event": "step", "st')
    log.drop_steps_after(2)
    events = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(e["event"], e.get("step", e.get("round"))) for e in events] == [
        ("step", 1), ("round", 1), ("step", 2), ("note", None)]
    before = log.path.read_text()
    log.drop_steps_after(2)  # nothing left to drop: the file is not rewritten
    assert log.path.read_text() == before


# ---- the round record ----------------------------------------------------------------------


def test_round_record_round_trip_and_line_format(tmp_path):
    record = RoundRecord(round=3, eval_accuracy=0.5, reward_mean=0.25, samples=96, groups=24, kept_groups=20,
                         pairs=40, samples_total=288, policy_version=6, steps=2, objective="grpo",
                         wall_seconds=12.5, elapsed_seconds=40.25, gen_tokens_per_s=900.5, train_tokens_per_s=400.1)
    as_dict = record.to_dict()
    assert as_dict["event"] == "round" and RoundRecord.from_dict(as_dict) == record
    assert RoundRecord.from_dict({**as_dict, "added_later": 1}) == record  # unknown keys ignored
    MetricsLog(tmp_path).append(record)
    line = (tmp_path / METRICS_FILE).read_text()
    assert line == json.dumps(as_dict, sort_keys=True) + "\n"
    assert list(json.loads(line)) == sorted(as_dict)
    assert set(as_dict) == {"event", "round", "eval_accuracy", "reward_mean", "samples", "groups", "kept_groups",
                            "pairs", "samples_total", "policy_version", "steps", "objective", "wall_seconds",
                            "elapsed_seconds", "gen_tokens_per_s", "train_tokens_per_s", "phase_seconds",
                            "model_seconds", "refill_prompts", "decay_steps", "peak_rss_mib"}


def test_a_multi_turn_record_has_its_keys_and_round_trips(tmp_path):
    """A multi-turn round's record adds tool use, tool calls and errors, turns and stop reasons;
    they are left out of a single-turn round's line (test_round_record_round_trip_and_line_format)."""
    record = RoundRecord(round=1, eval_accuracy=0.5, samples=4, tool_use_rate=0.75, tool_calls=5, tool_errors=1,
                         mean_turns=2.25, stop_reasons={"done": 3, "max_turns": 1})
    MetricsLog(tmp_path).append(record)
    back = MetricsLog(tmp_path).round_record(1)
    assert {key: back[key] for key in TRAJECTORY_KEYS} == {
        "tool_use_rate": 0.75, "tool_calls": 5, "tool_errors": 1, "mean_turns": 2.25,
        "stop_reasons": {"done": 3, "max_turns": 1}}
    assert RoundRecord.from_dict(back) == record
    assert not set(TRAJECTORY_KEYS) & set(RoundRecord(round=1, eval_accuracy=0.5).to_dict())


def test_round_zero_record_defaults():
    """Round 0 evaluates the starting model: nothing sampled, nothing trained."""
    assert RoundRecord(round=0, eval_accuracy=0.1).to_dict() == {
        "event": "round", "round": 0, "eval_accuracy": 0.1, "reward_mean": None, "samples": 0, "groups": 0,
        "kept_groups": 0, "pairs": 0, "samples_total": 0, "policy_version": 0, "steps": 0, "objective": None,
        "wall_seconds": 0.0, "elapsed_seconds": 0.0, "gen_tokens_per_s": 0.0, "train_tokens_per_s": 0.0,
        "phase_seconds": {}, "model_seconds": 0.0, "refill_prompts": 0, "decay_steps": None, "peak_rss_mib": None}


def test_a_round_without_eval_and_its_phases_round_trip(tmp_path):
    phases = {name: 0.1 for name in PHASES}
    record = RoundRecord(round=2, eval_accuracy=None, phase_seconds=phases, wall_seconds=1.1, model_seconds=0.5,
                         refill_prompts=16, decay_steps=40)
    MetricsLog(tmp_path).append(record)
    back = MetricsLog(tmp_path).round_record(2)
    assert back["eval_accuracy"] is None and back["phase_seconds"] == phases
    assert RoundRecord.from_dict(back) == record
    assert PHASES[0] == "startup" and PHASES[-1] == "other"
    assert {"generate", "train", "checkpoint", "reload", "eval", "score", "filter", "label", "pair"} < set(PHASES)


def test_records_since_reads_only_what_was_appended_and_a_rewritten_file_whole(tmp_path):
    log = MetricsLog(tmp_path)
    assert log.position() == (0, 0) and log.records_since((0, 0)) == []
    log.append(step(1))
    here = log.position()
    log.append(step(2))
    with open(log.path, "a") as f:
        f.write('{"event": "step", "st')  # a cut line is skipped
    assert [r["step"] for r in log.records_since(here)] == [2]
    log.drop_steps_after(1)  # replaces the file (a new inode): read whole
    log.append(step(3))
    assert [r["step"] for r in log.records_since(here)] == [1, 3]


def test_unsynced_step_lines_are_there_at_once_and_sync_makes_them_durable(tmp_path):
    log = MetricsLog(tmp_path)
    log.sync()  # no file yet: nothing to do
    log.append(step(1), sync=False)
    log.append(step(2), sync=False)
    reader = subprocess.run([sys.executable, "-c", f"print(open({str(log.path)!r}).read().count(chr(10)))"],
                            capture_output=True, text=True, check=True)
    assert reader.stdout.strip() == "2"  # another process sees both lines before any fsync
    log.sync()
    assert [r["step"] for r in log.steps()] == [1, 2]


def test_the_metrics_log_on_an_object_store_reads_as_a_local_one(tmp_path, s3_server):
    """The same records, cut-line handling, `records_since` and `drop_steps_after` over S3."""
    from store.storage import open_storage

    local = MetricsLog(tmp_path)
    remote = MetricsLog(open_storage(f"s3://{s3_server.bucket()}/run"))
    for log in (local, remote):
        log.append({"event": "round", "round": 0})
        mark = log.position()
        log.append({"event": "step", "step": 1})
        log.storage.append("metrics.jsonl", b'{"event": "step", "st')  # a line cut by a kill
        log.append({"event": "step", "step": 2})
        assert [r.get("step") for r in log.records_since(mark)] == [1, 2]
        log.drop_steps_after(1)
    assert remote.read() == local.read() == ([{"event": "round", "round": 0}], [{"event": "step", "step": 1}], 0)
    assert remote.storage.read("metrics.jsonl") == local.storage.read("metrics.jsonl")
