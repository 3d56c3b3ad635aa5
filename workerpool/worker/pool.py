"""Exactly N slots, and a hold on no more than N + prefetch messages.

The puller asks ``wait_for_room`` how many messages it may pull; ``admit`` queues them for the
N slot threads (and releases at once anything beyond the bound); ``quiet`` gives back every
message not yet started; ``stop`` waits for running jobs until a deadline, then interrupts them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from workerpool import constants as c
from workerpool.worker.delivery import Delivery
from workerpool.worker.interfaces import Leases
from workerpool.worker.processor import Processor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLimits:
    max_outstanding: int
    prefetch: int = c.DEFAULT_PREFETCH
    max_bytes: int = c.DEFAULT_MAX_HELD_BYTES

    def __post_init__(self) -> None:
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be at least 1, got {self.max_outstanding}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {self.prefetch}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")

    @property
    def max_held(self) -> int:
        return self.max_outstanding + self.prefetch


@dataclass(frozen=True)
class DrainReport:
    released_waiting: int
    finished: int
    interrupted: int
    seconds: float


class Pool:
    def __init__(
        self,
        processor: Processor,
        leases: Leases,
        limits: PoolLimits,
        *,
        name: str = "pool",
    ) -> None:
        self.limits = limits
        self.name = name
        self._processor = processor
        self._leases = leases
        self._waiting: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()
        self._held = 0
        self._held_bytes = 0
        self._running = 0
        self._cond = threading.Condition()
        self._quiet = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def running(self) -> int:
        return self._running

    @property
    def held(self) -> int:
        return self._held

    @property
    def quieted(self) -> bool:
        return self._quiet.is_set()

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._slot, name=f"{self.name}-slot-{i}", daemon=True)
            for i in range(self.limits.max_outstanding)
        ]
        for thread in self._threads:
            thread.start()

    def wait_for_room(self, timeout: float) -> int:
        """How many messages may be pulled now (0 after ``timeout`` or once quiet)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._quiet.is_set():
                room = self.limits.max_held - self._held
                if room > 0 and self._held_bytes < self.limits.max_bytes:
                    return room
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return 0

    def admit(self, deliveries: list[Delivery]) -> None:
        accepted: list[Delivery] = []
        released: list[Delivery] = []
        with self._cond:
            for delivery in deliveries:
                fits = self._held < self.limits.max_held and (
                    self._held_bytes < self.limits.max_bytes or self._held == 0
                )
                if fits and not self._quiet.is_set():
                    self._held += 1
                    self._held_bytes += delivery.size
                    accepted.append(delivery)
                else:
                    released.append(delivery)
        if accepted:
            self._leases.add(accepted)
            for delivery in accepted:
                self._waiting.put(delivery)
        if released:
            # More than we asked for, or we are draining: let another worker have them now.
            self._processor.give_back(released)
            log.info("%s released %d messages beyond its bound", self.name, len(released))

    def _slot(self) -> None:
        while True:
            delivery = self._waiting.get()
            if delivery is None:
                return
            if delivery.settled:  # given back by quiet() while it waited
                continue
            with self._cond:
                self._running += 1
            try:
                self._processor.process(delivery)
            except BaseException:  # the processor maps handler errors; this guards the slot
                log.exception("%s: processing %s failed", self.name, delivery.message_id)
                self._processor.give_back([delivery])  # if nothing settled it: now
            finally:
                self._leases.remove(delivery)
                with self._cond:
                    self._running -= 1
                    self._held -= 1
                    self._held_bytes -= delivery.size
                    self._cond.notify_all()

    def quiet(self) -> int:
        """Stop admitting, tell running jobs we are draining, give back what has not started."""
        self._quiet.set()
        self._processor.draining.set()
        waiting: list[Delivery] = []
        while True:
            try:
                item = self._waiting.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                waiting.append(item)
        released = self._processor.give_back(waiting)
        with self._cond:
            self._held -= len(waiting)
            self._held_bytes -= sum(d.size for d in waiting)
            self._cond.notify_all()
        return released

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no job runs, or the monotonic ``deadline`` passes."""
        with self._cond:
            while self._running or self._held:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def interrupt(self) -> int:
        return self._processor.interrupt_running()

    def join(self, deadline: float) -> bool:
        """Stop the slots; wait for them until the monotonic ``deadline`` (a handler that
        ignores ``ctx.cancelled`` keeps its slot thread; it is a daemon). True if all ended."""
        for _ in self._threads:
            self._waiting.put(None)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
