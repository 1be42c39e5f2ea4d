"""Retry delays: exponential backoff with a cap and jitter (pure code).

For retry ``n`` (1 for the first retry) the ceiling is ``min(cap, base * 2 ** (n - 1))``;
``full`` jitter draws uniformly from ``[0, ceiling]``, ``equal`` jitter from
``[ceiling / 2, ceiling]`` and ``none`` uses the ceiling itself.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class Jitter(enum.StrEnum):
    FULL = "full"
    EQUAL = "equal"
    NONE = "none"


@dataclass(frozen=True)
class Backoff:
    base: float = 1.0
    cap: float = 60.0
    jitter: Jitter = Jitter.FULL

    def to_spec(self) -> dict[str, object]:
        """The JSON form stored with a task and in specs (``{"base", "cap", "jitter"}``)."""
        return {"base": self.base, "cap": self.cap, "jitter": self.jitter.value}

    def ceiling(self, retry: int) -> float:
        # min() before the power would overflow for large retry numbers
        exp = min(retry - 1, 62)
        return float(min(self.cap, self.base * (2**exp)))

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (>= 1)."""
        if retry < 1:
            raise ValueError("retry numbers start at 1")
        ceiling = self.ceiling(retry)
        draw = (rng or random).random()
        if self.jitter is Jitter.FULL:
            return draw * ceiling
        if self.jitter is Jitter.EQUAL:
            return ceiling / 2 + draw * ceiling / 2
        return ceiling
