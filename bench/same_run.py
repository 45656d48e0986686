"""Same run: does a code change keep the toy round loop's behaviour byte for byte?

    python bench/same_run.py record --out DIGEST.json --work DIR [--repo R] [--python PY] [--pythonpath P]
    python bench/same_run.py compare A.json B.json [--ignore REGEX]

`record` runs pipelines/specs/toy-grpo.toml and toy-gspo.toml of the checkout REPO (default: the
current directory; the toy is built there as runs/toy if missing) for 12 small rounds (SETTINGS) with
its `groupforge` console script, in two invocations per spec: the first SIGKILLed at FAULT (round 7's
first optimizer step), the second the same command resuming to round 12. The code that runs is the
checkout `--pythonpath P` (default REPO), first on PYTHONPATH (`python -P`: not the current folder), so
an old worktree's code runs with this venv; the CLI module's file is checked to be under P and kept in
the digest's `meta`. Then it digests every file of each run folder and the toy:

- Parquet, safetensors and other files: sha256 of the bytes;
- JSON (the commit log's entries and states with the stages' manifests, trainer_state, pipeline.json,
  report/data/run.js), the Delta logs' actions, spec.toml, metrics.jsonl's records: the values, without
  DROPPED fields (times, rates, the writing job's id, code version and the seal over them) and the
  Delta tables' random ids, the run folder's absolute path written as RUN;
- report/summary.md: its text without the time section and the wall/tokens-per-second figures;
- SKIPPED files (the writer lock, temp files and folders named by pid, the Delta logs' Parquet checkpoints, which
  hold the times of the JSON versions they sum up) are only listed (compared by name, digits masked).

Each run's live tables are digested too (`LIVE`: rows read by the code under test), so a change of the
log's format is compared by what it holds: `compare --ignore REGEX` leaves the log's own files out.

`compare` prints every difference (a file on one side only, another hash, another field value with
both values) and exits 1 if there is any, else 0. `meta` (paths, commit, CLI file) is shown, not compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

SPECS = ("pipelines/specs/toy-grpo.toml", "pipelines/specs/toy-gspo.toml")
SETTINGS = ("run.rounds=12", "prompts.per_round=32", "run.steps_per_round=2", "run.checkpoint_every=4",
            "eval.every=4", "train.share_prompts=false")
FAULT = "train.step_logged:13"  # 2 steps a round: the first step of round 7 (checkpoints at rounds 4, 8, 12)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1"}
# Times and rates (wall clock: a commit log entry's `at`, a manifest's `created_at`, the Delta logs'
# timestamps), the writing job's id (host:pid:random, in the commit log), the code's version string,
# and `seal` (a manifest's sha256 over its other fields, created_at and code_version included).
# Nothing else is left out.
DROPPED = {"created_at", "at", "writer", "mtime_ns", "code_version", "seal", "timestamp", "modificationTime",
           "deletionTimestamp", "createdTime"}
SKIPPED = re.compile(r"(^|/)(\.lock|\.gf-tmp-.*|\.tmp-.*|_delta_log/(_last_checkpoint|.*\.checkpoint\.parquet))$")
LIVE = ("import hashlib, json, sys; from store import schema; from store.run_store import RunStore; "
        "store = RunStore(sys.argv[1]); rows = lambda t: sorted(json.dumps(r, sort_keys=True, default=str) "
        "for r in store.read(t).to_pylist()); "
        "print(json.dumps({t: {'rows': len(r), 'sha256': hashlib.sha256('\\n'.join(r).encode()).hexdigest()} "
        "for t in schema.SCHEMAS for r in [rows(t)]}))")
"""Each table's live rows as the run's own reader (the code under test) reads them: their count
and the sha256 of the rows, sorted, one JSON object a line; the same whatever the log's format."""
CLI = ("import importlib, sys; m = importlib.import_module(sys.argv.pop(1)); f = sys.argv.pop(1); "
       "print('groupforge-cli-file:', m.__file__, file=sys.stderr, flush=True); "
       "sys.argv[0] = 'groupforge'; sys.exit(getattr(m, f)())")


