"""Leases of one process, for tests."""

from __future__ import annotations

import threading

from workerpool.leadership.decisions import Noted, appended, read
from workerpool.leadership.store import LeadershipStore, Lease, claimed, released


class MemoryLeadership(LeadershipStore):
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._decisions: dict[str, str] = {}
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

    def note(self, name: str, noted: Noted) -> None:
        with self._lock:
            self._decisions[name] = appended(self._decisions.get(name), noted)

    def decisions(self, name: str) -> list[Noted]:
        with self._lock:
            return read(self._decisions.get(name))

    def close(self) -> None:
        pass
