"""The browsable run report: RUN/report/index.html, static, no server, no network.

    report/index.html             the page: round curves, time per round, rejects by reason,
                                  and a sample browser (one round at a time, paged)
    report/data/run.js            the round records and rejects by reason (a few KB)
    report/data/round-<r>-<p>.js  page p of round r: up to GROUPS_PER_PAGE groups, each with its
                                  prompt, reference, and G responses (reward, advantage, kept or
                                  the reject reason), and the round's pairs of those groups; a
                                  trajectory (multi-turn sample) also has its turns, each message
                                  of messages_out with its role and whether it was trained on
                                  (the model's turns) or is tool/environment context (masked)

Data files are JavaScript that hands its JSON to the page (`groupforge.load(...)`): a page
opened from disk (file://) may load scripts but not fetch files. Pages are read from the
Parquet tables at report time through a snapshot (whole commits only), with DuckDB; at most
MAX_PAGES pages a round are written, so a round of a million samples stays a few MB (the page
says how many groups it leaves out). `#round=R&page=P` in the address opens that page.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from store import schema
from store.layout import connect
from store.run_store import RunStore
from store.storage import Storage, write_atomic

GROUPS_PER_PAGE = 40
MAX_PAGES = 25
DATA_DIR = "data"
TEXT_LIMIT = 2000  # characters of a prompt or response kept in a page (the rest: "…")


def write_html_report(run_dir: str | Path | Storage, out: Path, rounds: list[dict]) -> Path:
    """Write index.html and its data files into `out` (the report folder); returns index.html."""
    store = RunStore(run_dir).snapshot()
    con = connect()
    prompts = store.read("prompts") if store.files("prompts") else schema.empty("prompts")
    con.register("prompts", prompts.select(["prompt_id", "prompt", "messages", "reference"]))
    con.sql("CREATE TEMP TABLE prompt_text AS SELECT prompt_id, any_value(coalesce(prompt, "
                "CAST(messages AS VARCHAR))) AS prompt, any_value(reference) AS reference FROM prompts GROUP BY ALL")
    data = out / DATA_DIR
    tmp = out / f".{DATA_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pages, rejects = {}, []
    for round in store.rounds("samples"):
        store.duckdb_views(con, rounds=round, prefix="r_")
        pages[round] = _write_round_pages(con, round, store.read_columns("samples", ["prompt_id"], round), tmp)
        rejects += [{"round": round, "stage": stage, "reason": why, "rows": n} for stage, why, n in con.sql(
            "SELECT stage, reason, count(*) FROM r_rejects GROUP BY ALL ORDER BY stage, reason").fetchall()]
    run = {"name": store.name, "rounds": [_round_fields(r) for r in rounds], "rejects": rejects,
           "pages": {str(r): p for r, p in pages.items()}}
    (tmp / "run.js").write_text(_script(run))
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    index = out / "index.html"
    write_atomic(index, (Path(__file__).parent / "report_page.html").read_text())
    return index


def _round_fields(record: dict) -> dict[str, Any]:
    keep = ("round", "eval_accuracy", "reward_mean", "kept_groups", "groups", "samples", "pairs", "policy_version",
            "wall_seconds", "model_seconds", "phase_seconds")
    return {k: record.get(k) for k in keep if k in record}


def _write_round_pages(con, round: int, samples: pa.Table, folder: Path) -> dict[str, int]:
    """Write round `round`'s pages (views r_<table> over its files; `samples`: its prompt_id
    column, in the order generate wrote it); {"pages": written, "groups": in the round,
    "shown": groups written: the first GROUPS_PER_PAGE * MAX_PAGES}."""
    ids = pc.unique(samples.column("prompt_id"))  # first-seen order
    shown_ids = ids.slice(0, GROUPS_PER_PAGE * MAX_PAGES)
    con.register("shown", pa.table({"prompt_id": shown_ids, "n": pa.array(range(len(shown_ids)), pa.int64())}))
    trajectories = "messages_out" in con.sql("SELECT * FROM r_samples LIMIT 0").columns
    rows = con.sql(f"""
        SELECT sh.n, s.prompt_id, p.prompt, p.reference, s.sample_idx, s.response, sc.reward, g.advantage,
               g.group_kept, r.stage, r.reason, {"s.messages_out" if trajectories else "NULL"}
        FROM r_samples s
        JOIN shown sh USING (prompt_id)
        LEFT JOIN prompt_text p USING (prompt_id)
        LEFT JOIN r_scores sc ON sc.prompt_id = s.prompt_id AND sc.sample_idx = s.sample_idx
        LEFT JOIN r_groups g ON g.prompt_id = s.prompt_id AND g.sample_idx = s.sample_idx
        LEFT JOIN (SELECT prompt_id, sample_idx, min(stage) AS stage, arg_min(reason, stage) AS reason
                   FROM r_rejects GROUP BY ALL) r ON r.prompt_id = s.prompt_id AND r.sample_idx = s.sample_idx
        ORDER BY sh.n, s.sample_idx""").fetchall()
    pairs = con.sql("""
        SELECT sh.n, p.prompt_id, p.chosen_idx, p.rejected_idx, p.chosen_reward, p.rejected_reward, p.soft_label
        FROM r_pairs p JOIN shown sh USING (prompt_id) ORDER BY sh.n, p.chosen_idx, p.rejected_idx""").fetchall()
    shown = len(shown_ids)
    count = max(1, -(-shown // GROUPS_PER_PAGE))
    pages: list[dict] = [{"round": round, "page": page, "groups": [], "pairs": []} for page in range(count)]
    for n, prompt_id, prompt, reference, idx, response, reward, advantage, kept, stage, reason, out in rows:
        groups = pages[n // GROUPS_PER_PAGE]["groups"]
        if not groups or groups[-1]["prompt_id"] != prompt_id:
            groups.append({"prompt_id": prompt_id, "prompt": _cut(prompt), "reference": reference, "responses": []})
        status = "kept" if kept else (f"rejected: {reason} ({stage})" if reason else "not kept")
        groups[-1]["responses"].append({"idx": idx, "text": _cut(response), "reward": reward,
                                        "advantage": advantage, "status": status,
                                        **({"turns": _turns(out)} if out is not None else {})})
    for n, prompt_id, chosen, rejected, chosen_reward, rejected_reward, soft_label in pairs:
        pages[n // GROUPS_PER_PAGE]["pairs"].append({
            "prompt_id": prompt_id, "chosen": chosen, "rejected": rejected, "chosen_reward": chosen_reward,
            "rejected_reward": rejected_reward, "soft_label": soft_label})
    for page in pages:
        (folder / f"round-{round}-{page['page']}.js").write_text(_script(page))
    return {"pages": count, "groups": len(ids), "shown": shown}


def _turns(messages_out: str) -> list[dict[str, Any]]:
    """A trajectory's messages as the page shows them: role, text (an assistant turn's tool calls
    after its text) and trained (False: a tool or environment turn, masked out of training)."""
    turns = []
    for message in json.loads(messages_out):
        text = message.get("content") or ""
        if message.get("role") == "tool" and message.get("name"):
            text = f"[{message['name']}] {text}"
        turns.append({"role": message.get("role"), "text": _cut(text), "trained": message.get("role") == "assistant"})
    return turns


def _cut(text: str | None) -> str | None:
    return text if text is None or len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def _script(content: dict) -> str:
    """A data file: JSON handed to the page (</script> can never close a tag: < is escaped)."""
    return "groupforge.load(" + json.dumps(content, ensure_ascii=False).replace("<", "\\u003c") + ");\n"
