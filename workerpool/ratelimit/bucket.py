"""A token bucket that hands out reservations, and slows down when told it is throttled.

``reserve(n)`` takes the tokens at once, going into debt if needed, and returns how long the
caller must wait: waiters are spaced exactly ``1 / rate`` apart in arrival order instead of
polling and racing for each refill. On ``throttled()`` the rate halves (multiplicative
decrease, down to a floor) and then grows back by a tenth of the declared rate per second
(additive increase) until it is the declared rate again.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute)\s*(?::\s*(\d+))?\s*$")
_PER_SECOND = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 1 / 60, "min": 1 / 60, "minute": 1 / 60}


@dataclass(frozen=True)
class RateSpec:
    rate: float  # tokens per second
    burst: int = 1

    def __str__(self) -> str:
        return f"{self.rate:g}/s:{self.burst}"


def parse_rate(text: str) -> RateSpec:
    """``"20/s"``, ``"20/s:5"`` (burst 5), ``"600/min"``; ValueError otherwise."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"rate {text!r} is not RATE/s[:BURST] (e.g. 20/s:5)")
    rate = float(match.group(1)) * _PER_SECOND[match.group(2)]
    burst = int(match.group(3) or 1)
    if rate <= 0 or burst < 1:
        raise ValueError(f"rate {text!r} needs a positive rate and a burst of at least 1")
    return RateSpec(rate, burst)


class TokenBucket:
    def __init__(
        self,
        spec: RateSpec,
        *,
        clock: Callable[[], float] = time.monotonic,
        floor_fraction: float = 0.05,
        recovery_fraction: float = 0.1,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = float(spec.burst)
        self._rate = spec.rate
        self._floor = spec.rate * floor_fraction
        self._recovery = spec.rate * recovery_fraction  # tokens/s regained per second
        self._last = clock()

    @property
    def rate(self) -> float:
        with self._lock:
            self._advance(self._clock())
            return self._rate

    def _advance(self, now: float) -> None:
        elapsed = max(0.0, now - self._last)
        if self._rate < self.spec.rate:
            # Refill at the average of the old and the recovered rate over the interval.
            recovered = min(self.spec.rate, self._rate + self._recovery * elapsed)
            self._tokens += elapsed * (self._rate + recovered) / 2
            self._rate = recovered
        else:
            self._tokens += elapsed * self._rate
        self._tokens = min(self._tokens, float(self.spec.burst))
        self._last = max(self._last, now)  # never back into a Retry-After block

    def reserve(self, tokens: float = 1.0) -> float:
        """Take ``tokens`` now; return the seconds to wait before using them."""
        if tokens > self.spec.burst:
            raise ValueError(
                f"cannot take {tokens} tokens at once from a burst of {self.spec.burst}"
            )
        with self._lock:
            now = self._clock()
            self._advance(now)
            self._tokens -= tokens
            blocked = max(0.0, self._last - now)
            return blocked + (0.0 if self._tokens >= 0 else -self._tokens / self._rate)

    def refund(self, tokens: float = 1.0) -> None:
        """Give back a reservation that was not used (the waiter gave up)."""
        with self._lock:
            self._tokens = min(self._tokens + tokens, float(self.spec.burst))

    def throttled(self, retry_after: float | None = None) -> None:
        """The upstream said "too many requests": halve the rate; honour ``Retry-After``."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            self._rate = max(self._floor, self._rate / 2)
            self._tokens = min(self._tokens, 0.0)
            if retry_after:
                # The bucket's clock resumes after Retry-After: waiters are then released one
                # by one at the new rate, not all at once when it ends.
                self._last = max(self._last, now + retry_after)
