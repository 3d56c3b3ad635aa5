"""A token bucket that hands out reservations, and slows down when told it is throttled.

``reserve(n)`` takes the tokens at once and returns how long the caller must wait: waiters are
given slots ``n / rate`` apart in arrival order instead of polling and racing for each refill.
The slots are times, not a token debt divided by the rate of the moment, so a rate that
changes later (a throttle, then its recovery) never puts a new slot before, or closer than
``n / rate`` to, one already given out. On ``throttled()`` the rate halves (multiplicative
decrease, down to a floor) and then grows back by a tenth of the declared rate per second
(additive increase) until it is the declared rate again.

A slot says when to wake, not that the tokens may be used then: a process that is starved or
stopped wakes its waiters late and together, and the slots that fell due meanwhile would
reach the upstream at once. So ``depart(n)`` is asked at the moment of use and holds the uses
themselves to the rate and burst (the same bucket, over the times requests really leave). A
waiter it holds back is given a turn of its own, after the turns already given, so those
held back after a stall wake one by one, not together; at its turn it asks again, and waits
more only if a use before it went late.
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
        self._rate = spec.rate
        self._floor = spec.rate * floor_fraction
        self._recovery = spec.rate * recovery_fraction  # tokens/s regained per second
        now = clock()
        self._moved = now  # the rate and the credit are brought up to here
        # The credit a waiter may take at once, counted up to `_free`: the slot of the last
        # reservation (or the end of a Retry-After block); none builds up while waiters queue.
        self._tokens = float(spec.burst)
        self._free = now
        # The uses, as the slots are counted but over the times waiters really went: when the
        # next may happen by the rate (less the burst's allowance), and the same counting the
        # turns given to waiters held back as well.
        self._gone = now
        self._promised = now

    @property
    def rate(self) -> float:
        with self._lock:
            self._advance(self._clock())
            return self._rate

    def _rate_after(self, seconds: float) -> float:
        return min(self.spec.rate, self._rate + self._recovery * seconds)

    def _advance(self, now: float) -> None:
        if now <= self._moved:
            return
        if now > self._free:
            # Credit builds up only once the last slot is past, at the average of the (still
            # recovering) rate over that part of the interval.
            idle_from = max(self._free, self._moved)
            average = (
                self._rate_after(idle_from - self._moved) + self._rate_after(now - self._moved)
            ) / 2
            self._tokens = min(float(self.spec.burst), self._tokens + (now - idle_from) * average)
            self._free = now
        self._rate = self._rate_after(now - self._moved)
        self._moved = now

    def _check(self, tokens: float) -> None:
        if tokens > self.spec.burst:
            raise ValueError(
                f"cannot take {tokens} tokens at once from a burst of {self.spec.burst}"
            )

    def reserve(self, tokens: float = 1.0) -> float:
        """Take ``tokens`` now; return the seconds to wait before using them."""
        self._check(tokens)
        with self._lock:
            now = self._clock()
            self._advance(now)
            short = max(0.0, tokens - self._tokens)
            self._tokens = max(0.0, self._tokens - tokens)
            self._free = max(self._free, now) + short / self._rate
            return self._free - now

    def depart(self, tokens: float = 1.0, *, again: bool = False) -> float:
        """A waiter whose slot came is about to use ``tokens``: 0.0 if the uses so far allow
        it now (it is counted as used), else the seconds to wait before asking ``again``."""
        self._check(tokens)
        with self._lock:
            now = self._clock()
            self._advance(now)
            step, allowance = tokens / self._rate, (self.spec.burst - tokens) / self._rate
            # A waiter asking again holds a turn already: only a late use can hold it back.
            after = self._gone if again else max(self._gone, self._promised)
            if now >= after - allowance:
                self._gone = max(self._gone, now) + step
                if not again:
                    self._promised = max(self._promised, now) + step
                return 0.0
            if not again:
                self._promised = after + step
            return after - allowance - now

    def refund(self, tokens: float = 1.0) -> None:
        """Give back a reservation that was not used (the waiter gave up)."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            if self._free > now:
                # Its slot is somewhere in the queue: the queue is that much shorter.
                self._free = max(now, self._free - tokens / self._rate)
            else:
                self._tokens = min(self._tokens + tokens, float(self.spec.burst))

    def throttled(self, retry_after: float | None = None) -> None:
        """The upstream said "too many requests": halve the rate; honour ``Retry-After``."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            self._rate = max(self._floor, self._rate / 2)
            # The bucket is empty now, or when Retry-After ends: waiters are then released one
            # by one at the new rate, not all at once; those whose slots come sooner wait too.
            empty = now + (retry_after or 0.0)
            self._tokens = 0.0
            self._free = max(self._free, empty)
            self._gone = max(self._gone, empty + self.spec.burst / self._rate)
