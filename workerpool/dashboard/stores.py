"""What opens each store the dashboard reads, beside the idempotency store the workers share.
A store is opened for one read and closed again: a page never holds a connection between
requests, and a store the fleet does not keep (``none``) reads as nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from workerpool.batches import batch_opener
from workerpool.batches.store import BatchStore
from workerpool.heartbeats import HeartbeatStore, heartbeat_opener
from workerpool.idempotency import IdempotencyStore, store_opener
from workerpool.leadership import LeadershipStore, leadership_opener
from workerpool.periodic import Marks, marks_opener
from workerpool.progress import JobStateStore, job_state_opener
from workerpool.schedule import ScheduleStore, schedule_opener
from workerpool.slots import SlotStore, slot_store_opener


class _Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=_Closable)


@dataclass(frozen=True)
class Openers:
    """One opener per store; None where the URL keeps no such store."""

    heartbeats: Callable[[], HeartbeatStore] | None = None
    slots: Callable[[], SlotStore] | None = None
    batches: Callable[[], BatchStore] | None = None
    schedule: Callable[[], ScheduleStore] | None = None
    marks: Callable[[], Marks] | None = None
    completions: Callable[[], IdempotencyStore] | None = None
    leadership: Callable[[], LeadershipStore] | None = None  # the autoscaler's decisions
    progress: Callable[[], JobStateStore] | None = None

    @classmethod
    def of(cls, url: str) -> Openers:
        """The stores beside the idempotency store ``url`` names. Raises ValueError for a URL
        it does not know, ImportError for a missing extra."""
        completions = store_opener(url)
        if completions is None:  # "none": the fleet shares nothing
            return cls()
        return cls(
            heartbeats=heartbeat_opener(url),
            slots=slot_store_opener(url),
            batches=batch_opener(url),
            schedule=schedule_opener(url),
            marks=marks_opener(url),
            completions=completions,
            leadership=leadership_opener(url),
            progress=job_state_opener(url),
        )


@contextlib.contextmanager
def opened(opener: Callable[[], S] | None) -> Iterator[S | None]:
    """The store ``opener`` opens, closed on the way out; None when there is no opener."""
    if opener is None:
        yield None
        return
    store = opener()
    try:
        yield store
    finally:
        store.close()
