"""An idempotency store that fails or stalls chosen calls, wrapped around a real one.

``FaultyStore(inner).fail("renew", PermissionDenied("no"))`` makes every renewal raise that
error from inside the store call, the way a backend's own failure would surface (so it goes
through the same classification: the caller sees a ``StoreError``); ``probability`` fails a
share of the calls at random; ``stall("release", 10)`` holds calls for 10 s before they go
through; ``heal()`` removes every fault and ends every stall. Calls of one public method
(``claim``, ``renew``, ``complete``, ``release``) and of its ``*_many`` batch form share
their faults.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workerpool.idempotency import ClaimResult, IdempotencyStore
from workerpool.idempotency.base import Mutation, T

METHODS = ("claim", "renew", "complete", "release")


@dataclass
class _Fault:
    error: BaseException | None = None
    probability: float = 1.0
    stall: float = 0.0


class FaultyStore(IdempotencyStore):
    def __init__(
        self,
        inner: IdempotencyStore,
        *,
        seed: int | None = None,
        active: Callable[[], bool] | None = None,
    ) -> None:
        """``active``: faults apply only while it returns True (default: always)."""
        super().__init__(retention=inner.retention, clock=inner._clock)
        self.inner = inner
        self._active = active
        self._faults: dict[str, _Fault] = {}
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._healed = threading.Event()  # ends every stall at once
        self.calls: dict[str, int] = dict.fromkeys(METHODS, 0)
        self.failed: dict[str, int] = dict.fromkeys(METHODS, 0)

    def fail(self, method: str, error: BaseException, *, probability: float = 1.0) -> FaultyStore:
        self._faults[_known(method)] = _Fault(error=error, probability=probability)
        return self

    def stall(self, method: str, seconds: float) -> FaultyStore:
        self._healed.clear()
        self._faults[_known(method)] = _Fault(stall=seconds)
        return self

    def heal(self) -> None:
        self._faults.clear()
        self._healed.set()

    def _inject(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1
            fault = self._faults.get(method)
            if self._active is not None and not self._active():
                fault = None
            fires = fault is not None and self._random.random() < fault.probability
            if fires and fault is not None and fault.error is not None:
                self.failed[method] += 1
        if not fires or fault is None:
            return
        if fault.stall:
            self._healed.wait(fault.stall)
        if fault.error is not None:
            error = fault.error

            def raise_it() -> None:
                raise error

            self.inner._guarded(raise_it)  # classified as the backend's own errors are

    def claim_many(
        self, claims: Sequence[tuple[str, str]], owner: str, ttl: float
    ) -> list[ClaimResult]:
        self._inject("claim")
        return self.inner.claim_many(claims, owner, ttl)

    def renew_many(self, claims: Sequence[tuple[str, str]], owner: str, ttl: float) -> list[bool]:
        self._inject("renew")
        return self.inner.renew_many(claims, owner, ttl)

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        self._inject("complete")
        self.inner.complete_many(completions, owner)

    def release_many(
        self, claims: Sequence[tuple[str, str]], owner: str, *, failed: bool = False
    ) -> None:
        self._inject("release")
        self.inner.release_many(claims, owner, failed=failed)

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        return self.inner._mutate(job_id, mutation)

    def close(self) -> None:
        self.inner.close()


def _known(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown store method {method!r}; one of {', '.join(METHODS)}")
    return method
