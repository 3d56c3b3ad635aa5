"""Delayed jobs: a message whose ``not_before`` attribute is still ahead waits in a durable
schedule in the store the workers share (the idempotency store's URL), not in a pool, not in
memory, and not as Pub/Sub deliveries; a worker publishes it again, with its own job id, when
it is due. ``delays`` is the worker's side (imported by the launcher only); ``when`` the
attribute."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.schedule.memory import MemorySchedule
from workerpool.schedule.sqlite import SqliteSchedule
from workerpool.schedule.store import Entry, ScheduleStore
from workerpool.schedule.when import MAX_AHEAD, not_before_text, parse_not_before
from workerpool.stores import opener

__all__ = [
    "MAX_AHEAD",
    "Entry",
    "MemorySchedule",
    "ScheduleStore",
    "SqliteSchedule",
    "not_before_text",
    "parse_not_before",
    "schedule_opener",
]


def schedule_opener(url: str) -> Callable[[], ScheduleStore] | None:
    """What opens the schedule beside the idempotency store ``url`` names (Firestore: the
    collection ``<COLLECTION>-schedule``); None for ``none``: delayed messages then ride on
    their ack deadline. Raises ImportError for a missing extra."""
    return opener(url, "schedule", memory=MemorySchedule, sqlite=SqliteSchedule,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], ScheduleStore]:
    from workerpool.schedule.firestore import FirestoreSchedule

    return lambda project, collection: FirestoreSchedule(project, f"{collection}-schedule")
