"""The toy's task families, one table entry each: the operands a problem is made of, its prompt,
its reference, the response the warm start learns and the answer a response gives.

A problem is a tuple of integer operands, each from an inclusive range (most ranges are
ToyConfig's `operand_min..operand_max`); a family's problems are all such tuples, which
pipelines/toy/task.py shuffles and splits into eval and train prompts. The reward of every
family is exact match of the response's answer with the reference:

    addition    37+48=                ->  85
    scratchpad  347+586=              ->  7+6+0=13 4+8+1=13 3+5+1=09 #### 933   (answer after ####)
    multiply    3471*6=               ->  20826
    reverse     rev(83071536)=        ->  63517038
    sort        sort(83071536)=       ->  01335678
    max         max(374018,372955)=   ->  374018

Light on purpose (no torch): ToyConfig's flags and the tokenizer read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from curation.rewards.scratchpad import final_answer, scratchpad_solution

CHARACTERS = "0123456789+-*="
"""The character vocabulary after the tokenizer's special tokens (ids 4..): addition's, and the
start of every family's (`Family.characters`), so that these characters keep their ids."""

Range = tuple[int, int]


@dataclass(frozen=True)
class Family:
    """A task family: every callable but `operands` and `answer` takes the operands as ints."""

    operands: Callable[[int, int], tuple[Range, ...]]
    """The inclusive range of each operand, given ToyConfig's (operand_min, operand_max)."""
    prompt: Callable[..., str]
    reference: Callable[..., str]
    example: tuple[int, ...]
    """Operands shown in the docs and the --task help."""
    description: str
    """What toy.json records as the task."""
    response: Callable[..., str] | None = None
    """The response the warm start learns; None: the reference."""
    answer: Callable[[str], str | None] = str.strip
    """The answer a response gives; the reward is its exact match with the reference."""
    characters: str = CHARACTERS
    """The tokenizer's characters: CHARACTERS, then any more the family's prompts and responses use."""
    defaults: dict = field(default_factory=dict)
    """ToyConfig field defaults where they differ from the addition toy's."""


# The families beside addition and the scratchpad: each a different skill with a short answer
# (4-8 tokens) on addition's model (529k parameters) and target (greedy accuracy 0.30). The warm
# start learns 8,192 prompts whatever the train size: on 256 alone it memorises them and stays
# near 0.01 on eval. Operand sizes: where a warm start needs 40-250 steps to the target (longer
# operands put it off; three 2-digit operands summed never got past 0.14 in 1,200).
_SHORT_ANSWER = {"n_train": 8192, "warm_start_prompts": 8192}
# reverse and sort go from 0.3 to 0.4-0.5 in 5 steps: checked every 2 they stop nearer the target
_LEARNED_IN_A_JUMP = {"eval_every": 2}

FAMILIES: dict[str, Family] = {
    "addition": Family(
        operands=lambda lo, hi: ((lo, hi), (lo, hi)),
        prompt=lambda a, b: f"{a}+{b}=",
        reference=lambda a, b: str(a + b),
        example=(37, 48),
        description="two-digit addition; reward = exact match of response.strip() with reference",
    ),
    "scratchpad": Family(
        operands=lambda lo, hi: ((lo, hi), (lo, hi)),
        prompt=lambda a, b: f"{a}+{b}=",
        reference=lambda a, b: str(a + b),
        example=(347, 586),
        description="addition with a column-by-column scratchpad; reward = final_answer (the text after the last "
        "'####' equals reference), partial credit = scratchpad_steps",
        response=scratchpad_solution,
        answer=final_answer,
        characters=CHARACTERS + " #",
        # 3-digit operands (36-37 tokens per response), a train set the size of a warm start
        # rather than all 809,600 prompts, a quarter of the addition model's weights and one
        # thread: ~4x longer sequences make tokens the cost of the build and of every RL round
        defaults={
            "operand_min": 100,
            "operand_max": 999,
            "n_train": 20000,
            "hidden_size": 64,
            "num_heads": 2,
            "intermediate_size": 256,
            "target_accuracy": 0.25,  # accuracy climbs in jumps here (0.12 -> 0.29 -> 0.41 in 10 steps)
            "num_threads": 1,
        },
    ),
    "multiply": Family(
        operands=lambda lo, hi: ((lo, hi), (1, 9)),
        prompt=lambda a, d: f"{a}*{d}=",
        reference=lambda a, d: str(a * d),
        example=(3471, 6),
        description="a 3-4 digit number times a digit; reward = exact match of response.strip() with reference",
        # 89,100 problems: on 10..999 (8,910) the warm start saw 92% of them, and 30 rounds of GRPO on
        # 512 prompts moved eval accuracy 0.8 points; here they move it 8
        defaults={"operand_min": 100, "operand_max": 9999, **_SHORT_ANSWER},
    ),
    "reverse": Family(
        operands=lambda lo, hi: ((lo, hi),),
        prompt=lambda n: f"rev({n})=",
        reference=lambda n: str(n)[::-1],
        example=(83071536,),
        description="the digits of an eight-digit number in reverse order; reward = exact match of response.strip() "
        "with reference",
        characters=CHARACTERS + "rev()",
        defaults={"operand_min": 10_000_000, "operand_max": 99_999_999, **_SHORT_ANSWER, **_LEARNED_IN_A_JUMP},
    ),
    "sort": Family(
        operands=lambda lo, hi: ((lo, hi),),
        prompt=lambda n: f"sort({n})=",
        reference=lambda n: "".join(sorted(str(n))),
        example=(83071536,),
        description="the digits of an eight-digit number in ascending order; reward = exact match of response.strip() "
        "with reference",
        characters=CHARACTERS + "sort()",
        defaults={"operand_min": 10_000_000, "operand_max": 99_999_999, **_SHORT_ANSWER, **_LEARNED_IN_A_JUMP},
    ),
    "max": Family(
        operands=lambda lo, hi: ((lo, hi),) * 2,
        prompt=lambda a, b: f"max({a},{b})=",
        reference=lambda a, b: str(max(a, b)),
        example=(374018, 372955),
        description="the larger of two six-digit numbers; reward = exact match of response.strip() with reference",
        characters=CHARACTERS + "max(),",
        defaults={"operand_min": 100_000, "operand_max": 999_999, **_SHORT_ANSWER},
    ),
}
"""The toy's task families by name (`ToyConfig.task`); addition first, the default."""


def example(name: str) -> tuple[str, str]:
    """(prompt, supervised response) of a family's example operands."""
    family = FAMILIES[name]
    return family.prompt(*family.example), (family.response or family.reference)(*family.example)
