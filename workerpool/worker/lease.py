"""Keep the messages this worker holds leased, for as long as their job may run.

Every held message (running or waiting for a slot) has its ack deadline pushed to
``extension`` seconds every ``extension / 3`` seconds, until its ``lease_until`` (set from the
job's ``timeout``) passes; then it is left to expire, so a stuck job's message is redelivered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from workerpool import constants as c
from workerpool.worker.delivery import Delivery
from workerpool.worker.interfaces import Acks

log = logging.getLogger(__name__)


class Leaser:
    def __init__(
        self,
        acks: Acks,
        *,
        extension: float = c.DEFAULT_LEASE_EXTENSION,
        granted: float = 0.0,
        on_extend: Callable[[int], None] | None = None,
    ) -> None:
        """``granted``: the subscription's own ack deadline, which a pulled message starts
        with (0: not known)."""
        self._acks = acks
        self.extension = extension
        # The first periodic pass reaches a message within extension / 3 s of its pull. A
        # deadline shorter than twice that (Pub/Sub's default is 10 s) needs an extension at
        # receipt; a longer one does not, which saves a request per pull.
        self._extend_at_receipt = granted < 2 * extension / 3
        self._held: dict[str, Delivery] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._on_extend = on_extend
        self._thread: threading.Thread | None = None
        self.healthy = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workerpool-leaser", daemon=True)
        self._thread.start()

    def add(self, deliveries: list[Delivery]) -> None:
        with self._lock:
            for delivery in deliveries:
                self._held[delivery.ack_id] = delivery
        if self._extend_at_receipt:
            self._acks.extend(deliveries, self.extension)

    def remove(self, delivery: Delivery) -> None:
        with self._lock:
            self._held.pop(delivery.ack_id, None)

    def holding(self) -> list[Delivery]:
        """Held messages whose ack or nack is not queued yet: waiting, running, being
        recorded, or settled a moment ago (their lease is let go once it is queued)."""
        with self._lock:
            return list(self._held.values())

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.extension / 3):
            try:
                self.extend_once()
            except Exception:  # never die: a lapsed lease means a second run elsewhere
                log.exception("lease extension failed; trying again in %.0fs", self.extension / 3)
                self.healthy = False
            else:
                self.healthy = True

    def extend_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [d for d in self._held.values() if d.lease_until <= now]
            for delivery in expired:
                del self._held[delivery.ack_id]
            live = [d for d in self._held.values() if not d.settled]
        for delivery in expired:
            log.warning(
                "message %s passed its lease limit; it will be redelivered", delivery.message_id
            )
        if live:
            self._acks.extend(live, self.extension)
            if self._on_extend:
                self._on_extend(len(live))
