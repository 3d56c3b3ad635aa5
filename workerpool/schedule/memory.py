"""The schedule of one process, for tests and the in-process worker."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from workerpool.schedule.store import Entry, ScheduleStore


class MemorySchedule(ScheduleStore):
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[Entry, float]] = {}  # entry, ready_at
        self._lock = threading.Lock()

    def add(self, entry: Entry) -> bool:
        with self._lock:
            if (entry.topic, entry.job_id) in self._entries:
                return False
            self._entries[entry.topic, entry.job_id] = (entry, entry.due)
            return True

    def claim_due(
        self, topic: str, now: float, lease: float, limit: int
    ) -> tuple[list[Entry], float | None]:
        with self._lock:
            ready = sorted(
                (ready_at, entry.job_id)
                for (t, _), (entry, ready_at) in self._entries.items()
                if t == topic and ready_at <= now
            )[:limit]
            claimed = []
            for _, job_id in ready:
                entry, _ = self._entries[topic, job_id]
                self._entries[topic, job_id] = (entry, now + lease)
                claimed.append(entry)
            rest = [r for (t, _), (_, r) in self._entries.items() if t == topic]
            return claimed, min(rest, default=None)

    def fired(self, topic: str, job_ids: Sequence[str]) -> None:
        with self._lock:
            for job_id in job_ids:
                self._entries.pop((topic, job_id), None)

    def entries(self, topic: str | None = None, limit: int = 100) -> list[Entry]:
        with self._lock:
            chosen = [e for e, _ in self._entries.values() if topic is None or e.topic == topic]
        return sorted(chosen, key=lambda e: (e.due, e.job_id))[:limit]

    def close(self) -> None:
        pass
