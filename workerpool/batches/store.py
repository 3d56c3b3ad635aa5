"""The batch record and its ledger, and the rules every backend follows.

A batch is created open and uncommitted with the job ids of all its children, each pending;
its publisher commits it once every child is published. A child's *final* outcome (done, or
dead-lettered) is written to the ledger under its job id, once, with the tally that counts it:
a second delivery, a duplicate or a crash cannot count it twice (a replayed child that was
dead-lettered may turn done while the batch is open). The batch is finalized once, by
whichever of these comes first: the write that leaves a committed batch with no pending
child, the commit of a batch with none left, or its deadline; that one call returns the
``Completion`` to publish, every other returns None, unless the completion was never handed
over to the schedule (the finalizer died first): then a child's redelivery, the deadline, or a
worker starting hands it over (twice at worst, and its job id runs once). Its counts are
frozen then: a finalized batch takes no more outcomes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from workerpool import constants as c
from workerpool.schedule.store import Entry, ScheduleStore

T = TypeVar("T")

log = logging.getLogger(__name__)

MAX_FAILED_IDS = 1000  # job ids a completion lists at most
# A batch's record and ledger are kept this long past its deadline (it is final by then, its
# completion handed over), then purged: SQLite deletes them, a Firestore TTL policy on
# ``expire_at`` does. Pub/Sub keeps a child's message 7 days at most.
KEPT_AFTER_DEADLINE = 7 * 24 * 3600.0
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
    trace: str = ""  # the W3C traceparent of its publisher, if one was tracing
    # Which children it has, as one digest (``children_digest``): what makes a second
    # creation of its id the same batch (empty: a record written before it was kept).
    children_digest: str = ""

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed

    @property
    def expire_at(self) -> float:
        return self.deadline + KEPT_AFTER_DEADLINE

    @property
    def unsent(self) -> bool:
        """Finalized, and its completion not in the schedule yet."""
        return bool(self.finalized_by) and not self.completion_sent


def children_digest(job_ids: Sequence[str]) -> str:
    """One digest of a batch's children (``job_ids`` sorted, without repeats), each id
    written apart (JSON), so no two lists of ids share one."""
    return hashlib.sha256(json.dumps(list(job_ids)).encode()).hexdigest()


@dataclass(frozen=True)
class Completion:
    """The one completion job of a batch: ``on_complete`` on the batch's topic, job id
    ``batch:<id>:complete``. Children still pending at the deadline count as failed and are
    listed apart too."""

    batch: Batch
    failed_job_ids: list[str]
    pending_job_ids: list[str]
    # Children cancelled by job id (``workerpool cancel``): counted apart from the failed,
    # and listed apart (``MAX_FAILED_IDS`` at most, as the others).
    cancelled_job_ids: list[str] = field(default_factory=list)
    cancelled: int = 0

    @property
    def job_id(self) -> str:
        return f"batch:{self.batch.batch_id}:complete"

    def payload(self) -> dict[str, object]:
        batch = self.batch
        return {
            "batch_id": batch.batch_id,
            "total": batch.total,
            "succeeded": batch.done,
            "failed": batch.total - batch.done - self.cancelled,
            "cancelled": self.cancelled,
            "failed_job_ids": self.failed_job_ids[:MAX_FAILED_IDS],
            "pending_job_ids": self.pending_job_ids[:MAX_FAILED_IDS],
            "cancelled_job_ids": self.cancelled_job_ids[:MAX_FAILED_IDS],
            "finalized_by": batch.finalized_by,
        }

    def message(self) -> tuple[bytes, dict[str, str]]:
        attributes = {c.ATTR_JOB: self.batch.on_complete, c.ATTR_JOB_ID: self.job_id}
        if self.batch.trace:
            attributes[c.ATTR_LINKED_TRACEPARENT] = self.batch.trace
        return json.dumps(self.payload(), separators=(",", ":")).encode(), attributes


PENDING, DONE, FAILED = "pending", "done", "failed"
# A child cancelled by job id: its tally counts it with the failed (it never succeeds, and
# the batch's pending count needs nothing else), its completion apart from them.
CANCELLED = "cancelled"
_NOT_DONE = (FAILED, CANCELLED)


@dataclass(frozen=True)
class Tally:
    """How many of a group of a batch's children are done and failed (a backend keeps its
    counts in one record per batch, or spreads them over several), and whether the batch is
    final (its tallies then take no more outcomes)."""

    total: int
    done: int = 0
    failed: int = 0
    final: bool = False

    @property
    def pending(self) -> int:
        return self.total - self.done - self.failed

    @classmethod
    def of(cls, batch: Batch) -> Tally:
        """The tally of a backend that keeps its counts in the batch record."""
        return cls(batch.total, batch.done, batch.failed, bool(batch.finalized_by))

    def moved(self, before: str, after: str) -> Tally:
        """The counts once a child goes from ``before`` to ``after``."""
        return replace(
            self,
            done=self.done + (after == DONE) - (before == DONE),
            failed=self.failed + (after in _NOT_DONE) - (before in _NOT_DONE),
        )

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.total + other.total, self.done + other.done, self.failed + other.failed,
            self.final or other.final,
        )  # fmt: skip


class Transaction(Protocol):
    """What a backend reads and writes inside one atomic transaction (``BatchStore._atomic``).
    A batch record's counts are the ones frozen at its finalization; while it is open they
    are its tally's."""

    def batch(self, batch_id: str) -> Batch | None: ...

    def put_batch(self, batch: Batch) -> None: ...

    def batches(self, limit: int) -> list[Batch]:
        """The batch records, soonest deadline first."""
        ...

    def child(self, batch_id: str, job_id: str) -> tuple[str, Tally] | None:
        """The child's ledger entry (PENDING, DONE or FAILED) and the tally it is counted
        in; None if it is not a child of a batch that exists."""
        ...

    def put_child(self, batch_id: str, job_id: str, outcome: str, tally: Tally) -> None:
        """Write the child's outcome and the tally it is counted in, together."""
        ...

    def tally(self, batch: Batch) -> Tally:
        """The batch's counts, all its tallies summed (``batch`` was read in this
        transaction)."""
        ...

    def add_children(self, batch: Batch, job_ids: Sequence[str]) -> None:
        """The children of a batch being created, pending, and their tallies."""
        ...

    def has_children(self, batch_id: str, job_ids: Sequence[str]) -> bool:
        """Whether every one of ``job_ids`` is in the batch's ledger."""
        ...

    def unsent(self, limit: int) -> list[Batch]:
        """Batches finalized whose completion is not in the schedule yet, up to ``limit``."""
        ...

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]: ...

    def count_children(self, batch_id: str, outcome: str) -> int:
        """How many of the batch's children have ``outcome``, counted by the backend (not
        read one by one)."""
        ...


