"""Cancels of one process, for tests and the in-process worker."""

from __future__ import annotations

import threading
from collections.abc import Collection

from workerpool.control.store import Cancel, CancelStore


class MemoryCancels(CancelStore):
    def __init__(self, *, retention: float) -> None:
        super().__init__(retention=retention)
        self._cancels: dict[str, Cancel] = {}
        self._lock = threading.Lock()

    def add(self, cancel: Cancel) -> Cancel:
        with self._lock:
            kept = self._cancels.get(cancel.job_id)
            if kept is None or not self.live(kept, cancel.at):
                self._cancels[cancel.job_id] = kept = cancel
            return kept

    def find(self, job_ids: Collection[str], now: float) -> dict[str, Cancel]:
        with self._lock:
            found = (self._cancels.get(job_id) for job_id in job_ids)
            return {c.job_id: c for c in found if c is not None and self.live(c, now)}

    def close(self) -> None:
        pass
