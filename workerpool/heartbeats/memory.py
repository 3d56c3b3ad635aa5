"""Heartbeats of one process's replicas, for tests and the in-process worker."""

from __future__ import annotations

import threading

from workerpool.heartbeats.store import FORGET_AFTER, Beat, HeartbeatStore


class MemoryHeartbeats(HeartbeatStore):
    def __init__(self) -> None:
        self._beats: dict[str, Beat] = {}
        self._lock = threading.Lock()

    def beat(self, beat: Beat) -> None:
        with self._lock:
            self._beats[beat.replica] = beat

    def gone(self, replica: str) -> None:
        with self._lock:
            self._beats.pop(replica, None)

    def live(self, subscription: str, now: float) -> list[Beat]:
        with self._lock:
            for beat in [b for b in self._beats.values() if b.until < now - FORGET_AFTER]:
                del self._beats[beat.replica]
            beats = sorted(self._beats.values(), key=lambda b: b.replica)
        return [b for b in beats if b.subscription == subscription and b.until > now]

    def close(self) -> None:
        pass
