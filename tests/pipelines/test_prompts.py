"""pipelines/loop/prompts.py: the informative strategy (prompts whose recent pass rate is between 0
and 1 first, saturated ones drawn less but never dropped), pass rates from real scores tables,
PromptChoice. The default strategy's behaviour: tests/pipelines/test_choose_prompts.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from pydantic import ValidationError

from curation.generate.base import prompt_id_of
from pipelines.loop.prompts import PromptBook, PromptChoice, choose_prompts, pass_rates, prompt_choice, ranked_prompts
from pipelines.loop.run import RoundContext
from pipelines.spec import PipelineSpec
from store.location import RunLocation
from store.run_store import RunStore
from store.schema import SCHEMAS
from tests.helpers import PROMPTS, chosen, prompt_file, sampled, sha64, splitmix64


@dataclass
class Context:
    """The parts of RoundContext prompt choice reads, with a `[prompts] choice` the spec may not
    have a field for yet."""

    spec: SimpleNamespace
    store: RunStore
    prompts: PromptBook = field(default_factory=PromptBook)

    @property
    def prompt_files(self) -> list[str]:
        return self.spec.prompts.train

    @property
    def location(self) -> RunLocation:
        return RunLocation.of(self.store.storage)


def context(run_dir: Path, train: list[Path], per_round: int, seed: int = 0, **choice) -> Context:
    spec = SimpleNamespace(run=SimpleNamespace(seed=seed),
                           prompts=SimpleNamespace(train=[str(f) for f in train], per_round=per_round,
                                                   curriculum=False,
                                                   choice=PromptChoice(strategy="informative", **choice)))
    return Context(spec=spec, store=RunStore(run_dir))


def scored(store: RunStore, round: int, rewards: dict[str, list[float | None]]) -> None:
    """A scores table for `round`: one row per reward of each prompt text."""
    rows = [{"run_id": "choose", "round": round, "prompt_id": prompt_id_of(text, None), "sample_idx": i,
             "reward": reward, "scorer": "{}"}
            for text, values in rewards.items() for i, reward in enumerate(values)]
    with store.commit("score", round, {}, {}) as commit:
        commit.write("scores", pa.Table.from_pylist(rows, schema=SCHEMAS["scores"]))


def expected_order(texts: list[str], saturated: set[str], floor: float, seed: int, round: int) -> list[str]:
    """The weighted draw by hand: key = -ln(u) / weight, u from the top 53 bits of the
    prompt's h (test_choose_prompts' reference splitmix64), smallest key first."""
    def key(text: str) -> float:
        h = splitmix64(sha64(prompt_id_of(text, None)) ^ sha64(f"{seed}:{round}"))
        u = ((h >> 11) + 0.5) / 2**53
        return -math.log(u) / (floor if text in saturated else 1.0)
    return sorted(texts, key=key)


SOLVED, FAILED, MIXED = [1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 1.0]
SATURATED = PROMPTS[:10]  # round 1: half solved every time, half never
INFORMATIVE = PROMPTS[10:]


def history(store: RunStore) -> None:
    """Round 1 sampled every prompt: SATURATED ones all-equal rewards, INFORMATIVE ones mixed."""
    rewards = {text: (SOLVED if i % 2 else FAILED) for i, text in enumerate(SATURATED)}
    scored(store, 1, {**rewards, **{text: MIXED for text in INFORMATIVE}})


def test_informative_prompts_first_in_the_seeded_weighted_order(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=6, seed=3, floor=0.1)
    history(ctx.store)
    order = chosen(choose_prompts(ctx, 2))
    assert order == expected_order(PROMPTS, set(SATURATED), 0.1, seed=3, round=2)[:6]
    # With a floor that small, every chosen prompt is an informative one.
    tiny = context(tmp_path / "tiny", [train], per_round=6, seed=3, floor=1e-9)
    history(tiny.store)
    assert set(chosen(choose_prompts(tiny, 2))) <= set(INFORMATIVE)


def test_saturated_prompts_are_drawn_less_but_never_dropped(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=5, floor=0.2)
    history(ctx.store)
    picks = [text for round in range(2, 62) for text in ranked_prompts(ctx, round).column("prompt").to_pylist()[:5]]
    saturated_picks = sum(text in SATURATED for text in picks)
    assert 0 < saturated_picks < len(picks) / 4  # weight 0.2 against 1: drawn much less often
    assert set(picks) == set(PROMPTS)  # every saturated prompt still gets its turns
    assert len(ranked_prompts(ctx, 2)) == len(PROMPTS)  # the ranking never drops a prompt


def test_unseen_prompts_count_as_informative(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    ctx = context(tmp_path / "run", [train], per_round=20, floor=0.1)
    scored(ctx.store, 1, {text: SOLVED for text in PROMPTS[:10]})  # PROMPTS[10:] never sampled
    assert chosen(choose_prompts(ctx, 2)) == expected_order(PROMPTS, set(PROMPTS[:10]), 0.1, seed=0, round=2)


def test_pass_rate_over_the_last_window_rounds_a_prompt_was_sampled_in(tmp_path):
    store = RunStore(tmp_path / "run")
    a, b, c = "1 + 1 =", "2 + 2 =", "3 + 3 ="
    scored(store, 1, {a: MIXED, b: FAILED, c: [1.0, None, 1.0]})
    scored(store, 2, {b: FAILED})
    scored(store, 3, {a: SOLVED})  # a skipped round 2: its last two sampled rounds are 1 and 3
    scored(store, 4, {a: FAILED, b: MIXED, c: MIXED})  # not before round 4: does not count
    rates = {text: pass_rates(store, 4, 2)[prompt_id_of(text, None)] for text in (a, b, c)}
    assert rates == {a: (0.75, False), b: (0.0, True), c: (1.0, True)}  # nulls are not scored samples
    assert pass_rates(store, 4, 1)[prompt_id_of(a, None)] == (1.0, True)  # only round 3
    assert pass_rates(store, 4, 1)[prompt_id_of(b, None)] == (0.0, True)
    assert pass_rates(store, 1, 2) == {}


def test_the_draw_is_a_function_of_seed_and_round(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)

    def draw(name: str, seed: int, round: int) -> list[str]:
        ctx = context(tmp_path / name, [train], per_round=6, seed=seed)
        history(ctx.store)
        return chosen(choose_prompts(ctx, round))

    first = draw("a", 1, 2)
    assert draw("b", 1, 2) == first
    assert draw("c", 2, 2) != first and draw("d", 1, 3) != first
    # A rerun after a kill, with this round's scores already on disk, chooses the same.
    ctx = context(tmp_path / "e", [train], per_round=6, seed=1)
    history(ctx.store)
    scored(ctx.store, 2, {text: SOLVED for text in PROMPTS})
    assert ranked_prompts(ctx, 2).column("prompt").to_pylist()[:6] == first


def test_prompts_of_a_new_file_first_and_exclude(tmp_path):
    old = prompt_file(tmp_path / "old.parquet", PROMPTS[:10])
    new = prompt_file(tmp_path / "new.parquet", PROMPTS[10:13])
    ctx = context(tmp_path / "run", [old], per_round=4)
    choose_prompts(ctx, 1)
    ctx = context(tmp_path / "run", [old, new], per_round=4)
    ranked = ranked_prompts(ctx, 2).column("prompt").to_pylist()
    assert ranked[:3] == expected_order(PROMPTS[10:13], set(), 0.1, seed=0, round=2)
    assert ranked[3:] == expected_order(PROMPTS[:10], set(), 0.1, seed=0, round=2)
    taken = {prompt_id_of(text, None) for text in ranked[:4]}
    assert ranked_prompts(ctx, 2, exclude=taken).column("prompt").to_pylist() == ranked[4:]


def test_least_used_is_the_default_and_ranked_prompts_extends_it(tmp_path):
    train = prompt_file(tmp_path / "train.parquet", PROMPTS)
    spec = PipelineSpec.model_validate({
        "run": {"name": "choose"}, "model": {"path": "unused"},
        "prompts": {"train": [str(train)], "eval": "unused.parquet", "per_round": 8}})
    ctx = RoundContext(spec=spec, store=RunStore(tmp_path / "run"))
    assert prompt_choice(spec) == PromptChoice() and PromptChoice().strategy == "least_used"
    sampled(ctx.store, 1, PROMPTS[:12])
    ranked = ranked_prompts(ctx, 2).column("prompt").to_pylist()
    assert chosen(choose_prompts(ctx, 2)) == ranked[:8]
    assert set(ranked[:8]) == set(PROMPTS[12:])  # the 8 unused ones, then the used ones
    assert len(ranked) == len(PROMPTS)


def test_prompt_choice_settings_are_checked():
    assert prompt_choice(SimpleNamespace(prompts=SimpleNamespace(choice={"strategy": "informative"}))).window == 2
    for bad in ({"floor": 0}, {"floor": 1.5}, {"window": 0}, {"strategy": "best"}, {"windw": 3}):
        with pytest.raises(ValidationError):
            PromptChoice.model_validate(bad)
    for name, model_field in PromptChoice.model_fields.items():
        assert model_field.description, name
