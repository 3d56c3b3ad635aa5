"""Batch acknowledge / modify_ack_deadline requests on one thread.

Handlers finish on many threads; sending one RPC per message caps throughput, so requests
queue here and go out in batches every few milliseconds. ``flush`` is what drain waits on to
be sure every outcome reached Pub/Sub before the process exits.

On an exactly-once subscription an ack can fail (the ack id expired, the message went to
another worker); ``ack(confirm=True)`` returns a future that says whether it took.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

from google.api_core import exceptions as gexc

from workerpool.delivery import Delivery

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


class Acknowledger:
    def __init__(self, client: Any, subscription: str, *, interval: float = 0.01) -> None:
        self._client = client
        self._subscription = subscription
        self._interval = interval
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="workerpool-acks", daemon=True)
        self._thread.start()

    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        """Queue an ack; with ``confirm``, return a future: True once Pub/Sub accepted it."""
        future: Future[bool] | None = Future() if confirm else None
        self._put([(("ack", 0), ack_id, None, future)])
        return future

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        """Set the ack deadline of ``ack_ids``; 0 releases them for immediate redelivery."""
        key = ("modack", _deadline(seconds))
        self._put([(key, ack_id, None, None) for ack_id in ack_ids])

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        """Extend leases, skipping at send time any delivery settled meanwhile."""
        key = ("extend", _deadline(seconds))
        self._put([(key, d.ack_id, d, None) for d in deliveries])

    def _put(self, items: list[_Item]) -> None:
        with self._idle:
            self._pending += len(items)
        for item in items:
            self._queue.put(item)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued request has been sent (or given up on)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, timeout: float = 10.0) -> bool:
        flushed = self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        return flushed

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            time.sleep(self._interval)  # let concurrent outcomes join this batch
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
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                stop = item is None
            self._done(dropped)
            # Extensions first: a nack or ack in the same batch must be the last word.
            for key in sorted(batch, key=lambda k: k[0] != "extend"):
                self._send(key, batch[key])
            if stop:
                return

    def _done(self, count: int) -> None:
        with self._idle:
            self._pending -= count
            self._idle.notify_all()

    def _send(self, key: _Key, entries: list[_Entry]) -> None:
        for start in range(0, len(entries), _MAX_IDS_PER_REQUEST):
            chunk = entries[start : start + _MAX_IDS_PER_REQUEST]
            failed: set[str] | None = None
            try:
                failed = self._send_with_retries(key, [ack_id for ack_id, _ in chunk])
            except gexc.GoogleAPICallError as exc:
                # Lost requests are safe: an unacked message is redelivered after its deadline.
                log.warning("%s of %d messages failed: %s", key[0], len(chunk), exc)
            finally:
                for ack_id, future in chunk:
                    if future is not None:
                        future.set_result(failed is not None and ack_id not in failed)
                self._done(len(chunk))

    def _send_with_retries(self, key: _Key, ack_ids: list[str]) -> set[str]:
        """Send; return the ack ids that failed for good (exactly-once subscriptions only)."""
        failed: set[str] = set()
        for attempt in range(_ATTEMPTS):
            try:
                self._call(key, ack_ids)
                return failed
            except gexc.InvalidArgument as exc:
                errors = _ack_id_errors(exc)
                if not errors:
                    raise
                # The other ids in the request took effect; retry only the transient ones.
                failed |= {a for a, why in errors.items() if not why.startswith("TRANSIENT_")}
                ack_ids = [a for a, why in errors.items() if why.startswith("TRANSIENT_")]
                if not ack_ids:
                    return failed
            except _TRANSIENT:
                if attempt == _ATTEMPTS - 1:
                    raise
            time.sleep(0.1 * 2**attempt)
        return failed | set(ack_ids)

    def _call(self, key: _Key, ack_ids: list[str]) -> None:
        kind, seconds = key
        if kind == "ack":
            self._client.acknowledge(
                request={"subscription": self._subscription, "ack_ids": ack_ids},
                retry=None,  # _send_with_retries owns retries, bounded so a drain can flush
                timeout=_CALL_TIMEOUT,
            )
        else:
            self._client.modify_ack_deadline(
                request={
                    "subscription": self._subscription,
                    "ack_ids": ack_ids,
                    "ack_deadline_seconds": seconds,
                },
                retry=None,
                timeout=_CALL_TIMEOUT,
            )


def _ack_id_errors(exc: gexc.GoogleAPICallError) -> dict[str, str]:
    """Per-ack-id failures that an exactly-once subscription reports in an ErrorInfo."""
    errors: dict[str, str] = {}
    for detail in exc.details or ():
        if getattr(detail, "reason", "") == _EXACTLY_ONCE_FAILURE:
            errors.update(dict(detail.metadata))
    return errors


def _deadline(seconds: float) -> int:
    return max(0, min(600, round(seconds)))
