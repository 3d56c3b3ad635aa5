"""The worker's side of delayed jobs.

``Delays`` (a middleware, outside the idempotency claim) looks at a message's ``not_before``:
past, the run goes on; ahead, the message is put in the schedule and acked (``Scheduled``), so
it holds no slot, no memory and no delivery while it waits. Without a schedule (the store is
``none``) it rides on its ack deadline instead: deferred until it is due, 600 s a step.

``Firer`` publishes the entries of one topic as they come due: it sleeps until the next one
(learnt from the store with each claim, and from this worker's own additions at once), claims
what is due for a short lease, publishes each message as it was, job id and all (and
``fired_at``: never scheduled again), then removes it. A worker that dies mid-way leaves its
claims to lapse and another fires them; a message published twice runs once (the idempotency
store knows its job id). The store is read again at least every ``reread`` seconds for
entries other workers added and left behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from workerpool import constants as c
from workerpool.constants import MAX_PUBLISH_REQUEST_BYTES
from workerpool.publishing import confirm_all, send
from workerpool.schedule.store import Entry, ScheduleStore
from workerpool.schedule.when import parse_not_before
from workerpool.stores import StoreError
from workerpool.worker.envelope import copy_attributes
from workerpool.worker.failures import publish_request_size
from workerpool.worker.middleware import Middleware
from workerpool.worker.outcome import Deferred, Outcome, Rejected, Scheduled, Unavailable
from workerpool.worker.run import Run

log = logging.getLogger(__name__)

# A claimed entry comes back to any worker after this long if it was not published.
_CLAIM_LEASE = 30.0
# A ``fired_at`` as long as any the firer writes, for the size of a copy before it is fired.
_FIRED_AT_SAMPLE = "2026-01-01T00:00:00.000+00:00"
_BATCH = 100  # entries claimed and published at once
_PUBLISH_TIMEOUT = 30.0


class Firer:
    def __init__(
        self,
        schedule: ScheduleStore,
        topic: str,
        publisher: Any,
        *,
        reread: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._schedule = schedule
        self._topic = topic
        self._publisher = publisher
        self._reread = reread
        self._clock = clock
        self._soonest = float("inf")  # the earliest due time added here since the last claim
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._fire, name="workerpool-firer", daemon=True)
        self._thread.start()

    def expect(self, due: float) -> None:
        """An entry due at ``due`` was added here: wake for it if it is the soonest."""
        with self._lock:
            if due >= self._soonest:
                return
            self._soonest = due
        self._wake.set()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _fire(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._soonest = float("inf")  # what the claim sees, it reports as next
            try:
                due, next_ready = self._schedule.claim_due(
                    self._topic, self._clock(), _CLAIM_LEASE, _BATCH
                )
                if due:
                    self._publish(due)
                    continue  # more may be due; the next claim also says what is next
            except StoreError as exc:
                log.warning("schedule of %s not read (%s); trying again", self._topic, exc)
                next_ready = None
            except Exception:  # a bug: keep firing
                log.exception("firing the schedule of %s failed; trying again", self._topic)
                next_ready = None
            with self._lock:
                wake_at = min(self._soonest, next_ready or float("inf"))
            self._wake.wait(max(0.0, min(wake_at - self._clock(), self._reread)))
            self._wake.clear()

    def _publish(self, entries: list[Entry]) -> None:
        futures = []
        fired_at = datetime.fromtimestamp(self._clock(), UTC).isoformat(timespec="milliseconds")
        for entry in entries:
            attributes = dict(entry.attributes)
            key = attributes.pop(c.ATTR_ORDERING_KEY, "")
            if len(attributes) < c.MAX_ATTRIBUTES:  # (else as it came: see ``Delays.before``)
                attributes[c.ATTR_FIRED_AT] = fired_at
            try:
                future = send(self._publisher, self._topic, entry.data, attributes, key)
            except Exception as exc:  # (a client closed, say): as a failed future, its own
                future = exc  # alone: the entries after it in the claim still go out
            futures.append((self._topic, key, future))
        published = []
        results = confirm_all(self._publisher, futures, _PUBLISH_TIMEOUT)
        for entry, result in zip(entries, results, strict=True):
            if isinstance(result, Exception):  # its claim lapses and it is fired again
                log.warning("delayed job %s not published yet: %s", entry.job_id, result)
            else:
                published.append(entry.job_id)
        if published:
            self._schedule.fired(self._topic, published)


class Delays(Middleware):
    """Holds back a run whose ``not_before`` is ahead (see the module)."""

    def __init__(
        self,
        topic: str,
        schedule: ScheduleStore | None,
        firer: Firer | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._topic = topic
        self._schedule = schedule
        self._firer = firer
        self._clock = clock

    def start(self) -> None:
        if self._firer is not None:
            self._firer.start()

    def before(self, run: Run) -> Outcome | None:
        text = run.job.attributes.get(c.ATTR_NOT_BEFORE)
        if not text:
            return None
        now = self._clock()
        try:
            due = parse_not_before(text, datetime.fromtimestamp(now, UTC))
        except ValueError as exc:
            return Rejected(c.ERR_INVALID_NOT_BEFORE, str(exc))
        wait = due - now
        if wait <= 0:
            return None
        fired = c.ATTR_FIRED_AT in run.job.attributes
        if fired or self._schedule is None or self._firer is None:
            # A copy the schedule fired, due by the firer's clock, meets a worker whose clock
            # is behind it: scheduled again, it could be acked just as the firer removes its
            # entry (nothing left to run), so it rides on its ack deadline until due here.
            return Deferred(f"not before {text}", min(wait, c.MAX_ACK_DEADLINE_SECONDS))
        delivery = run.delivery
        attributes = copy_attributes(delivery)
        if delivery.ordering_key:  # published again with it (``Firer``)
            attributes[c.ATTR_ORDERING_KEY] = delivery.ordering_key
        fired_as = {**attributes, c.ATTR_FIRED_AT: _FIRED_AT_SAMPLE}  # what the firer sends
        if publish_request_size(self._topic, delivery.data, fired_as) > MAX_PUBLISH_REQUEST_BYTES:
            # Its copy, its job id written out, would never be published: refused now, while
            # the message itself can still become its failure record.
            return Rejected(c.ERR_OVERSIZE, "its copy for the schedule, with its job id, is "
                            "larger than a publish request may be")  # fmt: skip
        entry = Entry(self._topic, run.job.job_id, due, delivery.data, attributes)
        try:
            added = self._schedule.add(entry)
        except StoreError as exc:
            return Unavailable(f"schedule: {exc}")
        if not added and wait < _CLAIM_LEASE:
            # Its entry is there already and falls due so soon that it may be being fired:
            # this may be a fired copy with no room left for ``fired_at``, come to a worker
            # whose clock is a little behind the firer's. Acked, it would leave nothing to run
            # once the firer removes the entry; it comes back when due instead (its job id
            # runs once either way).
            return Deferred(f"not before {text}", wait)
        self._firer.expect(due)
        return Scheduled(text)

    def close(self, timeout: float) -> None:
        if self._firer is not None:
            self._firer.stop(timeout)
        if self._schedule is not None:
            self._schedule.close()