class BatchStore(ABC):
    """Every method may raise ``StoreError`` (ValueError and KeyError where said), and
    nothing else. The rules are here, once; a backend provides ``_atomic``.

    A child's outcome and its tally are written together; the check for a batch with no
    child pending is a transaction of its own, made after that write (a backend may run the
    two as one): of two children finishing last at once, at least the later one's check sees
    the other's write, so the batch is never left open. The finalization is a
    compare-and-set on the batch record, so only one check, commit or deadline finalizes."""

    @abstractmethod
    def _atomic(self, body: Callable[[Transaction], T]) -> T:
        """``body``'s result, its reads and writes one atomic transaction. A backend may run
        ``body`` again (on fresh reads, after a lost race): it only reads and writes through
        its transaction. Exceptions it raises itself pass through, its writes undone."""

    def create(
        self,
        batch_id: str,
        topic: str,
        on_complete: str,
        job_ids: Sequence[str],
        deadline: float,
        *,
        trace: str = "",
    ) -> None:
        """An open, uncommitted batch of these children, all pending (``trace``: its
        publisher's traceparent, which its completion's span links to). Creating it again as
        it is (a publisher trying again), open or final, is allowed and changes nothing;
        ValueError for another batch of that id (other children, topic or ``on_complete``):
        its children would never be counted, and it would never complete."""
        children = sorted(set(job_ids))
        digest = children_digest(children)
        wanted = Batch(batch_id, topic, on_complete, len(children), deadline, trace=trace,
                       children_digest=digest)  # fmt: skip

        def create(tx: Transaction) -> None:
            existing = tx.batch(batch_id)
            if existing is None:
                tx.add_children(wanted, children)
                tx.put_batch(wanted)
                return
            # The same children, by their digest. (Not by finding each in the ledger: a
            # creation that failed part-way may have left its children there, in a backend
            # that writes them apart from the record, and read one by one a large batch's
            # were more than a request may carry.)
            same = (existing.topic, existing.on_complete, existing.total) == (
                topic, on_complete, wanted.total,
            ) and (
                existing.children_digest == digest
                if existing.children_digest
                else tx.has_children(batch_id, children)
            )  # fmt: skip
            if not same:
                state = "final" if existing.finalized_by else "open"
                raise ValueError(
                    f"batch {batch_id} exists already ({state}) with other children, topic or "
                    "on_complete: give this batch another id"
                )

        self._atomic(create)

    def commit(self, batch_id: str) -> Completion | None:
        """Every child is published: the batch may complete from now on (at once if none is
        pending any more). KeyError for an unknown batch."""

        def commit(tx: Transaction) -> Completion | bool:
            batch = tx.batch(batch_id)
            if batch is None:
                raise KeyError(batch_id)
            if batch.finalized_by:
                # The call that finalized it (this one's first try, say) may have died before
                # handing its completion over: hand it over now.
                return self._unsent(tx, batch) or False
            if not batch.committed:
                tx.put_batch(replace(batch, committed=True))
            # Committed already (a publisher trying again) still checks: the first may
            # have died before its check.
            return True

        committed = self._atomic(commit)
        if isinstance(committed, Completion):
            return committed
        return self._complete_if_done(batch_id) if committed else None

    def record(
        self, batch_id: str, job_id: str, succeeded: bool, *, cancelled: bool = False
    ) -> Completion | None:
        """A child's final outcome (``cancelled``: not succeeded, and cancelled by job id); the
        completion if this finalized the batch, or if the batch is final but its completion
        was never handed over. A job id the batch does not have, a child already final (a
        dead-lettered one may turn done: a replay), or a batch finalized already, change no
        counts."""
        outcome = DONE if succeeded else CANCELLED if cancelled else FAILED

        def write(tx: Transaction) -> Completion | bool | None:
            found = tx.child(batch_id, job_id)
            if found is None:
                return None
            before, tally = found
            if tally.final:
                # The call that finalized it may have died before handing its completion
                # over (this child's message then comes back): hand it over now.
                return self._unsent(tx, tx.batch(batch_id)) or False
            # Written once, pending to final; after that only to done (a dead-lettered or
            # cancelled child replayed). A move between failed and cancelled leaves its
            # tally's counts as they were, so a finalization counting cancelled children at
            # that moment would not see it and would not be refused at its commit.
            if before == PENDING or (outcome == DONE and before != DONE):
                tally = tally.moved(before, outcome)
                tx.put_child(batch_id, job_id, outcome, tally)
            # One that changes nothing checks too, if its tally is settled: the call that
            # settled it may have died before its check (its message then comes back).
            return not tally.pending

        written = self._atomic(write)
        if written is None:
            # Its batch is in another store (a publisher given another one), or it never had
            # this child: nothing here can count it, and its batch would wait for its deadline.
            log.warning("batch %s has no child %s in this store: its outcome is not counted",
                        batch_id, job_id)  # fmt: skip
            return None
        if isinstance(written, Completion):
            return written
        return self._complete_if_done(batch_id) if written else None

    def expire(self, batch_id: str) -> Completion | None:
        """The batch's deadline: finalize it, whatever is still pending, unless it is final;
        a final one's completion if it was never handed over."""

        def expire(tx: Transaction) -> Completion | None:
            batch = tx.batch(batch_id)
            if batch is None or batch.finalized_by:
                return self._unsent(tx, batch)
            return self._finalize(tx, batch, DEADLINE)

        return self._atomic(expire)

    def sent(self, batch_id: str) -> None:
        """Its completion is in the schedule, to be published."""

        def sent(tx: Transaction) -> None:
            batch = tx.batch(batch_id)
            if batch is not None:
                tx.put_batch(replace(batch, completion_sent=True))

        self._atomic(sent)

    def unsent(self, limit: int = 100) -> list[Completion]:
        """The completions of batches finalized but never handed over (their finalizer died
        first), for a worker to hand over as it starts."""
        return self._atomic(lambda tx: [self._built(tx, b) for b in tx.unsent(limit)])

    def pending(self, batch_id: str, limit: int) -> list[str]:
        """Up to ``limit`` job ids of the batch's children without a final outcome yet."""
        return self._atomic(lambda tx: tx.children(batch_id, PENDING, limit))

    def get(self, batch_id: str) -> Batch | None:
        def get(tx: Transaction) -> Batch | None:
            batch = tx.batch(batch_id)
            return None if batch is None else _counted(tx, batch)

        return self._atomic(get)

    def batches(self, limit: int = 100) -> list[Batch]:
        """The batches soonest due first, for ``workerpool batch list``."""
        return self._atomic(lambda tx: [_counted(tx, batch) for batch in tx.batches(limit)])

    def pending_children(self, batch_id: str, limit: int = 100) -> list[str]:
        """Job ids of the batch's children with no final outcome yet, for the dashboard."""
        return self._atomic(lambda tx: tx.children(batch_id, PENDING, limit))

    @abstractmethod
    def purge(self) -> None:
        """Delete the batches kept past ``KEPT_AFTER_DEADLINE``, where the backend does it
        itself (SQLite; Firestore leaves it to a TTL policy)."""

    @abstractmethod
    def close(self) -> None: ...

    def _complete_if_done(self, batch_id: str) -> Completion | None:
        def check(tx: Transaction) -> Completion | None:
            batch = tx.batch(batch_id)
            if batch is None or batch.finalized_by or not batch.committed:
                return None
            return None if tx.tally(batch).pending else self._finalize(tx, batch, LAST_CHILD)

        return self._atomic(check)

    def _unsent(self, tx: Transaction, batch: Batch | None) -> Completion | None:
        return self._built(tx, batch) if batch is not None and batch.unsent else None

    def _finalize(self, tx: Transaction, batch: Batch, by: str) -> Completion:
        tally = tx.tally(batch)
        batch = replace(batch, done=tally.done, failed=tally.failed, finalized_by=by)
        tx.put_batch(batch)
        return self._built(tx, batch)

    @staticmethod
    def _built(tx: Transaction, batch: Batch) -> Completion:
        # The counts say which lists are empty: a query spared (the emulator has no indexes:
        # a query there reads every child).
        failed = tx.children(batch.batch_id, FAILED, MAX_FAILED_IDS) if batch.failed else []
        pending = tx.children(batch.batch_id, PENDING, MAX_FAILED_IDS) if batch.pending else []
        # Counted, not read: a batch of 30,000 cancelled children read them all in the
        # transaction that finalized it, past its timeout, and never finalized.
        cancelled = tx.count_children(batch.batch_id, CANCELLED) if batch.failed else 0
        named = tx.children(batch.batch_id, CANCELLED, MAX_FAILED_IDS) if cancelled else []
        return Completion(batch, failed + pending, pending, named, cancelled)


def _counted(tx: Transaction, batch: Batch) -> Batch:
    """The record with its counts as of now: its tally's while it is open."""
    if batch.finalized_by:
        return batch
    tally = tx.tally(batch)
    return replace(batch, done=tally.done, failed=tally.failed)


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
