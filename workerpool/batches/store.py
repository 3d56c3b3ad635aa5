"""The batch record and its ledger, and the rules every backend follows.

A batch is created open and uncommitted with the job ids of all its children, each pending;
its publisher commits it once every child is published. A child's *final* outcome (done, or
dead-lettered) is written to the ledger under its job id, once: a second delivery, a duplicate
or a crash cannot count it twice (a replayed child that was dead-lettered may turn done while
the batch is open). The batch is finalized once, by whichever of these comes first: the write
that leaves a committed batch with no pending child, the commit of a batch with none left, or
its deadline; that one call returns the ``Completion`` to publish, every other returns None.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

from workerpool import constants as c
from workerpool.schedule.store import Entry, ScheduleStore

MAX_FAILED_IDS = 1000  # job ids a completion lists at most
LAST_CHILD, DEADLINE = "last_child", "deadline"


@dataclass(frozen=True)
class Batch:
    batch_id: str
    topic: str
    on_complete: str
    total: int
    deadline: float  # seconds since the epoch
    committed: bool = False
    done: int = 0
    failed: int = 0
    finalized_by: str = ""  # LAST_CHILD or DEADLINE once finalized
    completion_sent: bool = False  # its completion is in the schedule

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed


@dataclass(frozen=True)
class Completion:
    """The one completion job of a batch: ``on_complete`` on the batch's topic, job id
    ``batch:<id>:complete``. Children still pending at the deadline count as failed and are
    listed apart too."""

    batch: Batch
    failed_job_ids: list[str]
    pending_job_ids: list[str]

    @property
    def job_id(self) -> str:
        return f"batch:{self.batch.batch_id}:complete"

    def payload(self) -> dict[str, object]:
        batch = self.batch
        return {
            "batch_id": batch.batch_id,
            "total": batch.total,
            "succeeded": batch.done,
            "failed": batch.total - batch.done,
            "failed_job_ids": self.failed_job_ids[:MAX_FAILED_IDS],
            "pending_job_ids": self.pending_job_ids[:MAX_FAILED_IDS],
            "finalized_by": batch.finalized_by,
        }

    def message(self) -> tuple[bytes, dict[str, str]]:
        attributes = {c.ATTR_JOB: self.batch.on_complete, c.ATTR_JOB_ID: self.job_id}
        return json.dumps(self.payload(), separators=(",", ":")).encode(), attributes


class Transaction(Protocol):
    """What a backend offers, inside one atomic transaction (``BatchStore._transaction``)."""

    def batch(self, batch_id: str) -> Batch | None: ...

    def put_batch(self, batch: Batch) -> None: ...

    def outcome(self, batch_id: str, job_id: str) -> str | None:
        """The child's ledger entry: PENDING, DONE or FAILED; None if it is not a child."""
        ...

    def put_outcome(self, batch_id: str, job_id: str, outcome: str) -> None: ...

    def add_children(self, batch_id: str, job_ids: Sequence[str]) -> None: ...

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]: ...


PENDING, DONE, FAILED = "pending", "done", "failed"


