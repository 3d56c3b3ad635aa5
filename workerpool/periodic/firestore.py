"""The marks of a fleet on many hosts, in Firestore: one document per (schedule, tick) in the
collection ``<COLLECTION>-periodic`` beside the idempotency store's, and one per paused (or
resumed) schedule in ``<COLLECTION>-periodic-pauses``.

Marking a tick is one ``create()``, whose precondition is that the document does not exist:
of the workers marking one tick, one creates it and the others are told it exists. Taking an
unpublished mark over reads it and updates it preconditioned on its ``update_time``. A mark's
``key`` field, the schedule and the zero-padded tick, sorts a schedule's marks by tick, so
every query is a range on that one field or an equality on ``state``, which Firestore's
automatic single-field indexes serve: no composite index is needed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from workerpool.periodic.marks import NOT_RUN, PUBLISHED, UNPUBLISHED, Mark, Marks, Pause, Tick
from workerpool.stores.firestore import call_options, close_client, new_client, translated

_LABEL = "periodic ticks"
_BATCH = 500  # the most writes a batch holds


def _key(schedule: str, tick: float) -> str:
    """Sorts a schedule's marks by tick (ticks are positive, below 10^13 s)."""
    return f"{schedule}\0{tick:017.3f}"


class FirestoreMarks(Marks):
    """``timeout`` bounds each call (all its reads, writes and retries)."""

    def __init__(self, project: str, collection: str, *, timeout: float = 5.0) -> None:
        self._client = new_client(project, _LABEL)
        self._marks = self._client.collection(f"{collection}-periodic")
        self._pauses = self._client.collection(f"{collection}-periodic-pauses")
        self._timeout = timeout

    def _options(self) -> dict[str, Any]:
        return call_options(time.monotonic() + self._timeout, self._timeout, _LABEL)

    def _translated(self) -> AbstractContextManager[None]:
        return translated(_LABEL)

    def _ref(self, schedule: str, tick: float) -> Any:
        return self._marks.document(hashlib.sha256(_key(schedule, tick).encode()).hexdigest())

    def mark_many(self, ticks: Sequence[Tick], now: float) -> list[bool]:
        # One create() each: a batch is all or nothing, and a tick marked by another worker
        # must not undo this worker's other marks.
        return [self._mark(schedule, tick, now) for schedule, tick in ticks]

    def _mark(self, schedule: str, tick: float, now: float) -> bool:
        data = {"key": _key(schedule, tick), "schedule": schedule, "tick": tick,
                "marked_at": now, "state": UNPUBLISHED}  # fmt: skip
        with self._translated():
            try:
                self._ref(schedule, tick).create(data, **self._options())
            except api_exceptions.Conflict:  # (AlreadyExists): another worker marked it
                return False
        return True

    def take_over(self, mark: Mark, now: float) -> bool:
        ref = self._ref(mark.schedule, mark.tick)
        with self._translated():
            snapshot = ref.get(**self._options())
            data = snapshot.to_dict() if snapshot.exists else None
            if not data or (data["marked_at"], data["state"]) != (mark.marked_at, UNPUBLISHED):
                return False
            option = self._client.write_option(last_update_time=snapshot.update_time)
            try:
                ref.update({"marked_at": now}, option=option, **self._options())
            except (api_exceptions.FailedPrecondition, api_exceptions.NotFound):
                return False  # another worker took it over first
        return True

    def published_many(
        self, ticks: Sequence[Tick], forget_before: Mapping[str, float], state: int = PUBLISHED
    ) -> None:
        with self._translated():
            for start in range(0, len(ticks), _BATCH):
                refs = [self._ref(*tick) for tick in ticks[start : start + _BATCH]]
                try:
                    self._write(refs, lambda batch, ref: batch.update(ref, {"state": state}))
                except api_exceptions.NotFound:  # one forgotten meanwhile: the others alone
                    for ref in refs:
                        with suppress(api_exceptions.NotFound):
                            ref.update({"state": state}, **self._options())
            for schedule, before in forget_before.items():
                old = [doc.reference for doc in self._range(schedule, _key(schedule, before))
                       if doc.get("state") != UNPUBLISHED]  # fmt: skip
                for start in range(0, len(old), _BATCH):
                    self._write(old[start : start + _BATCH], lambda batch, ref: batch.delete(ref))

    def _write(self, refs: list[Any], write: Callable[[Any, Any], object]) -> None:
        """One batch of ``write(batch, ref)`` for each of ``refs``."""
        batch = self._client.batch()
        for ref in refs:
            write(batch, ref)
        batch.commit(**self._options())

    def last_run(self, schedule: str, before: float) -> Mark | None:
        with self._translated():
            for doc in self._range(schedule, _key(schedule, before), newest_first=True):
                if doc.get("state") not in NOT_RUN:
                    return Mark(schedule, float(doc.get("tick")), float(doc.get("marked_at")))
        return None

    def unpublished(self, marked_before: float) -> list[Mark]:
        query = self._marks.where(filter=FieldFilter("state", "==", UNPUBLISHED))
        with self._translated():
            found = [doc.to_dict() or {} for doc in query.stream(**self._options())]
        return [
            Mark(d["schedule"], float(d["tick"]), float(d["marked_at"]))
            for d in found
            if d["marked_at"] < marked_before
        ]

    def latest(self, schedule: str) -> tuple[float, int] | None:
        with self._translated():
            for doc in self._range(schedule, schedule + "\1", newest_first=True, limit=1):
                return float(doc.get("tick")), int(doc.get("state"))
        return None

    def _range(
        self, schedule: str, below: str, *, newest_first: bool = False, limit: int = 0
    ) -> Iterator[Any]:
        """The schedule's marks whose key sorts below ``below``, by tick."""
        query = (
            self._marks.where(filter=FieldFilter("key", ">=", schedule + "\0"))
            .where(filter=FieldFilter("key", "<", below))
            .order_by("key", direction=firestore.Query.DESCENDING if newest_first else "ASCENDING")
        )
        if limit:
            query = query.limit(limit)
        return iter(query.stream(**self._options()))

    def pause(self, schedule: str, paused: bool, now: float) -> None:
        doc = self._pauses.document(hashlib.sha256(schedule.encode()).hexdigest())
        with self._translated():
            doc.set({"schedule": schedule, "paused": paused, "since": now}, **self._options())

    def pauses(self) -> dict[str, Pause]:
        with self._translated():
            found = [doc.to_dict() or {} for doc in self._pauses.stream(**self._options())]
        return {d["schedule"]: Pause(bool(d["paused"]), float(d["since"])) for d in found}

    def close(self) -> None:
        close_client(self._client)
