"""The math reward: math-verify's parse + verify of the completion against the reference.

math-verify guards parse/verify with SIGALRM timeouts, which raise off the main thread. Here
both are called with their timeouts off (`parsing_timeout=None`, `timeout_seconds=None`),
and the score stage runs this reward in its process pool, which kills and replaces a worker
whose item runs past `timeout_s` (see curation/rewards/pool.py). Called directly, it has no
timeout: wrap it in `curation.rewards.pool.run_isolated` for untrusted completions.
"""

from __future__ import annotations

from curation.rewards.registry import completion_text, register_reward


@register_reward("math")
class MathVerify:
    """1.0 when the completion's final answer is mathematically equal to the reference, else
    0.0; None when there is no reference or it does not parse (TRL's accuracy_reward rule).

    The reference is read as LaTeX ("1+x^2" as "$1+x^2$": as plain text math-verify would
    take the first number, 1), then as it is if that finds nothing; the completion with
    math-verify's default extraction (LaTeX, \\boxed{}, plain expressions).

    >>> MathVerify()(["1/4+1/4="] * 3, ["\\\\boxed{\\\\frac{1}{2}}", "0.5", "1/3"], reference=["\\\\frac{2}{4}"] * 3)
    [1.0, 1.0, 0.0]
    """

    version = "1"

    def __init__(self, float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True):
        self.float_rounding, self.numeric_precision, self.strict = float_rounding, numeric_precision, strict

    def prepare(self) -> None:
        """Import math-verify (sympy) once per worker, outside the per-item timeout."""
        import logging

        import math_verify  # noqa: F401

        # Its "timeout is disabled" warning asks for a timeout of our own: the worker pool is it.
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)

    def __call__(self, prompts: list, completions: list, reference: list, **columns) -> list[float | None]:
        from math_verify import parse, verify

        scores: list[float | None] = []
        for completion, ref in zip(completions, reference):
            gold = [] if ref is None else (parse(_as_latex(ref), parsing_timeout=None)
                                           or parse(ref, parsing_timeout=None))
            if not gold:
                scores.append(None)
                continue
            answer = parse(completion_text(completion), parsing_timeout=None)
            equal = verify(gold, answer, float_rounding=self.float_rounding, numeric_precision=self.numeric_precision,
                           strict=self.strict, timeout_seconds=None)
            scores.append(float(equal))
        return scores


def _as_latex(reference: str) -> str:
    """A bare reference wrapped in $...$ so that math-verify reads all of it as one expression."""
    return reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
