"""A tqdm bar that counts tokens (so it shows tok/s) and keeps the totals for a run's JSON."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class TokenProgress:
    """``with TokenProgress(total, "extract") as p: p.update(n)``; ``p.summary()`` -> tokens, seconds, tok/s."""

    def __init__(self, total: int, desc: str, unit: str = "tok", disable: bool = False):
        tty = sys.stderr.isatty()
        # a log file gets one line every 30 s instead of thousands of carriage-return updates
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr,
                        mininterval=0.5 if tty else 30, dynamic_ncols=tty, disable=disable)
        self.tokens = 0
        self.start = time.perf_counter()

    def update(self, tokens: int, **postfix) -> None:
        self.tokens += tokens
        self.bar.update(tokens)
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def summary(self) -> dict:
        s = self.seconds
        return {"tokens": self.tokens, "seconds": round(s, 3),
                "tokens_per_s": round(self.tokens / s, 1) if s > 0 else 0.0}

    def close(self) -> None:
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