def dropped(key: str) -> bool:
    return key in DROPPED or key == "seconds" or key.endswith(("_seconds", "tokens_per_s"))


def clean(value, run_dir: str):
    if isinstance(value, dict):
        return {k: clean(v, run_dir) for k, v in value.items() if not dropped(k)}
    if isinstance(value, list):
        return [clean(v, run_dir) for v in value]
    return value.replace(run_dir, "RUN") if isinstance(value, str) else value


def summary_text(text: str) -> list[str]:
    """summary.md without its "## Time" section, the header's "N s wall" and its seconds and tokens/s columns."""
    lines, skip, table, drop = [], False, False, set()
    for line in text.splitlines():
        skip = line == "## Time" if line.startswith("## ") else skip
        if skip:
            continue
        line = re.sub(r"[\d.]+ s wall", "_ s wall", line)
        row = line.startswith("|")
        if row:
            cells = line.strip("|").split("|")
            if not table:  # a header row
                drop = {i for i, cell in enumerate(cells) if cell.strip() == "seconds" or "tokens/s" in cell}
            line = "|".join(cell for i, cell in enumerate(cells) if i not in drop)
        table = row
        lines.append(line)
    return lines


def digest_file(path: Path, run_dir: str):
    name = path.name
    if path.parent.name == "_delta_log" and name.endswith(".json"):  # a Delta version: one action a line
        actions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for action in actions:
            action.get("metaData", {}).pop("id", None)  # a random uuid
        return clean(actions, run_dir)
    if name == "metrics.jsonl":
        return [clean(json.loads(line), run_dir) for line in path.read_text().splitlines() if line.strip()]
    if name.endswith(".json"):
        return clean(json.loads(path.read_text()), run_dir)
    if name == "run.js":
        text = path.read_text()
        return clean(json.loads(text[text.index("(") + 1:text.rindex(")")]), run_dir)
    if name.endswith(".toml"):
        return clean(tomllib.loads(path.read_text()), run_dir)
    if name == "summary.md":
        return summary_text(path.read_text())
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def digest_tree(root: Path, prefix: str, files: dict, skipped: list) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if SKIPPED.search(rel):
            skipped.append(f"{prefix}/{rel}")
        else:
            files[f"{prefix}/{rel}"] = digest_file(path, str(root.resolve()))


