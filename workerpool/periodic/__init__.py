"""Periodic jobs: schedules declared in the config or on ``@job``, whose ticks any worker may
fire, each exactly once (``spec`` the declaration, ``ticks`` when they fall, ``marks`` the
ticks fired, ``firing`` the worker's side, imported by the launcher only)."""

from __future__ import annotations

from collections.abc import Callable

from workerpool.periodic.marks import Mark, Marks, MemoryMarks
from workerpool.periodic.spec import Periodic, parse_schedule, parse_schedules, with_jobs
from workerpool.periodic.sqlite import SqliteMarks
from workerpool.periodic.ticks import Ticks, cron_expression
from workerpool.stores import opener

__all__ = [
    "Mark",
    "Marks",
    "MemoryMarks",
    "Periodic",
    "SqliteMarks",
    "Ticks",
    "cron_expression",
    "marks_opener",
    "parse_schedule",
    "parse_schedules",
    "with_jobs",
]


def marks_opener(url: str) -> Callable[[], Marks] | None:
    """What opens the marks of fired ticks beside the idempotency store ``url`` names
    (Firestore: the collections ``<COLLECTION>-periodic`` and ``-periodic-pauses``); None for
    ``none``. Raises ImportError for a missing extra."""
    return opener(url, "periodic ticks", memory=MemoryMarks, sqlite=SqliteMarks,
                  firestore=_firestore)  # fmt: skip


def _firestore() -> Callable[[str, str], Marks]:
    from workerpool.periodic.firestore import FirestoreMarks

    return FirestoreMarks
