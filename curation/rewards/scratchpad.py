"""Long-response rewards: the final answer after a `####` marker, and the toy's scratchpad steps.

The toy's scratchpad task (pipelines/toy/build.py, `--task scratchpad`) writes an addition column by
column from the right, each step `a+b+carry=sum` with the sum as two digits (its first digit is
the carry into the next column), then the answer after GSM8K's `####` marker:

    347+586=  ->  7+6+0=13 4+8+1=13 3+5+1=09 #### 933

The format lives here, below pipelines/, because both the toy's build (its supervised
solutions) and the partial-credit reward (the expected steps of a prompt) need it.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc

from curation.rewards.registry import completion_text, register_reward

MARKER = "####"
ADDITION_PROMPT = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")
WELL_FORMED = re.compile(r"^(?:\d\+\d\+[01]=\d\d )+#### \d+$")
"""A scratchpad response in the format, right or wrong."""


def scratchpad_steps(a: int, b: int) -> list[str]:
    """The column steps of a + b, ones column first; a missing digit is 0.

    >>> scratchpad_steps(347, 586)
    ['7+6+0=13', '4+8+1=13', '3+5+1=09']
    """
    steps, carry = [], 0
    for column in range(max(len(str(a)), len(str(b)))):
        x, y = a // 10**column % 10, b // 10**column % 10
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return steps


def scratchpad_solution(a: int, b: int) -> str:
    """The full response to `a+b=`: the steps, then `#### a+b`.

    >>> scratchpad_solution(999, 1)
    '9+1+0=10 9+0+1=10 9+0+1=10 #### 1000'
    """
    return " ".join([*scratchpad_steps(a, b), f"{MARKER} {a + b}"])


def final_answer(text: str, marker: str = MARKER) -> str | None:
    """The text after the last `marker`, stripped; None without a marker.

    >>> final_answer("3+5+1=09 #### 933 "), final_answer("933")
    ('933', None)
    """
    head, found, answer = text.rpartition(marker)
    return answer.strip() if found else None


@register_reward("final_answer")
class FinalAnswer:
    """1.0 when the text after the completion's last `marker` (default `####`) equals the reference
    (both stripped), else 0.0 (also without a marker); None without a reference.

    >>> FinalAnswer()(["347+586="] * 3, ["4+8+1=13 #### 933", "#### 932", "933"], reference=["933"] * 3)
    [1.0, 0.0, 0.0]
    """

    version = "1"

    def __init__(self, marker: str = MARKER):
        if not marker:
            raise ValueError("final_answer reward: marker must be non-empty")
        self.marker = marker

    def __call__(self, prompts: list, completions: list, reference: list, **columns) -> list[float | None]:
        scores: list[float | None] = []
        for completion, ref in zip(completions, reference):
            answer = final_answer(completion_text(completion), self.marker)
            scores.append(None if ref is None else float(answer == ref.strip()))
        return scores

    def vectorized(self, completions: pa.ChunkedArray, reference: pa.ChunkedArray, **columns) -> pa.ChunkedArray:
        """The same over Arrow string columns: RE2's greedy `.*` finds the last marker."""
        found = pc.extract_regex(completions, rf"(?s)^.*{re.escape(self.marker)}(?P<answer>.*)$")
        answer = pc.utf8_trim_whitespace(pc.struct_field(found, "answer"))
        equal = pc.fill_null(pc.equal(answer, pc.utf8_trim_whitespace(reference)), False)
        return pc.if_else(pc.is_null(reference), pa.scalar(None, pa.float64()), equal.cast(pa.float64()))


@register_reward("scratchpad_steps")
class ScratchpadSteps:
    """Partial credit for the toy's scratchpad: the fraction of the expected column steps of an
    `a+b=` prompt that the completion writes right, in place (steps are the space-separated
    words before the last `####`, or all of them without one; a missing or extra step counts
    as wrong). None for a prompt that is not `a+b=`.

    >>> ScratchpadSteps()(["347+586="] * 3, ["7+6+0=13 4+8+1=13 3+5+1=09 #### 933",
    ...                                      "7+6+0=13 4+8+1=12 3+5+1=09 #### 923", "#### 933"])
    [1.0, 0.6666666666666666, 0.0]
    >>> ScratchpadSteps()(["347+586=", "hi"], ["7+6+0=13 4+8+1=13 3+5+1=09 1+1+0=02", "#### 1"])
    [0.75, None]
    """

    version = "1"
    isolate = False  # string splits on short texts: batched in the stage's process

    def __call__(self, prompts: list, completions: list, **columns) -> list[float | None]:
        scores: list[float | None] = []
        for prompt, completion in zip(prompts, completions):
            operands = ADDITION_PROMPT.match(prompt) if isinstance(prompt, str) else None
            if operands is None:
                scores.append(None)
                continue
            expected = scratchpad_steps(int(operands[1]), int(operands[2]))
            head, found, tail = completion_text(completion).rpartition(MARKER)
            written = (head if found else tail).split()
            right = sum(e == w for e, w in zip(expected, written))
            scores.append(right / max(len(expected), len(written)))
        return scores
