"""One received message and its lease, as the pool tracks it from pull to ack."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(eq=False)
class Delivery:
    """A message leased to this worker.

    ``settle()`` is the single gate to ack or nack: whichever of the job's own outcome or the
    drain path gets there first decides, and the other is ignored, so a message is never
    both nacked at the drain deadline and acked a moment later by its finishing handler.
    """

    ack_id: str
    message_id: str
    data: bytes
    attributes: dict[str, str]
    publish_time: datetime | None
    delivery_attempt: int | None
    received_at: float = field(default_factory=time.monotonic)
    # Monotonic time after which the lease is no longer extended (set from the job's timeout).
    lease_until: float = float("inf")
    # Monotonic time its run started (None until then, and for input that never runs).
    started_at: float | None = None
    _settled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def size(self) -> int:
        return len(self.data) + sum(len(k) + len(v) for k, v in self.attributes.items())

    def settle(self) -> bool:
        """Claim the right to ack or nack this message; True only for the first caller."""
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    @property
    def settled(self) -> bool:
        return self._settled
