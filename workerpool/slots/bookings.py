"""Deferred jobs' bookings, written on a thread of their own.

A job that finds its key full is told when to come back from the store's recent copies, and
its message is settled at once; the booking that keeps its place in the key's line follows.
A deferral that waited for that write held its message meanwhile (up to a second on a busy
Firestore document), and a replica whose held messages were all being deferred pulled none
of the jobs whose turn had come. A booking lost with its process costs the job its place,
nothing else: it comes back as a newcomer.
"""

from __future__ import annotations

import logging
import threading

from workerpool.slots.store import Booking, SlotStore
from workerpool.stores import StoreError

log = logging.getLogger(__name__)


class BookingWriter:
    """Writes the bookings put since its last write in one call, on its own thread (started
    with the first booking)."""

    def __init__(self, store: SlotStore) -> None:
        self._store = store
        self._pending: list[tuple[str, str, Booking]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def put(self, key: str, job_id: str, booking: Booking) -> None:
        with self._cond:
            if self._closing:
                return
            self._pending.append((key, job_id, booking))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="workerpool-bookings", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Write what is pending within ``timeout``; what does not make it is dropped."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                batch, self._pending = self._pending, []
            if batch:
                try:
                    self._store.book_many(batch)
                except StoreError as exc:
                    log.warning("%d bookings not written: %s", len(batch), exc)
                except Exception:  # a bug: later bookings must still be written, not pile up
                    log.exception("%d bookings not written", len(batch))
            elif self._closing:
                return
