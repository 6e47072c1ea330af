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


def longest_non_loop_prefix(tokens: list[int], n: int, min_distinct_share: float) -> int:
    """The length of the longest prefix of ``tokens`` that is not a loop by ``is_loop``: what comes
    before a loop, and its first repeats as far as the same measure allows."""
    seen: set[tuple[int, ...]] = set()
    best = min(len(tokens), n - 1)  # fewer than n tokens: no n-gram, never a loop
    for end in range(n, len(tokens) + 1):
        seen.add(tuple(tokens[end - n:end]))
        if len(seen) / (end - n + 1) >= min_distinct_share:
            best = end
    return best
