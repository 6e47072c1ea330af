"""How repetitive a generated answer is: the share of its token n-grams that are distinct.

A healthy answer repeats few 8-token sequences (ShareGPT's answers: almost all distinct); a
greedy small model stuck in a loop repeats the same few over and over (issue 17 measured 46 % of
SmolLM2-135M's greedy answers with fewer than half distinct). Token ids rather than words, so the
measure needs no tokenizer and means the same for every language.
"""

from __future__ import annotations


class DistinctNgrams:
    """A growing token sequence and its distinct n-grams, so its share costs only the tokens added
    (an unfinished answer judged as it is generated, a loop's prefixes)."""

    def __init__(self, n: int):
        self.n, self.tokens, self.seen = n, [], set()

    def add(self, new) -> None:
        before = len(self.tokens)
        self.tokens += new
        for end in range(max(before + 1, self.n), len(self.tokens) + 1):
            self.seen.add(tuple(self.tokens[end - self.n:end]))

    def share(self) -> float:
        """Distinct n-grams / all n-grams so far; 1.0 with fewer than n tokens."""
        total = len(self.tokens) - self.n + 1
        return 1.0 if total <= 0 else len(self.seen) / total


def distinct_ngram_share(tokens: list[int], n: int) -> float:
    """Distinct n-grams / all n-grams of ``tokens``; 1.0 when there are fewer than ``n`` tokens."""
    grams = DistinctNgrams(n)
    grams.add(tokens)
    return grams.share()


def is_loop(tokens: list[int], n: int, min_distinct_share: float) -> bool:
    """True when fewer than ``min_distinct_share`` of the answer's n-grams are distinct."""
    return distinct_ngram_share(tokens, n) < min_distinct_share


def longest_non_loop_prefix(tokens: list[int], n: int, min_distinct_share: float) -> int:
    """The length of the longest prefix of ``tokens`` that is not a loop by ``is_loop``: what comes
    before a loop, and its first repeats as far as the same measure allows."""
    prefix, best = DistinctNgrams(n), 0
    for end, token in enumerate(tokens, 1):
        prefix.add([token])
        if prefix.share() >= min_distinct_share:  # fewer than n tokens: no n-gram, never a loop
            best = end
    return best
