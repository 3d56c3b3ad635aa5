"""Leases of one process, for tests."""

from __future__ import annotations

import threading

from workerpool.leadership.store import LeadershipStore, Lease, claimed, released


class MemoryLeadership(LeadershipStore):
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def claim(self, name: str, holder: str, now: float, ttl: float) -> Lease:
        with self._lock:
            lease, changed = claimed(self._leases.get(name), holder, now, ttl)
            if changed:
                self._leases[name] = lease
            return lease

    def release(self, name: str, holder: str) -> None:
        with self._lock:
            lease = released(self._leases.get(name), holder)
            if lease is not None:
                self._leases[name] = lease

    def close(self) -> None:
        pass
