"""Firestore backend: one document per job id, shared by replicas on many hosts.

Each mutation is one preconditioned read-decide-write (``workerpool.stores.firestore``).
Set a TTL policy on the ``expire_at`` field to have Firestore purge old records. The failed
runs are counted by the minute in ``<collection>-failed``, a document a minute (its own
``expire_at``, a day on).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    FAILED_MINUTES_KEPT,
    IdempotencyStore,
    Mutation,
    Record,
    T,
)
from workerpool.stores import firestore as docs


class FirestoreStore(IdempotencyStore):
    """Records live in ``collection`` of ``project``'s default database; the job id itself is
    kept in a field for people. ``timeout`` bounds each whole operation."""

    def __init__(
        self,
        project: str,
        collection: str,
        *,
        retention: float = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        timeout: float = 5.0,
    ) -> None:
        super().__init__(retention=retention, clock=clock)
        self._docs = docs.Documents(project, collection, timeout=timeout, label="idempotency store")
        # The failed runs' counts: a client of their own, made when first needed (most
        # processes never see a run fail).
        self._failed_where = (project, f"{collection}-failed", timeout)
        self._failed_docs: docs.Documents | None = None
        self._opening = threading.Lock()

    @property
    def _failed(self) -> docs.Documents:
        with self._opening:
            if self._failed_docs is None:
                project, collection, timeout = self._failed_where
                self._failed_docs = docs.Documents(
                    project, collection, timeout=timeout, label="idempotency store"
                )
            return self._failed_docs

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        return self._docs.mutate(job_id, self._deciding(job_id, mutation))

    def _mutate_many(self, items: Sequence[tuple[str, Mutation[T]]]) -> list[T]:
        return self._docs.mutate_many(
            [(job_id, self._deciding(job_id, mutation)) for job_id, mutation in items]
        )

    def _deciding(self, job_id: str, mutation: Mutation[T]) -> docs.Decision[T]:
        def decide(data: dict[str, Any] | None) -> tuple[T, docs.DocChange]:
            result, change = mutation(None if data is None else _decode(data), self._clock())
            return result, None if change is None else self._encode(job_id, change)

        return decide

    def _encode(self, job_id: str, record: Record) -> dict[str, Any]:
        expire_at = datetime.fromtimestamp(record.expire_at(self.retention), tz=UTC)
        return {
            "job_id": job_id,
            "owner": record.owner,
            "message_id": record.message_id,
            "until": float(record.until),
            "completed_at": None if record.completed_at is None else float(record.completed_at),
            "expire_at": expire_at,
            "failures": record.failures,
            "token": record.token,
        }

    def _add_failed(self, minute: int, count: int) -> None:
        expire_at = datetime.fromtimestamp((minute + FAILED_MINUTES_KEPT) * 60, tz=UTC)
        self._failed.add(str(minute), {"minute": minute, "expire_at": expire_at}, "failed", count)

    def failed_per_minute(self, since: float) -> dict[int, int] | None:
        # The minutes past a day are left to the TTL policy on expire_at: not read.
        oldest = int(self._clock() // 60) - FAILED_MINUTES_KEPT + 1
        minutes = self._failed.at_least("minute", max(oldest, math.ceil(since / 60)))
        return {int(d["minute"]): int(d["failed"]) for d in minutes}

    def close(self) -> None:
        self._docs.close()
        with self._opening:
            if self._failed_docs is not None:
                self._failed_docs.close()


def _decode(data: dict[str, Any]) -> Record:
    completed_at = data.get("completed_at")
    return Record(
        owner=data["owner"],
        message_id=data["message_id"],
        until=float(data["until"]),
        completed_at=None if completed_at is None else float(completed_at),
        failures=int(data.get("failures", 0)),
        token=int(data.get("token", 0)),
    )