class BatchStore(ABC):
    """Every method may raise ``StoreError`` (ValueError and KeyError where said), and
    nothing else. The rules are here, once; a backend provides ``_transaction``."""

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Transaction]:
        """One atomic transaction: what it read stays true until it ends."""

    def create(
        self, batch_id: str, topic: str, on_complete: str, job_ids: Sequence[str], deadline: float
    ) -> None:
        """An open, uncommitted batch of these children, all pending. Creating it again as it
        is (a publisher trying again) is allowed; ValueError for another batch of that id."""
        wanted = Batch(batch_id, topic, on_complete, len(set(job_ids)), deadline)
        with self._transaction() as tx:
            existing = tx.batch(batch_id)
            if existing is None:
                tx.put_batch(wanted)
                tx.add_children(batch_id, sorted(set(job_ids)))
            elif (existing.topic, existing.on_complete, existing.total) != (
                topic, on_complete, wanted.total,
            ):  # fmt: skip
                raise ValueError(f"batch {batch_id} exists already, with other children")

    def commit(self, batch_id: str) -> Completion | None:
        """Every child is published: the batch may complete from now on (at once if none is
        pending any more). KeyError for an unknown batch."""
        with self._transaction() as tx:
            batch = tx.batch(batch_id)
            if batch is None:
                raise KeyError(batch_id)
            if batch.committed or batch.finalized_by:
                return None
            batch = replace(batch, committed=True)
            if not batch.pending:  # the children all finished while it was being published
                return self._finalize(tx, batch, LAST_CHILD)
            tx.put_batch(batch)
            return None

    def record(self, batch_id: str, job_id: str, succeeded: bool) -> Completion | None:
        """A child's final outcome; the completion if this finalized the batch. A job id the
        batch does not have, a child already final (a dead-lettered one may turn done: a
        replay), or a batch finalized already, change nothing."""
        outcome = DONE if succeeded else FAILED
        with self._transaction() as tx:
            batch = tx.batch(batch_id)
            if batch is None or batch.finalized_by:
                return None
            before = tx.outcome(batch_id, job_id)
            if before is None or before in (outcome, DONE):
                return None
            tx.put_outcome(batch_id, job_id, outcome)
            done = batch.done + (outcome == DONE)
            failed = batch.failed + (outcome == FAILED) - (before == FAILED)
            batch = replace(batch, done=done, failed=failed)
            if batch.committed and not batch.pending:
                return self._finalize(tx, batch, LAST_CHILD)
            tx.put_batch(batch)
            return None

    def expire(self, batch_id: str) -> Completion | None:
        """The batch's deadline: finalize it, whatever is still pending, unless it is final."""
        with self._transaction() as tx:
            batch = tx.batch(batch_id)
            if batch is None or batch.finalized_by:
                return None
            return self._finalize(tx, batch, DEADLINE)

    def sent(self, batch_id: str) -> None:
        """Its completion is in the schedule, to be published."""
        with self._transaction() as tx:
            batch = tx.batch(batch_id)
            if batch is not None:
                tx.put_batch(replace(batch, completion_sent=True))

    def completion(self, batch_id: str) -> Completion | None:
        """The completion of a batch finalized already (None if it is not)."""
        with self._transaction() as tx:
            batch = tx.batch(batch_id)
            return None if batch is None or not batch.finalized_by else self._built(tx, batch)

    def get(self, batch_id: str) -> Batch | None:
        with self._transaction() as tx:
            return tx.batch(batch_id)

    @abstractmethod
    def batches(self, limit: int = 100) -> list[Batch]:
        """The batches soonest due first, for ``workerpool batch list``."""

    @abstractmethod
    def close(self) -> None: ...

    def _finalize(self, tx: Transaction, batch: Batch, by: str) -> Completion:
        batch = replace(batch, finalized_by=by)
        tx.put_batch(batch)
        return self._built(tx, batch)

    @staticmethod
    def _built(tx: Transaction, batch: Batch) -> Completion:
        failed = tx.children(batch.batch_id, FAILED, MAX_FAILED_IDS)
        pending = tx.children(batch.batch_id, PENDING, MAX_FAILED_IDS)
        return Completion(batch, failed + pending, pending)


# --- Handing a completion over ------------------------------------------------------------
# The batch's net: a delayed job of its own, due at the deadline, published with the children.
DEADLINE_JOB = "workerpool.batch_deadline"


def deadline_job_id(batch_id: str) -> str:
    return f"batch:{batch_id}:deadline"


def deliver(
    completion: Completion | None,
    batches: BatchStore,
    schedule: ScheduleStore,
    clock: Callable[[], float] = time.time,
) -> float | None:
    """Put ``completion`` in the schedule, due now (once: its job id), and mark it sent;
    when it is due (None: nothing to deliver). Raises ``StoreError``."""
    if completion is None:
        return None
    data, attributes = completion.message()
    now = clock()
    schedule.add(Entry(completion.batch.topic, completion.job_id, now, data, attributes))
    batches.sent(completion.batch.batch_id)
    return now
