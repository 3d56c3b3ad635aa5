"""How much a pool holds and runs (``PoolLimits``), and what its drain did (``DrainReport``)."""

from __future__ import annotations

from dataclasses import dataclass

from workerpool import constants as c


@dataclass(frozen=True)
class PoolLimits:
    max_outstanding: int
    prefetch: int
    max_bytes: int = c.DEFAULT_MAX_HELD_BYTES

    def __post_init__(self) -> None:
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be at least 1, got {self.max_outstanding}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {self.prefetch}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")

    @property
    def max_held(self) -> int:
        return self.max_outstanding + self.prefetch

    @property
    def low_water(self) -> int:
        """This few messages waiting to start: the pool pulls now. What it holds beyond that
        it can spare (completions that wait to share a write, say)."""
        return self.prefetch // 2


@dataclass(frozen=True)
class DrainReport:
    released_waiting: int
    finished: int
    interrupted: int
    seconds: float
