"""Chat-format task families for a real chat model: prompt files of one user turn each, with a
number as the reference (the `math` reward finds it in a sentence too).

    addition     What is 37 + 48? Reply with just the number.        ->  85
    subtraction  What is 85 - 37? Reply with just the number.        ->  48
    multiply     What is 47 * 6? Reply with just the number.         ->  282
    long-multiply  What is 347 * 586? Reply with just the number.    ->  203342  (a calculator's job)
    max          Which is larger, 374 or 372? Reply with just the number.  ->  374

`groupforge model tasks --task addition --out DIR` writes DIR/train.parquet and DIR/eval.parquet
(disjoint problems, seeded). Light: no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPLY = " Reply with just the number."


@dataclass(frozen=True)
class ChatTask:
    """A family: a problem drawn from a seeded generator, its question and its answer."""

    draw: Callable[[random.Random], tuple[int, ...]]
    question: Callable[..., str]
    answer: Callable[..., int]


TASKS: dict[str, ChatTask] = {
    "addition": ChatTask(lambda r: (r.randint(10, 99), r.randint(10, 99)),
                         lambda a, b: f"What is {a} + {b}?", lambda a, b: a + b),
    "subtraction": ChatTask(lambda r: tuple(sorted((r.randint(10, 99), r.randint(10, 99)), reverse=True)),
                            lambda a, b: f"What is {a} - {b}?", lambda a, b: a - b),
    "multiply": ChatTask(lambda r: (r.randint(11, 99), r.randint(2, 9)),
                         lambda a, b: f"What is {a} * {b}?", lambda a, b: a * b),
    "max": ChatTask(lambda r: (r.randint(100, 999), r.randint(100, 999)),
                    lambda a, b: f"Which is larger, {a} or {b}?", max),
    "long-multiply": ChatTask(lambda r: (r.randint(100, 999), r.randint(100, 999)),
                              lambda a, b: f"What is {a} * {b}?", lambda a, b: a * b),
}


def task_rows(task: str, n: int, seed: int, exclude: set[tuple[int, ...]] = frozenset()) -> list[dict]:
    """`n` distinct problems of `task` not in `exclude`, as prompt-file rows (messages, reference)."""
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: one of {', '.join(TASKS)}")
    family, rng, seen, rows = TASKS[task], random.Random(seed), set(exclude), []
    for _ in range(100 * n):
        if len(rows) == n:
            break
        problem = family.draw(rng)
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"messages": [{"role": "user", "content": family.question(*problem) + REPLY}],
                     "reference": str(family.answer(*problem)), "problem": problem})
    if len(rows) < n:
        raise ValueError(f"--task {task}: only {len(rows)} distinct problems, asked for {n}")
    return rows


def write_task(task: str, out: str | Path, train: int = 512, eval: int = 128, seed: int = 0) -> tuple[Path, Path]:
    """DIR/eval.parquet (`eval` problems) and DIR/train.parquet (`train` others) of `task`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    held_out = task_rows(task, eval, seed)
    trained = task_rows(task, train, seed + 1, exclude={row["problem"] for row in held_out})
    paths = out / "train.parquet", out / "eval.parquet"
    for rows, path in zip((trained, held_out), paths):
        table = pa.Table.from_pylist([{k: v for k, v in row.items() if k != "problem"} for row in rows])
        pq.write_table(table, path.with_suffix(".parquet.tmp"))
        path.with_suffix(".parquet.tmp").replace(path)
    return paths
