"""In-memory backend: one process only (tests, single-process runs without persistence)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    FAILED_MINUTES_KEPT,
    IdempotencyStore,
    Mutation,
    Record,
    T,
)

_SWEEP_EVERY = 1024  # mutations between purges of expired records


class MemoryStore(IdempotencyStore):
    """A dict behind a lock; expired records are purged every so often so memory stays bounded."""

    def __init__(
        self, *, retention: float = DEFAULT_RETENTION, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(retention=retention, clock=clock)
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self._mutations = 0
        self._failed: Counter[int] = Counter()  # failed runs by minute

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        with self._lock:
            now = self._clock()
            result, change = mutation(self._records.get(job_id), now)
            if change is not None:
                self._records[job_id] = change
            self._mutations += 1
            if self._mutations % _SWEEP_EVERY == 0:
                self._sweep(now)
            return result

    def _sweep(self, now: float) -> None:
        expired = [k for k, r in self._records.items() if r.expire_at(self.retention) <= now]
        for job_id in expired:
            del self._records[job_id]

    def completed_per_minute(self, since: float) -> dict[int, int] | None:
        with self._lock:
            minutes = Counter(
                int(r.completed_at // 60)
                for r in self._records.values()
                if r.completed_at is not None and r.completed_at >= since
            )
        return dict(minutes)

    def _add_failed(self, minute: int, count: int) -> None:
        with self._lock:
            self._failed[minute] += count
            for old in [m for m in self._failed if m <= minute - FAILED_MINUTES_KEPT]:
                del self._failed[old]

    def failed_per_minute(self, since: float) -> dict[int, int] | None:
        with self._lock:
            return {m: n for m, n in self._failed.items() if m * 60 >= since}

    def close(self) -> None:
        pass
