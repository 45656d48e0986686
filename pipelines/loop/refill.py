"""Refill: DAPO's dynamic sampling in the round loop ([run] refill).

When filtering leaves a round fewer informative (kept) groups than `min_kept_groups`, the
round samples more prompts with the same policy, the next ones in prompt-choice order that it
has not sampled yet, in at most `max_calls` extra generate calls and `max_extra_prompts`
prompts, and curates again (the stages rerun: their inputs changed). Each call asks for the
missing groups divided by the round's kept rate so far. Every extra sample stays in the
tables, as part `refill-<k>` of the round; call k's prompts are written once to
RUN/_rounds/round=<n>/refill-<k>.parquet, so a killed round resumes with the same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from pipelines.loop.prompts import ranked_prompts
from pipelines.loop.steps import curate_round, kept_groups, sample
from store.run_files import round_prompts_rel
from store.storage import write_atomic

if TYPE_CHECKING:
    from pipelines.loop.run import RoundContext


def refill(ctx: RoundContext, round: int, start_version: int, stages: Sequence[str]) -> int:
    """While the round has fewer kept groups than `[run] refill.min_kept_groups`, sample more
    prompts (the next ones in prompt-choice order that the round has not sampled; `refill_size`
    of them) with the same policy, at most `max_extra_prompts` in at most `max_calls` calls,
    and curate the round again (`stages`). Call k's prompts are written once to
    RUN/_rounds/round=<n>/refill-<k>.parquet and its samples are the tables' part
    `refill-<k>`, so a killed round resumes with the same decisions (a call whose samples are
    committed is not sampled again). Returns the number of extra prompts."""
    settings = ctx.spec.run.refill
    location = ctx.location
    taken = set(pq.read_table(location.fetch(round_prompts_rel(round)), columns=["prompt_id"]).column(0).to_pylist())
    extra = 0
    for call in range(1, settings.max_calls + 1):
        rel = round_prompts_rel(round, f"refill-{call}.parquet")
        path = location.work / rel
        if location.storage.exists(rel):
            location.fetch(rel)
        else:
            kept = kept_groups(ctx.store, round)
            budget = settings.max_extra_prompts - extra
            if kept >= settings.min_kept_groups or budget <= 0:
                break
            count = refill_size(settings.min_kept_groups - kept, kept, len(taken), budget)
            chosen = ranked_prompts(ctx, round, exclude=taken).slice(0, count)
            if not chosen.num_rows:
                break  # every prompt of the pool is in the round already
            write_atomic(path, lambda f, table=chosen: pq.write_table(table, f))
            location.upload(rel)
            ctx.log(f"round {round}: {kept} kept groups < {settings.min_kept_groups}: refill {call} samples "
                    f"{chosen.num_rows} more prompts")
        ids = pq.read_table(path, columns=["prompt_id"]).column(0).to_pylist()
        taken.update(ids)
        extra += len(ids)
        if ctx.store.load_manifest(f"refill-{call}", round) is None:
            sample(ctx, round, path, start_version, stage=f"refill-{call}")
        curate_round(ctx, round, stages)
    return extra


def refill_size(missing: int, kept: int, sampled: int, budget: int) -> int:
    """Prompts a refill samples: the `missing` kept groups divided by the round's kept rate so
    far (kept / sampled prompts), the whole `budget` when nothing was kept; 1..budget.

    >>> refill_size(missing=10, kept=20, sampled=64, budget=100)  # 20 of 64 kept: 32 prompts give 10
    32
    """
    wanted = math.ceil(missing * sampled / kept) if kept else budget
    return max(1, min(budget, wanted))
