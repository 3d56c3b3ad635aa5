"""Checkpoints and progress of one process's runs, for tests and the in-process worker."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from workerpool.progress.store import FORGET_AFTER, JobStateStore, Report


class MemoryJobState(JobStateStore):
    def __init__(self) -> None:
        self._checkpoints: dict[str, str] = {}
        self._reports: dict[str, Report] = {}
        self._lock = threading.Lock()

    def save(self, job_id: str, state: str, at: float) -> None:
        with self._lock:
            self._checkpoints[job_id] = state

    def load(self, job_id: str) -> str | None:
        with self._lock:
            return self._checkpoints.get(job_id)

    def load_many(self, job_ids: Sequence[str]) -> dict[str, str]:
        with self._lock:
            return {j: self._checkpoints[j] for j in job_ids if j in self._checkpoints}

    def forget(self, job_ids: Sequence[str]) -> None:
        with self._lock:
            for job_id in job_ids:
                self._checkpoints.pop(job_id, None)

    def report(self, reports: Sequence[Report]) -> None:
        with self._lock:
            self._reports.update((r.key, r) for r in reports)

    def ended(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._reports.pop(key, None)

    def running(self, now: float) -> list[Report]:
        with self._lock:
            for report in [r for r in self._reports.values() if r.until < now - FORGET_AFTER]:
                del self._reports[report.key]
            live = [r for r in self._reports.values() if r.until > now]
        return sorted(live, key=lambda r: (r.started, r.key))

    def close(self) -> None:
        pass
