"""The named limiters of a process, behind an interface a shared backend can implement."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

from workerpool.ratelimit.bucket import RateSpec, TokenBucket


class UnknownLimiter(KeyError):
    pass


class RateLimiters(ABC):
    """Backends: ``LocalLimiters`` (per process); a shared one (Redis, Firestore) would hand
    out the same reservations across replicas."""

    @abstractmethod
    def acquire(self, name: str, tokens: float, abort: threading.Event) -> float | None:
        """Wait for ``tokens`` of ``name``; return the seconds waited, or None if ``abort``
        was set first (the reservation is then given back)."""

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

    def acquire(self, name: str, tokens: float, abort: threading.Event) -> float | None:
        bucket = self.bucket(name)
        wait = bucket.reserve(tokens)
        if wait > 0 and abort.wait(wait):
            bucket.refund(tokens)
            return None
        if self._on_wait:
            self._on_wait(name, wait)
        return wait

    def throttled(self, name: str, retry_after: float | None = None) -> None:
        self.bucket(name).throttled(retry_after)

    def names(self) -> list[str]:
        return sorted(self._buckets)
