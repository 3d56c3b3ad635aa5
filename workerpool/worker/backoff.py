"""Exponential backoff with jitter, so retries of many jobs never arrive in lock-step."""

from __future__ import annotations

import random
from dataclasses import dataclass

from workerpool import constants as c


@dataclass(frozen=True)
class Backoff:
    minimum: float = c.DEFAULT_MIN_BACKOFF
    maximum: float = c.DEFAULT_MAX_BACKOFF
    factor: float = 2.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Delay before delivery ``attempt + 1``: grows by ``factor`` per attempt, within
        [minimum, maximum], drawn from the upper half of the step ("equal jitter") so gaps
        still grow while spreading retries apart."""
        ceiling = min(self.maximum, self.minimum * self.factor ** max(0, attempt - 1))
        draw = (rng or random).uniform(0.5, 1.0)
        return max(self.minimum, min(self.maximum, ceiling * draw))