def groupforge(args: argparse.Namespace, argv: list[str], log: Path, fault: str | None = None) -> tuple[int, str]:
    module, _, func = tomllib.loads((args.pythonpath / "pyproject.toml").read_text())["project"]["scripts"][
        "groupforge"].partition(":")
    env = {k: v for k, v in os.environ.items() if k not in ("GROUPFORGE_FAULT", "GROUPFORGE_PAUSE")} | ENV
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.pythonpath), env.get("PYTHONPATH")]))
    if fault:
        env["GROUPFORGE_FAULT"] = fault
    with log.open("w") as out:
        rc = subprocess.run([args.python, "-P", "-c", CLI, module, func, *argv], cwd=args.repo, env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    found = re.search(r"groupforge-cli-file: (.*)", log.read_text())
    if not found:
        sys.exit(f"groupforge {argv[0]}: no CLI module ran (see {log})")
    cli_file = found.group(1)
    if not Path(cli_file).resolve().is_relative_to(args.pythonpath):
        sys.exit(f"{cli_file} ran, not the code under {args.pythonpath}")
    return rc, cli_file


def live_tables(args: argparse.Namespace, run_dir: Path) -> dict:
    """`LIVE` run with the code under test (`--pythonpath`)."""
    path = os.pathsep.join(filter(None, [str(args.pythonpath), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([args.python, "-P", "-c", LIVE, str(run_dir)], cwd=args.repo, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"reading {run_dir}'s tables failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def record(args: argparse.Namespace) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    files, skipped, meta = {}, [], {"repo": str(args.repo), "pythonpath": str(args.pythonpath),
                                    "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.pythonpath,
                                                             capture_output=True, text=True).stdout.strip(),
                                    "settings": SETTINGS, "fault": FAULT}
    if not (args.repo / "runs/toy/toy.json").exists():
        rc, _ = groupforge(args, ["toy", "build", "--out", "runs/toy"], args.work / "toy.log")
        if rc:
            sys.exit(f"toy build failed ({rc}): {args.work / 'toy.log'}")
    digest_tree((args.repo / "runs/toy").resolve(), "toy", files, skipped)
    for spec in SPECS:
        name = Path(spec).stem
        run_dir = (args.work / name).resolve()
        if run_dir.exists():
            sys.exit(f"{run_dir} exists: record into a fresh --work folder")
        argv = ["run", spec, "--run-dir", str(run_dir), *(a for s in SETTINGS for a in ("--set", s))]
        for attempt, fault in (("killed", FAULT), ("resumed", None)):
            log = args.work / f"{name}-{attempt}.log"
            print(f"{name} {attempt}: {'GROUPFORGE_FAULT=' + fault + ' ' if fault else ''}groupforge {' '.join(argv)}",
                  flush=True)
            rc, meta["cli_file"] = groupforge(args, argv, log, fault)
            if rc != (-signal.SIGKILL if fault else 0):
                sys.exit(f"{name} {attempt}: exit {rc} (see {log})")
            if fault:  # where the kill left the run: compared too
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                files[f"{name}/killed-at"] = {"last_round": max(r["round"] for r in records if r["event"] == "round"),
                                             "steps": [r["step"] for r in records if r["event"] == "step"]}
        digest_tree(run_dir, name, files, skipped)
        files[f"{name}/live-tables"] = live_tables(args, run_dir)
    print(f"cli module: {meta['cli_file']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "skipped": skipped, "files": files}, indent=1, sort_keys=True) + "\n")
    print(f"{len(files)} files digested, {len(skipped)} skipped -> {args.out}")


def flat(value, path: str, out: dict) -> dict:
    if isinstance(value, (dict, list)) and value:
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(value, list) and isinstance(item, dict) and "event" in item:  # a metrics record
                key = f"{key} {item['event']} {item.get('step', item.get('round'))}"
            flat(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]", out)
    else:
        out[path] = value
    return out


def compare(args: argparse.Namespace) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    for side, d in (("A", a), ("B", b)):
        print(f"{side}: {d['meta']}")
    diffs = 0
    masked = [{re.sub(r"\d+", "N", name) for name in d["skipped"]} for d in (a, b)]  # pids, counters
    for side, mine, other in (("A", *masked), ("B", *masked[::-1])):
        for name in sorted(mine - other):
            print(f"skipped only in {side}: {name}")
            diffs += 1
    ignored = re.compile(args.ignore) if args.ignore else None
    for name in sorted(a["files"].keys() | b["files"].keys()):
        if ignored is not None and ignored.search(name):
            continue
        if name not in b["files"] or name not in a["files"]:
            print(f"only in {'A' if name in a['files'] else 'B'}: {name}")
            diffs += 1
            continue
        fa, fb = flat(a["files"][name], name, {}), flat(b["files"][name], name, {})
        for key in sorted(fa.keys() | fb.keys()):
            va, vb = fa.get(key, "<missing>"), fb.get(key, "<missing>")
            if va != vb:
                print(f"{key}: A={json.dumps(va)} B={json.dumps(vb)}")
                diffs += 1
    print(f"{diffs} difference(s)")
    sys.exit(1 if diffs else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--work", type=Path, required=True)
    rec.add_argument("--repo", type=Path, default=Path.cwd())
    rec.add_argument("--python", default=None, help="default: REPO/.venv/bin/python, else this interpreter")
    rec.add_argument("--pythonpath", type=Path, default=None,
                     help="the checkout whose code (and pyproject's console script) runs (default: REPO)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.add_argument("--ignore", help="a regex: files whose name it matches are not compared (e.g. a log whose "
                                      "format changed: '/(_log|_commits|[a-z_]+/_delta_log)/')")
    args = parser.parse_args()
    if args.mode == "record":
        args.repo = args.repo.resolve()
        args.pythonpath = (args.pythonpath or args.repo).resolve()
        venv = args.repo / ".venv/bin/python"
        args.python = args.python or (str(venv) if venv.exists() else sys.executable)
        record(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
