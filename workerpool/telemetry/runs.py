"""Values kept from the start of a run until its delivery is settled.

A middleware sees the run start (``Job``); a settle listener sees the end (``Settled``). Both
know the message id and the attempt number, which tell runs apart, even a redelivery of the
same message while its first run still goes on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

from workerpool.envelope import Job
from workerpool.listeners import Settled

T = TypeVar("T")


class PerRun(Generic[T]):
    """A small thread-safe map from a run to a value; bounded, so a run that is never
    settled (a bug) cannot make it grow without end."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._values: OrderedDict[tuple[str, int], T] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, job: Job, value: T) -> None:
        with self._lock:
            self._values[(job.message_id, job.delivery_attempt)] = value
            if len(self._values) > self._capacity:
                self._values.popitem(last=False)

    def pop(self, settled: Settled) -> T | None:
        with self._lock:
            return self._values.pop(settled.run_key, None)

    def discard(self, job: Job) -> None:
        with self._lock:
            self._values.pop((job.message_id, job.delivery_attempt), None)

    def __len__(self) -> int:
        return len(self._values)
