"""The thread that writes the progress of every run of a pool to the store, about once a
second, and deletes the checkpoints of jobs that finished.

A run's ``ctx.progress`` only keeps its numbers; this thread writes those that changed (or
were not rewritten for a while, so that they do not lapse) in one call, and removes those of
runs that ended, so a loop may report on every step. A run shorter than a flush is never
written. Like the heartbeat it is not on the data path: a store that fails is logged once per
outage and costs the jobs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from workerpool.progress.handle import RunHandle
from workerpool.progress.store import JobStateStore, Report
from workerpool.stores import StoreError

log = logging.getLogger(__name__)

# A record not rewritten this long lapses (its replica died); one is rewritten, changed or
# not, once it is REFRESH old.
LAPSE = 30.0
REFRESH = 10.0


class ProgressWriter:
    def __init__(
        self,
        store: JobStateStore,
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, RunHandle] = {}
        self._written: dict[str, tuple[int, float]] = {}  # key: (reports seen, when written)
        self._ended: list[str] = []  # written, to remove
        self._forget: list[str] = []  # job ids whose checkpoints to delete
        self._stop = threading.Event()
        self._failing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workerpool-progress", daemon=True)
        self._thread.start()

    def started(self, handle: RunHandle) -> None:
        with self._lock:
            self._live[handle.key] = handle

    def ended(self, handle: RunHandle) -> None:
        with self._lock:
            if self._live.get(handle.key) is handle:
                del self._live[handle.key]
            if self._written.pop(handle.key, None) is not None:
                self._ended.append(handle.key)

    def forget(self, job_id: str) -> None:
        """The job finished: delete its checkpoint at the next flush."""
        with self._lock:
            self._forget.append(job_id)

    def close(self, timeout: float) -> None:
        """Stop, after a last flush (runs ended, checkpoints to delete), within ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.flush()
        finally:
            self._store.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:  # a bug, not an outage (flush keeps those): write on
                log.exception("progress not written")

    def flush(self) -> None:
        """Write what changed since the last flush, in one call of each kind."""
        now = self._clock()
        with self._lock:
            due = [handle for handle in self._live.values() if self._due(handle, now)]
            for handle in due:
                self._written[handle.key] = (handle.changed, now)
            reports = [_report(handle, now) for handle in due]
            ended, self._ended = self._ended, []
            forget, self._forget = self._forget, []
        try:
            if reports:
                self._store.report(reports)
            if ended:
                self._store.ended(ended)
            if forget:
                self._store.forget(forget)
        except StoreError as exc:
            if not self._failing:
                log.warning("progress not written (%s); trying again every second", exc)
            self._failing = True
            with self._lock:  # the next flush tries these again
                self._ended.extend(ended)
                self._forget.extend(forget)
                for report in reports:
                    self._written.pop(report.key, None)
            return
        if self._failing:
            log.info("progress written again")
        self._failing = False

    def _due(self, handle: RunHandle, now: float) -> bool:
        written = self._written.get(handle.key)
        return written is None or written[0] != handle.changed or now - written[1] >= REFRESH


def _report(handle: RunHandle, now: float) -> Report:
    done, total, note = handle.progress
    return Report(
        key=handle.key,
        job=handle.job,
        job_id=handle.job_id,
        replica=handle.replica,
        started=handle.started,
        done=done,
        total=total,
        note=note,
        at=now,
        until=now + LAPSE,
    )
