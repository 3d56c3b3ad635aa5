"""Batch acknowledge / modify_ack_deadline requests on one thread.

Handlers finish on many threads; sending one RPC per message caps throughput, so requests
queue here and go out in batches every few milliseconds. ``flush`` is what drain waits on to
be sure every outcome reached Pub/Sub before the process exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any

from google.api_core import exceptions as gexc

from workerpool.delivery import Delivery

log = logging.getLogger(__name__)

_MAX_IDS_PER_REQUEST = 1000
_ATTEMPTS = 4
_TRANSIENT = (
    gexc.ServiceUnavailable,
    gexc.DeadlineExceeded,
    gexc.InternalServerError,
    gexc.Aborted,
)

# A request key: ("ack", 0), ("modack", seconds) or ("extend", seconds).
_Key = tuple[str, int]
# A queued request: its key, the ack id, and for lease extensions the delivery, so a message
# settled while its extension waited in the queue is not re-leased after its nack.
_Item = tuple[_Key, str, Delivery | None]


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

    def ack(self, ack_id: str) -> None:
        self._put(("ack", 0), [(ack_id, None)])

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        """Set the ack deadline of ``ack_ids``; 0 releases them for immediate redelivery."""
        self._put(("modack", _deadline(seconds)), [(ack_id, None) for ack_id in ack_ids])

    def extend(self, deliveries: list[Delivery], seconds: float) -> None:
        """Extend leases, skipping at send time any delivery settled meanwhile."""
        self._put(("extend", _deadline(seconds)), [(d.ack_id, d) for d in deliveries])

    def _put(self, key: _Key, entries: list[tuple[str, Delivery | None]]) -> None:
        with self._idle:
            self._pending += len(entries)
        for ack_id, delivery in entries:
            self._queue.put((key, ack_id, delivery))

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
            batch: dict[_Key, list[str]] = defaultdict(list)
            dropped = 0
            item: _Item | None = first
            stop = False
            while item is not None:
                key, ack_id, delivery = item
                if delivery is not None and delivery.settled:
                    dropped += 1
                else:
                    batch[key].append(ack_id)
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

    def _send(self, key: _Key, ack_ids: list[str]) -> None:
        for start in range(0, len(ack_ids), _MAX_IDS_PER_REQUEST):
            chunk = ack_ids[start : start + _MAX_IDS_PER_REQUEST]
            try:
                self._send_with_retries(key, chunk)
            except gexc.GoogleAPICallError as exc:
                # Lost requests are safe: an unacked message is redelivered after its deadline.
                log.warning("%s of %d messages failed: %s", key[0], len(chunk), exc)
            finally:
                self._done(len(chunk))

    def _send_with_retries(self, key: _Key, ack_ids: list[str]) -> None:
        kind, seconds = key
        for attempt in range(_ATTEMPTS):
            try:
                if kind == "ack":
                    self._client.acknowledge(
                        request={"subscription": self._subscription, "ack_ids": ack_ids}
                    )
                else:
                    self._client.modify_ack_deadline(
                        request={
                            "subscription": self._subscription,
                            "ack_ids": ack_ids,
                            "ack_deadline_seconds": seconds,
                        }
                    )
                return
            except _TRANSIENT:
                if attempt == _ATTEMPTS - 1:
                    raise
                time.sleep(0.1 * 2**attempt)


def _deadline(seconds: float) -> int:
    return max(0, min(600, round(seconds)))
