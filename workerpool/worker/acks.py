"""Batch acknowledge / modify_ack_deadline requests on two threads.

Handlers finish on many threads; sending one RPC per message caps throughput, so requests
queue here and go out in batches. ``flush`` is what drain waits on to be sure every outcome
reached Pub/Sub before the process exits.

An ack waits up to ``ack_window`` (50 ms) for others to share its request. A request costs
the worker about 0.4 ms of CPU whatever it carries: with the 10 ms that changes of deadlines
wait, acks took 5-7 us of CPU a no-op job at N = 100, against 2 with 50 ms (measured). A
queued ack holds no slot and no room for a pull: its message left the pool's count when it
was settled (only Pub/Sub counts it leased meanwhile), and its lease has seconds left. Where
a late ack would cost something, the wait is shorter: an exactly-once ack's run waits for its
answer, so it goes at once; on an ordered subscription Pub/Sub may hold a key's later
messages until those before are acked, so its acks wait 10 ms. ``flush`` ends every wait at
once.

Acks go out on one thread, and every change of an ack deadline (lease extensions, nacks,
deferrals) in order on another: behind an ack request that retries its timeouts (four of
10 s), extensions waited 41 s, and leases of 30 s lapsed under running jobs (measured with a
client whose acknowledge hung). A nack is sent after any extension queued before it, and an
extension of a message settled meanwhile is dropped, so an extension never undoes a nack.

On an exactly-once subscription an ack can fail (the ack id expired, the message went to
another worker); ``ack(confirm=True)`` returns a future that says whether it took.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

from google.api_core import exceptions as gexc

from workerpool import constants as c
from workerpool.worker.delivery import Delivery
from workerpool.worker.rpc import subscriber_rpc

log = logging.getLogger(__name__)

_MAX_IDS_PER_REQUEST = 1000
_CALL_TIMEOUT = 10.0
_ATTEMPTS = 4
_TRANSIENT = (
    gexc.ServiceUnavailable,
    gexc.DeadlineExceeded,
    gexc.InternalServerError,
    gexc.Aborted,
)

# A request key: ("ack", 0), ("modack", seconds) or ("extend", seconds).
_Key = tuple[str, int]
# A queued request: its key, the ack id; for lease extensions the delivery, so a message
# settled while its extension waited in the queue is not re-leased after its nack; and for a
# confirmed ack the future that receives the result.
_Item = tuple[_Key, str, Delivery | None, "Future[bool] | None"]
_Entry = tuple[str, "Future[bool] | None"]

_EXACTLY_ONCE_FAILURE = "EXACTLY_ONCE_ACKID_FAILURE"


ACK_WINDOW = 0.05  # seconds an ack waits for others to share its request
ORDERED_ACK_WINDOW = 0.01  # the same on an ordered subscription
_INTERVAL = 0.01  # the same for a change of ack deadlines


class Acknowledger:
    def __init__(
        self,
        client: Any,
        subscription: str,
        *,
        interval: float = _INTERVAL,
        ack_window: float = ACK_WINDOW,
    ) -> None:
        """``interval``: how long a change of ack deadlines waits for others to join its
        request; ``ack_window``: the same for an ack."""
        # Never retried by the client: _send_with_retries owns retries, bounded so a drain
        # can flush.
        self._rpc = subscriber_rpc(client, subscription)
        self.ack_window = ack_window
        self._interval = interval
        # Set to end the waits at once: by a flush, and (acks only) by an ack whose answer is
        # awaited.
        self._hurry_acks = threading.Event()
        self._hurry_leases = threading.Event()
        self._acks: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._deadlines: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        # False while requests fail (Pub/Sub unreachable, a bug here): /healthz turns 503.
        # (The last request's, on either thread: a thread that has nothing to send leaves
        # it as the other finds it.)
        self.healthy = True

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._run, args=(q, window, hurry), name=name, daemon=True)
            for q, name, window, hurry in (
                (self._acks, "workerpool-acks", self.ack_window, self._hurry_acks),
                (self._deadlines, "workerpool-leases", self._interval, self._hurry_leases),
            )
        ]
        for thread in self._threads:
            thread.start()

    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        """Queue an ack; with ``confirm``, return a future: True once Pub/Sub accepted it."""
        future: Future[bool] | None = Future() if confirm else None
        self._put([(("ack", 0), ack_id, None, future)], self._acks)
        if confirm:
            self._hurry_acks.set()  # after the put: the batch it ends takes this ack
        return future

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        """Set the ack deadline of ``ack_ids``; 0 releases them for immediate redelivery."""
        key = ("modack", _deadline(seconds))
        self._put([(key, ack_id, None, None) for ack_id in ack_ids], self._deadlines)

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        """Extend leases, skipping at send time any delivery settled meanwhile."""
        key = ("extend", _deadline(seconds))
        self._put([(key, d.ack_id, d, None) for d in deliveries], self._deadlines)

    def _put(self, items: list[_Item], to: queue.SimpleQueue[_Item | None]) -> None:
        with self._idle:
            self._pending += len(items)
        for item in items:
            to.put(item)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued request has been sent (or given up on)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Again at each wake-up: requests queued since may be waiting for others.
                self._hurry_acks.set()
                self._hurry_leases.set()
                self._idle.wait(remaining)
        return True

    def close(self, timeout: float) -> bool:
        """Flush for up to ``timeout`` seconds, then stop; True if everything was sent."""
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        self._closing.set()  # retries stop waiting between attempts
        self._acks.put(None)
        self._deadlines.put(None)
        self._hurry_acks.set()  # what was queued after the flush goes now
        self._hurry_leases.set()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return flushed

    def _run(
        self, requests: queue.SimpleQueue[_Item | None], window: float, hurry: threading.Event
    ) -> None:
        while True:
            first = requests.get()
            if first is None:
                return
            hurry.wait(window)  # let concurrent outcomes join this batch
            hurry.clear()  # before collecting: what a later hurry queued is taken below
            batch, stop = self._collect(first, requests)
            try:
                # Extensions first: a nack in the same batch must be the last word.
                for key in sorted(batch, key=lambda k: k[0] != "extend"):
                    self._send(key, batch[key])
            except Exception:  # a bug here must not stop every later request
                log.exception("sending a batch of acks failed")
                self.healthy = False
                self._resolve(batch, {})
            if stop:
                return

    def _collect(
        self, first: _Item, requests: queue.SimpleQueue[_Item | None]
    ) -> tuple[dict[_Key, list[_Entry]], bool]:
        batch: dict[_Key, list[_Entry]] = defaultdict(list)
        dropped = 0
        item: _Item | None = first
        stop = False
        while item is not None:
            key, ack_id, delivery, future = item
            if delivery is not None and delivery.settled:
                dropped += 1
            else:
                batch[key].append((ack_id, future))
            try:
                item = requests.get_nowait()
            except queue.Empty:
                break
            stop = item is None
        self._done(dropped)
        return batch, stop

    def _done(self, count: int) -> None:
        with self._idle:
            self._pending -= count
            self._idle.notify_all()

    def _resolve(self, batch: dict[_Key, list[_Entry]], took: dict[str, bool]) -> None:
        """Give every entry of ``batch`` still pending its answer (False if unknown)."""
        for entries in batch.values():
            for ack_id, future in entries:
                if future is not None and not future.done():
                    future.set_result(took.get(ack_id, False))
            self._done(len(entries))
            entries.clear()

    def _send(self, key: _Key, entries: list[_Entry]) -> None:
        for start in range(0, len(entries), _MAX_IDS_PER_REQUEST):
            chunk = entries[start : start + _MAX_IDS_PER_REQUEST]
            took = self._send_with_retries(key, [ack_id for ack_id, _ in chunk])
            self._resolve({key: list(chunk)}, took)
        entries.clear()

    def _send_with_retries(self, key: _Key, ack_ids: list[str]) -> dict[str, bool]:
        """Send; return whether each ack id took. Never raises: a request that failed for
        good is logged, and its messages come back after their ack deadline."""
        took: dict[str, bool] = {}
        pending = ack_ids
        for attempt in range(_ATTEMPTS):
            try:
                self._call(key, pending)
            except gexc.InvalidArgument as exc:
                errors = _ack_id_errors(exc)
                if not errors:
                    return self._gave_up(key, pending, exc, took)
                # The other ids in the request took effect; retry only the transient ones.
                took.update((a, True) for a in pending if a not in errors)
                took.update((a, False) for a, why in errors.items() if not _transient(why))
                pending = [a for a, why in errors.items() if _transient(why)]
                if not pending:
                    return took
            except _TRANSIENT as exc:
                if attempt == _ATTEMPTS - 1 or self._closing.is_set():
                    return self._gave_up(key, pending, exc, took)
            except Exception as exc:  # PermissionDenied, a closed channel: retrying won't help
                return self._gave_up(key, pending, exc, took)
            else:
                self.healthy = True
                took.update((a, True) for a in pending)
                return took
            self._closing.wait(0.1 * 2**attempt)
        return self._gave_up(key, pending, None, took)

    def _gave_up(
        self, key: _Key, pending: list[str], exc: Exception | None, took: dict[str, bool]
    ) -> dict[str, bool]:
        # Lost requests are safe: an unacked message is redelivered after its deadline.
        reason = f"{type(exc).__name__}: {exc}" if exc else "transient failures"
        log.warning("%s of %d messages failed: %s", key[0], len(pending), reason)
        self.healthy = False
        took.update((a, False) for a in pending)
        return took

    def _call(self, key: _Key, ack_ids: list[str]) -> None:
        kind, seconds = key
        if kind == "ack":
            self._rpc.acknowledge(ack_ids, _CALL_TIMEOUT)
        else:
            self._rpc.modify_ack_deadline(ack_ids, seconds, _CALL_TIMEOUT)


def _transient(why: str) -> bool:
    return why.startswith("TRANSIENT_")


def _ack_id_errors(exc: gexc.GoogleAPICallError) -> dict[str, str]:
    """Per-ack-id failures that an exactly-once subscription reports in an ErrorInfo."""
    errors: dict[str, str] = {}
    for detail in exc.details or ():
        if getattr(detail, "reason", "") == _EXACTLY_ONCE_FAILURE:
            errors.update(dict(detail.metadata))
    return errors


def _deadline(seconds: float) -> int:
    """Whole seconds, as Pub/Sub takes them; a delay under one is one, not 0 (a redelivery at
    once, again and again while the delay lasts). One that is no number (a middleware's bug)
    is the longest: raising here would leave its message settled with nothing sent, and 0
    would bring it back at once, again and again."""
    if math.isnan(seconds):
        return c.MAX_ACK_DEADLINE_SECONDS
    if seconds <= 0:
        return 0
    return max(1, round(min(c.MAX_ACK_DEADLINE_SECONDS, seconds)))
