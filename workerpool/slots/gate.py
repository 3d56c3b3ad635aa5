"""A pool that declares a key (``[[pools]] concurrency = "KEY"``) pulls only for slots of KEY
it already holds.

Before each pull the puller reserves slots (waiting in the key's line for the first, taking
whatever else is free at once) and asks for no more messages than it reserved; each message
pulled is bound to one of them, and its run keeps that slot for its whole run. No message of
the pool so waits for a slot while its lease runs, and none is deferred for want of one: a
full key costs no delivery attempts and no ack deadlines. Slots a pull brought no message
for go back at once; a bound slot whose message never ran goes back when it leaves the pool.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workerpool.slots.leases import FIRST_POLL, Lease, SlotLeases
from workerpool.slots.store import Granted
from workerpool.stores import StoreError
from workerpool.worker.delivery import Delivery

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reserved:
    """A slot taken for a message before it was pulled; its lease runs from ``sent``."""

    lease: Lease
    sent: float


class PoolGate:
    """The ``puller.Gate`` of a pool with a key; ``claim`` hands a run its message's slot."""

    def __init__(
        self, leases: SlotLeases, key: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        limit = leases.limits.of(key)
        if limit is None:
            raise KeyError(key)
        self.key = key
        self._leases = leases
        self._limit = limit
        self._clock = clock
        # The pool's place in the key's line, kept from one pull to the next while it waits.
        self._waiter = leases.new_holder()
        self._unbound: list[Reserved] = []  # only the puller's thread touches these
        self._bound: dict[str, Reserved] = {}  # by message id
        self._lock = threading.Lock()

    def reserve(self, room: int, timeout: float, stop: threading.Event) -> int:
        """Hold up to ``room`` slots for the next pull, waiting up to ``timeout`` (or until
        ``stop``) for the first; how many are held."""
        try:
            if not self._wait_for_first(timeout, stop):
                return 0
            while len(self._unbound) < room and self._ask(self._leases.new_holder(), False):
                pass
        except StoreError as exc:
            log.warning("no slot of %s reserved (%s); pulling nothing meanwhile", self.key, exc)
            stop.wait(timeout)
        return len(self._unbound)

    def _wait_for_first(self, timeout: float, stop: threading.Event) -> bool:
        deadline = self._clock() + timeout
        poll = FIRST_POLL
        while not self._unbound:
            if stop.is_set():
                self._release([self._waiter])
                return False
            if self._ask(self._waiter, True):
                self._waiter = self._leases.new_holder()
                return True
            left = deadline - self._clock()
            if left <= 0:
                return False
            stop.wait(min(left, poll * random.uniform(0.5, 1.0)))
            poll = min(poll * 2, self._leases.store.poll_every)
        return True

    def _ask(self, holder: str, wait: bool) -> bool:
        sent = self._clock()
        result = self._leases.store.acquire(
            self.key, holder, self._limit, self._leases.keeper.ttl, wait=wait
        )
        if isinstance(result, Granted):
            lease = Lease(self.key, holder, result.token)
            self._unbound.append(Reserved(lease, sent - result.age))
        return isinstance(result, Granted)

    def bind(self, deliveries: Sequence[Delivery]) -> None:
        """Give each message just pulled one reserved slot; release the rest now (the pull
        brought fewer messages than slots, or failed)."""
        reserved, self._unbound = self._unbound, []
        spare = reserved[len(deliveries) :]
        with self._lock:
            for delivery, slot in zip(deliveries, reserved, strict=False):
                replaced = self._bound.pop(delivery.message_id, None)
                if replaced is not None:  # a second copy of one message: one slot is enough
                    spare.append(replaced)
                self._bound[delivery.message_id] = slot
        if spare:
            self._release([slot.lease.holder for slot in spare])

    def claim(self, delivery: Delivery) -> Reserved | None:
        """The slot reserved for ``delivery`` (None if it has none): the caller keeps it."""
        with self._lock:
            return self._bound.pop(delivery.message_id, None)

    def settled(self, message_id: str) -> None:
        """The message left the pool; a slot it never claimed goes back, off this thread."""
        with self._lock:
            slot = self._bound.pop(message_id, None)
        if slot is not None:
            self._leases.keeper.release_soon([(self.key, slot.lease.holder)])

    def _release(self, holders: list[str]) -> None:
        try:
            self._leases.store.release_many([(self.key, holder) for holder in holders])
        except StoreError as exc:  # they lapse on their own within the TTL
            log.warning("%d slots of %s not released: %s", len(holders), self.key, exc)
