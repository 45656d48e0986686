"""Rule-based rewards: exact match, a regex format reward, and two length penalties.

Each is a picklable callable class with TRL's signature and, where the rule is a column
expression, a `vectorized` form over Arrow arrays that the score stage uses instead of a
Python call per row.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from curation.rewards.registry import completion_text, register_reward


def _token_lengths(columns: dict) -> list[int]:
    ids = columns.get("response_token_ids", columns.get("completion_ids"))
    if ids is None:
        raise ValueError("this reward needs the response_token_ids (or completion_ids) column")
    return [len(x) for x in ids]


def _lengths_array(columns: dict) -> np.ndarray:
    ids = columns.get("response_token_ids", columns.get("completion_ids"))
    if ids is None:
        raise ValueError("this reward needs the response_token_ids (or completion_ids) column")
    if isinstance(ids, (pa.Array, pa.ChunkedArray)):
        return pc.list_value_length(ids).fill_null(0).to_numpy().astype(np.float64)
    return np.array([len(x) for x in ids], dtype=np.float64)


@register_reward("exact_match")
class ExactMatch:
    """1.0 when the completion equals the reference (both stripped), else 0.0; None without a reference.

    >>> ExactMatch()(["2+2="], [" 4\\n"], reference=["4"])
    [1.0]
    >>> ExactMatch()(["2+2=", "2+2="], ["5", "4"], reference=["4", None])
    [0.0, None]
    """

    version = "1"

    def __call__(self, prompts: list, completions: list, reference: list, **columns) -> list[float | None]:
        return [None if ref is None else float(completion_text(c).strip() == ref.strip())
                for c, ref in zip(completions, reference)]

    def vectorized(self, completions: pa.ChunkedArray, reference: pa.ChunkedArray, **columns) -> pa.ChunkedArray:
        """The same over Arrow string columns (null where the reference is null)."""
        equal = pc.equal(pc.utf8_trim_whitespace(completions), pc.utf8_trim_whitespace(reference))
        return equal.cast(pa.float64())


@register_reward("regex")
class RegexFormat:
    """1.0 when the completion matches `pattern` (Python `re`), else 0.0.

    `mode` is "match" (at the start, as TRL's format rewards), "search" or "fullmatch";
    `flags` is a string of re flag letters ("s" = DOTALL, "m" = MULTILINE, "i" = IGNORECASE).
    The default pattern is TRL's think format: one <think>...</think> block first.

    >>> RegexFormat()(["q"], ["<think>hm</think>42"])
    [1.0]
    >>> RegexFormat(pattern=r"\\d+", mode="fullmatch")(["q", "q"], ["42", "4 2"])
    [1.0, 0.0]
    """

    version = "1"

    def __init__(self, pattern: str = r"^<think>(?!.*<think>)(.*?)</think>.*$", mode: str = "match",
                 flags: str = "sm"):
        if mode not in ("match", "search", "fullmatch"):
            raise ValueError(f"regex reward: mode {mode!r} is not one of match, search, fullmatch")
        bits = 0
        for letter in flags:
            try:
                bits |= {"s": re.DOTALL, "m": re.MULTILINE, "i": re.IGNORECASE, "x": re.VERBOSE,
                         "a": re.ASCII}[letter]
            except KeyError:
                raise ValueError(f"regex reward: unknown flag {letter!r} (use s, m, i, x, a)") from None
        self.pattern, self.mode, self.flags = pattern, mode, flags
        self._compiled = re.compile(pattern, bits)

    def __getstate__(self):
        return {"pattern": self.pattern, "mode": self.mode, "flags": self.flags}

    def __setstate__(self, state):
        self.__init__(**state)

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        test = getattr(self._compiled, self.mode)
        return [float(test(completion_text(c)) is not None) for c in completions]


@register_reward("length_penalty")
class LengthPenalty:
    """-per_token * max(0, L - target_tokens), L = the completion's length in tokens.

    >>> LengthPenalty(target_tokens=2, per_token=0.5)(["q", "q"], ["a", "b"], response_token_ids=[[1], [1, 2, 3, 4]])
    [0.0, -1.0]
    """

    version = "1"

    def __init__(self, target_tokens: int = 0, per_token: float = 0.001):
        self.target_tokens, self.per_token = target_tokens, per_token

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        return [0.0 - self.per_token * max(0, n - self.target_tokens) for n in _token_lengths(columns)]

    def vectorized(self, completions: pa.ChunkedArray, **columns) -> pa.Array:
        lengths = _lengths_array(columns)
        return pa.array(0.0 - self.per_token * np.maximum(0.0, lengths - self.target_tokens))


@register_reward("overlong_penalty")
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L = completion tokens:

        0                               if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        -1                              if L > L_max

    with L_max = `max_tokens`, L_cache = `cache_tokens`.

    >>> f = OverlongPenalty(max_tokens=10, cache_tokens=4)
    >>> f(["q"] * 4, ["a"] * 4, response_token_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11])
    [0.0, -0.5, -1.0, -1.0]
    """

    version = "1"

    def __init__(self, max_tokens: int = 4096, cache_tokens: int = 512):
        if not 0 < cache_tokens <= max_tokens:
            raise ValueError(f"overlong_penalty: need 0 < cache_tokens ({cache_tokens}) <= max_tokens ({max_tokens})")
        self.max_tokens, self.cache_tokens = max_tokens, cache_tokens

    def _penalty(self, lengths: np.ndarray) -> np.ndarray:
        soft = (self.max_tokens - self.cache_tokens - lengths) / self.cache_tokens
        return np.where(lengths > self.max_tokens, -1.0, np.minimum(0.0, soft))

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        lengths = np.array(_token_lengths(columns), dtype=np.float64)
        return [float(x) for x in self._penalty(lengths)]

    def vectorized(self, completions: pa.ChunkedArray, **columns) -> pa.Array:
        return pa.array(self._penalty(_lengths_array(columns)))
