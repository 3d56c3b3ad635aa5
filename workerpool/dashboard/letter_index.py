"""The Dead letters page's index of the dead-letter subscription: the records one read of it
found, sorted by failure time, that every view, page and filter is cut from.

Pub/Sub pull cannot seek, count or sort, so knowing which records come after a page's last one
means reading the subscription through (10,000 records: about two seconds on the emulator). The
index reads it once, and again only when a view finds it older than ``FRESH`` seconds: that view
is served from the index as it is while the read runs in the background. Before the first read
ends a view waits at most ``FIRST_WAIT`` seconds for it, and is otherwise told the subscription
is being read (the page says so and reloads itself): no view waits for a whole read.

Replay and delete act on the subscription itself (they pull, and ack what they replayed or
deleted); the index then forgets those records at once, so the page never offers a record the
dashboard already took. Reads and actions take turns: a read holds every record it pulled
until it ends, and an action running beside it would not find them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from workerpool.ops.dlq import FailureRecord

log = logging.getLogger(__name__)

# How old the index may be before a view has it read again (in the background).
FRESH = 10.0
# How long a view waits for the first read before it is told the subscription is being read.
FIRST_WAIT = 0.5


@dataclass(frozen=True)
class Snapshot:
    """What one read of the subscription found: ``records`` sorted by ``key``; ``complete``
    False when the read stopped at its limit; ``at``: when it was read (``time.time``)."""

    records: list[FailureRecord]
    complete: bool
    at: float


def key(record: FailureRecord) -> tuple[str, str]:
    """The order records are shown in: their failure time, then their message id."""
    return record.failed_at, record.message_id


class LetterIndex:
    """The latest ``Snapshot`` of the records ``read`` returns (at most ``limit``: more means
    the read was cut short), read again in the background once older than ``fresh`` seconds;
    before the first read ends, a view waits up to ``first_wait`` seconds for it."""

    def __init__(
        self,
        read: Callable[[], list[FailureRecord]],
        limit: int,
        *,
        fresh: float = FRESH,
        first_wait: float = FIRST_WAIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._limit = limit
        self._fresh = fresh
        self._first_wait = first_wait
        self._clock = clock
        self._state = threading.Lock()  # guards the fields below
        self._ended = threading.Condition(self._state)  # notified as each read ends
        self._snapshot: Snapshot | None = None
        self._read_when = 0.0  # clock() of the snapshot's read
        self._reading = False  # a background read is under way
        self._failure: Exception | None = None  # why the last read failed, if it did
        # Held by a read and by an action on the subscription: they take turns.
        self._pulling = threading.Lock()

    def snapshot(self) -> Snapshot | None:
        """The index as it is; a stale one starts a read in the background (its errors are
        logged, the index kept as it was). Before the first read ends: that read's snapshot if
        it ends within ``first_wait`` seconds, else None (it goes on in the background), and
        if it failed, its error."""
        with self._state:
            if self._stale():
                self._start()
            if self._snapshot is None:
                self._ended.wait_for(lambda: not self._reading, self._first_wait)
            snapshot, failure = self._snapshot, self._failure
        if snapshot is None and failure is not None:
            raise failure
        return snapshot

    def warm(self) -> None:
        """Start the first read in the background (the dashboard starting): a first view then
        finds it under way, or done."""
        with self._state:
            if self._snapshot is None:
                self._start()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a read under way to end (it gives back what it
        holds), as the dashboard stops: before its Pub/Sub clients close. False if it has not."""
        if not self._pulling.acquire(timeout=timeout):
            return False
        self._pulling.release()
        return True

    def _stale(self) -> bool:
        return self._snapshot is None or self._clock() - self._read_when > self._fresh

    def _start(self) -> None:
        """A read in the background, unless one is under way (the caller holds ``_state``)."""
        if not self._reading:
            self._reading, self._failure = True, None
            thread = threading.Thread(target=self._refresh, name="dashboard-letters", daemon=True)
            thread.start()

    @contextlib.contextmanager
    def acting(self) -> Iterator[Callable[[set[str]], None]]:
        """Hold off reads while an action pulls the subscription; it calls what it gets with
        the message ids it took off the subscription, which the index forgets."""
        with self._pulling:
            yield self._forget

    def _forget(self, message_ids: set[str]) -> None:
        with self._state:
            if self._snapshot is not None and message_ids:
                old = self._snapshot
                kept = [r for r in old.records if r.message_id not in message_ids]
                self._snapshot = Snapshot(kept, old.complete, old.at)

    def _refresh(self) -> None:
        failure: Exception | None = None
        try:
            with self._pulling:
                with self._state:
                    stale = self._stale()  # else another read ended while this one waited
                if stale:
                    began = self._clock()
                    records = sorted(self._read(), key=key)
                    snapshot = Snapshot(records, len(records) < self._limit, time.time())
                    with self._state:
                        self._snapshot, self._read_when = snapshot, began
        except Exception as exc:  # the page shows the last read, or this error; a view retries
            log.exception("dashboard: reading the dead letters failed")
            failure = exc
        finally:
            with self._state:
                self._reading, self._failure = False, failure
                self._ended.notify_all()
