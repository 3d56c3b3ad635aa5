"""How many times this process has been given a message, where Pub/Sub does not say."""

from __future__ import annotations

import threading
from collections import OrderedDict

from workerpool.worker.delivery import Delivery


class AttemptCounter:
    """Counts deliveries per message when Pub/Sub does not (no dead-letter policy).

    Only this process's deliveries are seen, so it is a fallback, not a replacement for the
    subscription's ``delivery_attempt``.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def attempt(self, delivery: Delivery) -> int:
        if delivery.delivery_attempt:
            return delivery.delivery_attempt
        with self._lock:
            count = self._seen.pop(delivery.message_id, 0) + 1
            self._seen[delivery.message_id] = count
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            return count
