"""The named limiters of a process, behind an interface a shared backend can implement."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from workerpool.ratelimit.bucket import RateSpec, TokenBucket, Turn

if TYPE_CHECKING:
    from workerpool.flag import Flag


class UnknownLimiter(KeyError):
    pass


class RateLimiters(ABC):
    """Backends: ``LocalLimiters`` (per process); a shared one (Redis, Firestore) would hand
    out the same reservations across replicas."""

    @abstractmethod
    def reserve(self, name: str, tokens: float) -> float:
        """Take ``tokens`` of ``name`` now; return the seconds to wait before using them."""

    @abstractmethod
    def depart(self, name: str, tokens: float, turn: Turn | None) -> tuple[float, Turn | None]:
        """A waiter's slot for ``tokens`` of ``name`` came: ``(0.0, None)`` if they may be used
        now (they are counted as used), else the seconds to wait and what it passes back as
        ``turn`` when it asks again then (see ``TokenBucket.depart``)."""

    @abstractmethod
    def refund(self, name: str, tokens: float) -> None:
        """Give back a reservation its waiter did not use."""

    def waited(self, name: str, seconds: float) -> None:  # noqa: B027 - a hook, may do nothing
        """A waiter got its tokens of ``name`` after ``seconds``."""

    def acquire(self, name: str, tokens: float, abort: Flag | threading.Event) -> float | None:
        """Wait for ``tokens`` of ``name``; return the seconds waited, or None if ``abort``
        was set first (the reservation is then given back)."""
        waited = 0.0
        for wait in self._waits(name, tokens):
            if abort.wait(wait):
                self.refund(name, tokens)
                return None
            waited += wait
        self.waited(name, waited)
        return waited

    async def acquire_async(self, name: str, tokens: float, abort: Flag) -> float | None:
        """``acquire`` for a coroutine: waits without blocking its event loop."""
        waited = 0.0
        for wait in self._waits(name, tokens):
            if await abort.until(wait):
                self.refund(name, tokens)
                return None
            waited += wait
        self.waited(name, waited)
        return waited

    def _waits(self, name: str, tokens: float) -> Iterator[float]:
        """The waits before ``tokens`` of ``name`` may be used: the reservation's, then, if
        the waiter woke too soon after another use (its process was starved or stopped, and
        overdue waiters woke together), the waits for the time of use it is given, or for
        the room the uses so far leave."""
        wait, turn = self.reserve(name, tokens), None
        while True:
            if wait > 0:
                yield wait
            wait, turn = self.depart(name, tokens, turn)
            if wait <= 0:
                return

    @abstractmethod
    def throttled(self, name: str, retry_after: float | None = None) -> None:
        """The upstream behind ``name`` answered "too many requests"."""

    @abstractmethod
    def names(self) -> list[str]: ...


class LocalLimiters(RateLimiters):
    def __init__(
        self,
        specs: Mapping[str, RateSpec],
        *,
        on_wait: Callable[[str, float], None] | None = None,
    ) -> None:
        self._buckets = {name: TokenBucket(spec) for name, spec in specs.items()}
        self._on_wait = on_wait

    def bucket(self, name: str) -> TokenBucket:
        try:
            return self._buckets[name]
        except KeyError:
            raise UnknownLimiter(f"no rate limit named {name!r} is declared") from None

    def reserve(self, name: str, tokens: float) -> float:
        return self.bucket(name).reserve(tokens)

    def depart(self, name: str, tokens: float, turn: Turn | None) -> tuple[float, Turn | None]:
        return self.bucket(name).depart(tokens, turn=turn)

    def refund(self, name: str, tokens: float) -> None:
        self.bucket(name).refund(tokens)

    def waited(self, name: str, seconds: float) -> None:
        if self._on_wait:
            self._on_wait(name, seconds)

    def throttled(self, name: str, retry_after: float | None = None) -> None:
        self.bucket(name).throttled(retry_after)

    def names(self) -> list[str]:
        return sorted(self._buckets)
