"""How repetitive a generated answer is: the share of its token n-grams that are distinct.

A healthy answer repeats few 8-token sequences (ShareGPT's answers: almost all distinct); a
greedy small model stuck in a loop repeats the same few over and over (issue 17 measured 46 % of
SmolLM2-135M's greedy answers with fewer than half distinct). Token ids rather than words, so the
measure needs no tokenizer and means the same for every language.
"""

from __future__ import annotations


def distinct_ngram_share(tokens: list[int], n: int) -> float:
    """Distinct n-grams / all n-grams of ``tokens``; 1.0 when there are fewer than ``n`` tokens."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 1.0
    return len({tuple(tokens[i:i + n]) for i in range(total)}) / total


def is_loop(tokens: list[int], n: int, min_distinct_share: float) -> bool:
    """True when fewer than ``min_distinct_share`` of the answer's n-grams are distinct."""
    return distinct_ngram_share(tokens, n) < min_distinct_share
