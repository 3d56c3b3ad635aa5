"""The batches of a fleet, in Firestore, in the collection ``<COLLECTION>-batches`` beside the
idempotency store's: a document per batch record, and under it its ledger (``children``, a
document per child: its job id and outcome) and its tallies (``tallies``, up to ``TALLIES``
documents: a child is counted in the one its job id hashes to).

A child's outcome and its tally go out in one atomic commit, each preconditioned on being as
read (``workerpool.stores.firestore_tx``): two deliveries of one child race on its ledger
document and one wins, so a tally always counts each of its children's outcomes once. The
writes of a batch's children spread over its tallies instead of all rewriting one document
(a document sustains about one write per second in production; what the emulator showed is
in docs/guide/batches.md). The batch
record itself is written a handful of times: created, committed, finalized, its completion
sent. Finalizing writes the record and closes every tally in one commit, preconditioned on
all of them as read, so no child's outcome lands between the counts and the completion.

The record and every child carry ``expire_at``, ``KEPT_AFTER_DEADLINE`` past the batch's
deadline: set a TTL policy on that field for the collection groups ``<COLLECTION>-batches``
and ``children`` to have Firestore delete them. The tallies (32 small documents at most) carry
none: a worker of an earlier release, in a rolling deploy, would fail to read them.

A batch is created children first, in commits of 500 (not atomic: they count for nothing
until their tallies exist), then the record and its tallies in one commit. A creation that
failed part-way leaves its children in the ledger: a second creation of the id is the same
batch by the digest of its children the record keeps, never by finding them there.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from google.cloud.firestore_v1.base_query import FieldFilter

from workerpool.batches.store import PENDING, Batch, BatchStore, T, Tally, Transaction
from workerpool.stores import known_fields
from workerpool.stores.firestore_tx import MAX_WRITES, Atomic, Data, Tx

TALLIES = 32


def _key(text: str) -> str:
    """A document id for any text (ids may contain "/", or be longer than Firestore allows)."""
    return hashlib.sha256(text.encode()).hexdigest()


def tally_of(job_id: str) -> int:
    return int(_key(job_id)[:8], 16) % TALLIES


def _expire_at(batch: Batch) -> datetime:
    """When a TTL policy may delete the batch's documents: each carries it from its creation
    (an outcome's write sets only its own fields)."""
    return datetime.fromtimestamp(batch.expire_at, tz=UTC)


class _Docs:
    """The ``Transaction`` of one attempt."""

    def __init__(self, tx: Tx, firestore: Atomic, collection: Any) -> None:
        self._tx = tx
        self._firestore = firestore
        self._collection = collection
        self._tallies: dict[str, list[int]] = {}  # the tallies of each batch read or created
        self._final: set[str] = set()  # the batches final when read

    def _ref(self, batch_id: str) -> Any:
        return self._collection.document(_key(batch_id))

    def _tally_refs(self, batch_id: str) -> list[Any]:
        tallies = self._ref(batch_id).collection("tallies")
        return [tallies.document(str(i)) for i in self._tallies[batch_id]]

    def _learnt(self, data: Data) -> Batch:
        # A field the record lacks (written by an older workerpool) takes its default.
        batch = known_fields(Batch, data)
        self._tallies[batch.batch_id] = list(data["tallies"])
        if batch.finalized_by:
            self._final.add(batch.batch_id)
        return batch

    def batch(self, batch_id: str) -> Batch | None:
        [data] = self._tx.read([self._ref(batch_id)])
        return None if data is None else self._learnt(data)

    def put_batch(self, batch: Batch) -> None:
        batch_id = batch.batch_id
        # "unsent" is what a worker starting queries for (a single-field index: no setup).
        record = {
            **asdict(batch), "tallies": self._tallies[batch_id], "unsent": batch.unsent,
            "expire_at": _expire_at(batch),
        }  # fmt: skip
        self._tx.write(self._ref(batch_id), record)
        if batch.finalized_by and batch_id not in self._final:
            # Finalized here: close its tallies, as they were counted (read by tally()).
            refs = self._tally_refs(batch_id)
            for ref, data in zip(refs, self._tx.read(refs), strict=True):
                if data is not None:
                    self._tx.write(ref, {**data, "final": True})

    def batches(self, limit: int) -> list[Batch]:
        return self._soonest_first(self._collection.order_by("deadline").limit(limit))

    def unsent(self, limit: int) -> list[Batch]:
        query = self._collection.where(filter=FieldFilter("unsent", "==", True))
        return self._soonest_first(query.limit(limit))

    def _soonest_first(self, query: Any) -> list[Batch]:
        found = self._tx.query(query)
        return sorted((self._learnt(d) for _, d in found), key=lambda b: (b.deadline, b.batch_id))

    def child(self, batch_id: str, job_id: str) -> tuple[str, Tally] | None:
        ref = self._ref(batch_id)
        child, tally = self._tx.read(
            [
                ref.collection("children").document(_key(job_id)),
                ref.collection("tallies").document(str(tally_of(job_id))),
            ]
        )
        # A child without its tally belongs to a batch whose creation has not finished.
        if child is None or tally is None:
            return None
        return child["outcome"], known_fields(Tally, tally)

    def put_child(self, batch_id: str, job_id: str, outcome: str, tally: Tally) -> None:
        ref = self._ref(batch_id)
        child = ref.collection("children").document(_key(job_id))
        self._tx.write(child, {"job_id": job_id, "outcome": outcome})
        self._tx.write(ref.collection("tallies").document(str(tally_of(job_id))), asdict(tally))

    def tally(self, batch: Batch) -> Tally:
        found = self._tx.read(self._tally_refs(batch.batch_id))
        counted = [known_fields(Tally, data) for data in found if data is not None]
        return sum(counted, Tally(0, final=bool(batch.finalized_by)))

    def add_children(self, batch: Batch, job_ids: Sequence[str]) -> None:
        batch_id, expire_at = batch.batch_id, _expire_at(batch)
        children = self._ref(batch_id).collection("children")
        pending = [
            (children.document(_key(j)), {"job_id": j, "outcome": PENDING, "expire_at": expire_at})
            for j in job_ids
        ]
        self._firestore.put_all(pending, MAX_WRITES)
        totals = Counter(tally_of(job_id) for job_id in job_ids)
        self._tallies[batch_id] = sorted(totals)
        refs = self._tally_refs(batch_id)
        # Read first: tallies left by a batch of this id gone to a TTL policy (its record
        # and children carry expire_at, its tallies not) are written over, not created.
        self._tx.read(refs)
        for ref, i in zip(refs, self._tallies[batch_id], strict=True):
            self._tx.write(ref, asdict(Tally(totals[i])))

    def has_children(self, batch_id: str, job_ids: Sequence[str]) -> bool:
        children = self._ref(batch_id).collection("children")
        found = self._tx.read([children.document(_key(job_id)) for job_id in job_ids])
        return all(data is not None for data in found)

    def children(self, batch_id: str, outcome: str, limit: int) -> list[str]:
        """In Firestore's order (by document name) up to ``limit``, then sorted: ordering by
        job id would need a composite index."""
        query = self._ref(batch_id).collection("children")
        found = self._tx.query(
            query.where(filter=FieldFilter("outcome", "==", outcome)).limit(limit)
        )
        return sorted(d["job_id"] for _, d in found)

    def count_children(self, batch_id: str, outcome: str) -> int:
        query = self._ref(batch_id).collection("children")
        return self._tx.count(query.where(filter=FieldFilter("outcome", "==", outcome)))


class FirestoreBatches(BatchStore):
    """``timeout`` bounds each call (all its reads, writes and lost races), and each commit
    of 500 children when a batch is created."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._firestore = Atomic(project, timeout=timeout, label="batch store")
        self._collection = self._firestore.client.collection(collection)

    def _atomic(self, body: Callable[[Transaction], T]) -> T:
        return self._firestore.run(lambda tx: body(_Docs(tx, self._firestore, self._collection)))

    def purge(self) -> None:
        pass  # a TTL policy on expire_at does (see the module)

    def close(self) -> None:
        self._firestore.close()
