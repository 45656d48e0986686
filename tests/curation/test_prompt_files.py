"""curation/generate/prompt_files.py: `[prompts] train` entries as files, folders, globs and
object URLs, on local disk and on moto's S3 server over HTTP; the errors that name the entry;
a run's prompt choice picking up a partition added after its first round."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from curation.generate.base import load_prompts
from curation.generate.prompt_files import expand_prompt_files
from pipelines.loop.prompts import choose_prompts
from pipelines.spec import load_spec
from store.run_files import load_pipeline_state
from store.storage import open_storage
from tests.helpers import PROMPTS, chosen, context, prompt_file, sampled


def _partitions(storage, layout: dict[str, list[str]]) -> None:
    """Prompt files (and the clutter a Spark job leaves) under `storage`: rel path -> prompt texts."""
    for rel, texts in layout.items():
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"prompt": texts, "reference": ["x"] * len(texts)}), sink)
        storage.write(rel, sink.getvalue())
    storage.write("date=2/_SUCCESS", b"")
    storage.write("date=2/_delta_log/00000000000000000000.checkpoint.parquet", b"not a prompt file")
    storage.write("notes.txt", b"not a prompt file")


LAYOUT = {"date=1/a.parquet": PROMPTS[:3], "date=1/b.parquet": PROMPTS[3:5], "date=2/c.parquet": PROMPTS[5:8]}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_globs_folders_and_files_expand_to_the_prompt_files_sorted(where, tmp_path, request):
    if where == "local":
        root = str(tmp_path / "prompts")
    else:
        root = f"s3://{request.getfixturevalue('s3_server').bucket()}/prompts"
    _partitions(open_storage(root), LAYOUT)
    files = [f"{root}/{rel}" for rel in LAYOUT]
    assert expand_prompt_files([f"{root}/date=*/"]) == files
    assert expand_prompt_files([f"{root}/date=*/*.parquet"]) == files
    assert expand_prompt_files([f"{root}/**/c.parquet"]) == files[2:]
    assert expand_prompt_files([root]) == files  # a folder: every prompt file under it
    assert expand_prompt_files([f"{root}/date=2/c.parquet", f"{root}/date=*"]) == [files[2], *files[:2]]  # once
    assert expand_prompt_files([f"{root}/date=1/b.parquet"]) == files[1:2]
    # the files read through the storage (an object whole), as the loop reads them
    assert load_prompts(files[2]).column("prompt").to_pylist() == PROMPTS[5:8]


@pytest.mark.parametrize("entry,message", [
    ("{root}/date=9*/", "matches no prompt file"),
    ("{root}/absent.parquet", "file not found"),
    ("ftp://host/prompts/", "unknown scheme 'ftp'"),
    ("s3:///prompts/date=*/", "not an object-store URL with a bucket"),
    ("s3://bucket*/prompts/", "not an object-store URL with a bucket"),
])
def test_a_bad_entry_is_one_line_naming_it_in_the_spec(entry, message, tmp_path, toy_dir):
    root = tmp_path / "prompts"
    _partitions(open_storage(root), LAYOUT)
    entry = entry.format(root=root)
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[run]\nname = "x"\n[model]\npath = "{toy_dir}/model"\n'
                    f'[prompts]\ntrain = ["{toy_dir}/train.parquet", "{entry}"]\neval = "{toy_dir}/eval.parquet"\n')
    with pytest.raises(ValueError) as err:
        load_spec(spec)
    text = str(err.value)
    assert "\n" not in text and str(spec) in text and f"prompts.train entry {entry!r}" in text and message in text


def test_a_missing_bucket_is_named_with_the_entry(s3_server):
    with pytest.raises(ValueError, match=r"prompts.train entry 's3://no-such-bucket-gf/p/date=\*/': .*bucket"):
        expand_prompt_files(["s3://no-such-bucket-gf/p/date=*/"])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_partition_added_later_is_picked_up_by_the_next_run_first(where, tmp_path, request):
    """A refresh: the next invocation's context lists the glob again, finds the new partition,
    records it in pipeline.json and takes its prompts first (least used, then new files)."""
    if where == "local":
        root = str(tmp_path / "prompts")
    else:
        root = f"s3://{request.getfixturevalue('s3_server').bucket()}/prompts"
    storage = open_storage(root)
    old = prompt_file(tmp_path / "old.parquet", PROMPTS[:10])
    storage.write("date=1/a.parquet", old.read_bytes())
    glob = f"{root}/date=*/"
    ctx = context(tmp_path / "run", [glob], per_round=4)
    sampled(ctx.store, 1, chosen(choose_prompts(ctx, 1)))
    assert load_pipeline_state(ctx.location.storage)["prompt_files"] == [f"{root}/date=1/a.parquet"]

    new = prompt_file(tmp_path / "new.parquet", PROMPTS[10:13])
    storage.write("date=2/b.parquet", new.read_bytes())
    ctx = context(tmp_path / "run", [glob], per_round=4)  # the next `groupforge run`
    assert ctx.prompt_files == [f"{root}/date=1/a.parquet", f"{root}/date=2/b.parquet"]
    round_2 = chosen(choose_prompts(ctx, 2))
    assert set(round_2[:3]) == set(PROMPTS[10:13])  # the new partition's prompts first
    assert load_pipeline_state(ctx.location.storage)["prompt_files"] == ctx.prompt_files
