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
themselves to the rate and burst (the same bucket, over the times requests really leave).
A waiter it holds back is given a time of use of its own, after those already given, and
goes then without asking again: held-back waiters that learned only how long the last use
left them to wait all woke for every use, and all but one waited again (measured: 25 waits
and 0.7 ms of CPU per token for 100 threads at 2,000/s). A thread of a busy process often
wakes a little late; one late by up to ``_LATE`` (or half a token's time) still goes, so uses
may come that much closer together than the rate. One later still (a stall, or an event loop
or a GIL too busy to wake it in time) goes if the uses so far leave room; else it waits until
the last use leaves some, and asks again (the first such waiter back then goes). It is not
given a new time after all those given: waiters so placed behind times nobody used kept a
third of the rate when every wake was late (a simulation, 1,000/s). Unused times still delay
new waiters, a token's time each, until the bucket is idle. A waiter that lost its time
loses every tie to one that kept its own, so under mixed lateness a few wait longer.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute)\s*(?::\s*(\d+))?\s*$")
_LATE = 0.002  # seconds a waiter may wake after its time of use and still go (see depart)
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


@dataclass(frozen=True, slots=True)
class Turn:
    """What a waiter held back by ``TokenBucket.depart`` passes back when it asks again."""

    at: float  # when to ask
    throttles: int  # the bucket's count of throttles when it was given
    given: bool = True  # a time of use counted for it; else only when the room comes


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
        # The uses, as the slots are counted but over the times waiters really go: when the
        # next may happen by the rate (less the burst's allowance); and the same, counting the
        # times given to waiters held back as well.
        self._went = now
        self._given = now
        self._throttles = 0  # a time given before the last throttle is not kept

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

    def depart(self, tokens: float = 1.0, *, turn: Turn | None = None) -> tuple[float, Turn | None]:
        """A waiter whose slot came is about to use ``tokens``: ``(0.0, None)`` if it may now
        (they are counted as used), else the seconds to wait and what to pass back as
        ``turn`` when it asks again then. A time of use given to it is kept if it asks no
        more than ``_LATE`` or half a token's time after it, and no throttle came between."""
        self._check(tokens)
        with self._lock:
            now = self._clock()
            self._advance(now)
            step = tokens / self._rate
            allowance = (self.spec.burst - tokens) / self._rate
            if turn is not None and turn.given and turn.throttles == self._throttles:
                if now < turn.at:
                    return turn.at - now, turn  # woken early
                # Kept if it is not late, and no late waiter took its room meanwhile (one that
                # lost its time goes when the real uses leave room, and counts no time given).
                late = max(step / 2, _LATE)
                if now - turn.at <= late and now >= self._went - allowance - late:
                    return self._go(now, step)
            if now >= max(self._went, self._given) - allowance:
                self._given = max(self._given, now) + step
                return self._go(now, step)
            if turn is not None:  # late for the time it was given, or woken for the room
                if now >= self._went - allowance:
                    return self._go(now, step)
                room = self._went - allowance
                return room - now, Turn(room, self._throttles, given=False)
            at = max(now, self._given - allowance, self._went - allowance)
            self._given = max(self._given, at) + step
            return at - now, Turn(at, self._throttles)

    def _go(self, now: float, step: float) -> tuple[float, None]:
        self._went = max(self._went, now) + step
        return 0.0, None

    def refund(self, tokens: float = 1.0) -> None:
        """Give back a reservation that was not used (the waiter gave up). A time of use
        ``depart`` gave it is not given back: new waiters come a token's time later."""
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
            self._went = max(self._went, empty + self.spec.burst / self._rate)
            self._given = max(self._given, self._went)
            self._throttles += 1
