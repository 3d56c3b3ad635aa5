"""The schedule of a fleet, in Firestore: one document per (topic, job id) in the collection
``<COLLECTION>-schedule`` beside the idempotency store's.

A claim queries the topic's entries ready now, oldest first, and moves their ``ready_at``
past the lease in one atomic commit, each preconditioned on its document being as the query
found it: of two workers claiming at once, one commits and the other reads again
(``workerpool.stores.firestore_tx``), so no entry is claimed twice. Before that, one cheap read
of the soonest ``ready_at`` (that field only) answers the wakes that find nothing due.

A document holds 1 MiB at most and a Pub/Sub message up to 10 MB: data that does not fit in
the entry's document is kept in parts, documents under it written before it (named by an
upload id of their own, so a duplicate that lost the race to schedule removes only its own
parts), read with the claim and removed with the entry.

The claim's query (``topic ==``, ordered by ``ready_at``) and ``schedule list --topic``
(``topic ==``, ordered by ``due``) need composite indexes on a real project (see
docs/guide/delayed-jobs.md; the emulator needs none).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

from google.cloud.firestore_v1.base_query import FieldFilter

from workerpool.schedule.store import Entry, ScheduleStore
from workerpool.stores import StoreError
from workerpool.stores.firestore_tx import MAX_WRITES, Atomic, Data, Tx

# Bytes of data and attributes kept in the entry's own document (the limit, 1 MiB, also
# counts its name and other fields); the rest goes to parts of this size.
_INLINE = 1_000_000
_PART = 1_000_000
_PARTS_PER_COMMIT = 8  # a commit carries 10 MiB at most


class FirestoreSchedule(ScheduleStore):
    """``timeout`` bounds each call (all its reads, writes and lost races)."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._firestore = Atomic(project, timeout=timeout, label="schedule")
        self._docs = self._firestore.client.collection(collection)

    def _ref(self, topic: str, job_id: str) -> Any:
        return self._docs.document(hashlib.sha256(f"{topic}\0{job_id}".encode()).hexdigest())

    def add(self, entry: Entry) -> bool:
        ref = self._ref(entry.topic, entry.job_id)
        attributes = json.dumps(entry.attributes)
        data, parts = entry.data, []
        if len(data) + len(attributes) > _INLINE:
            upload = uuid.uuid4().hex
            parts = [
                (ref.collection("parts").document(f"{upload}-{i}"), {"data": data[at : at + _PART]})
                for i, at in enumerate(range(0, len(data), _PART))
            ]
            self._firestore.put_all(parts, _PARTS_PER_COMMIT)
            data = b""
        document = {
            "topic": entry.topic, "job_id": entry.job_id, "due": entry.due,
            "ready_at": entry.due, "attributes": attributes, "data": data,
            "parts": [part.id for part, _ in parts],
        }  # fmt: skip
        if self._firestore.create(ref, document):
            return True
        self._firestore.put_all([(part, None) for part, _ in parts], MAX_WRITES)
        return False

    def claim_due(
        self, topic: str, now: float, lease: float, limit: int
    ) -> tuple[list[Entry], float | None]:
        next_ready = self._soonest(topic)
        if next_ready is None or next_ready > now:
            return [], next_ready
        due = self._of(topic).where(filter=FieldFilter("ready_at", "<=", now))

        def claim(tx: Tx) -> list[Data]:
            found = tx.query(due.order_by("ready_at").limit(limit))
            for ref, _ in found:
                tx.write(ref, {"ready_at": now + lease})
            return [data for _, data in found]

        claimed = self._whole(self._firestore.run(claim))
        return claimed, self._soonest(topic)

    def _of(self, topic: str) -> Any:
        return self._docs.where(filter=FieldFilter("topic", "==", topic))

    def _soonest(self, topic: str) -> float | None:
        """The soonest ``ready_at`` of the topic's entries (None: it has none)."""
        query = self._of(topic).order_by("ready_at").limit(1).select(["ready_at"])
        found = self._firestore.run(lambda tx: tx.query(query))
        return float(found[0][1]["ready_at"]) if found else None

    def _parts(self, document: Data) -> list[Any]:
        entry = self._ref(document["topic"], document["job_id"])
        return [entry.collection("parts").document(part) for part in document["parts"]]

    def _whole(self, documents: list[Data]) -> list[Entry]:
        """The entries, the data of each put together from its parts."""
        refs = [ref for document in documents for ref in self._parts(document)]
        found = self._firestore.run(lambda tx: tx.read(refs))
        parts = {ref.path: part for ref, part in zip(refs, found, strict=True)}
        entries = []
        for d in documents:
            chunks = [parts[ref.path] for ref in self._parts(d)]
            if None in chunks:
                raise StoreError(f"Firestore schedule: {d['job_id']} lost a part of its data")
            data = d["data"] + b"".join(chunk["data"] for chunk in chunks if chunk is not None)
            attributes = json.loads(d["attributes"])
            entries.append(Entry(d["topic"], d["job_id"], float(d["due"]), data, attributes))
        return entries

    def fired(self, topic: str, job_ids: Sequence[str]) -> None:
        refs = [self._ref(topic, job_id) for job_id in job_ids]
        found = self._firestore.read(refs, ["topic", "job_id", "parts"])
        parts = [ref for document in found if document for ref in self._parts(document)]
        self._firestore.put_all([(ref, None) for ref in [*refs, *parts]], MAX_WRITES)

    def entries(self, topic: str | None = None, limit: int = 100) -> list[Entry]:
        query = (self._docs if topic is None else self._of(topic)).order_by("due").limit(limit)
        found = self._firestore.run(lambda tx: tx.query(query))
        return sorted(self._whole([d for _, d in found]), key=lambda e: (e.due, e.job_id))

    def close(self) -> None:
        self._firestore.close()
