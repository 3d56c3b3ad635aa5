"""Atomic read-decide-write over several Firestore documents, bounded in time (the schedule and
the batches; ``workerpool.stores.firestore`` does it for one document at a time).

``Atomic.run(body)`` calls ``body(tx)``: the body reads documents and queries through ``tx``
(each document's ``update_time`` is remembered) and writes through it (the writes wait); then
they go out in one atomic commit, each preconditioned on its document being as the body read
it (absent, for one it did not read). A lost race runs the body again on fresh reads after a
jittered pause, until ``timeout``. This is the optimistic form of a transaction, for the reason
``workerpool.stores.firestore`` gives; a document the body reads but does not write is not
checked at commit, so a decision that must not outlive a change to a document writes it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from google.api_core import exceptions as api_exceptions

from workerpool.stores import StoreUnavailable
from workerpool.stores.firestore import (
    FIRST_PAUSE,
    LOST_RACE,
    after_lost_race,
    call_options,
    close_client,
    new_client,
    translated,
)

T = TypeVar("T")
Data = dict[str, Any]
# Writes per commit of ``put_all`` at most: Firestore takes 500.
MAX_WRITES = 500


class Tx:
    """One attempt of a body: its reads, remembered, and its writes, waiting for the commit."""

    def __init__(self, atomic: Atomic, deadline: float) -> None:
        self._atomic = atomic
        self._deadline = deadline
        self._read: dict[str, datetime | None] = {}  # path -> update_time (None: absent)
        self._cache: dict[str, Data | None] = {}
        self._writes: dict[str, tuple[Any, Data | None]] = {}

    def read(self, refs: Sequence[Any]) -> list[Data | None]:
        """The documents' data (None: absent), in one round trip for those not read yet."""
        wanted = [ref for ref in refs if ref.path not in self._cache]
        if wanted:
            with translated(self._atomic.label):
                found = self._atomic.client.get_all(wanted, **self._options())
                for snapshot in found:  # in any order
                    self._learn(snapshot.reference.path, snapshot)
        return [self._cache[ref.path] for ref in refs]

    def query(self, query: Any) -> list[tuple[Any, Data]]:
        """The documents ``query`` finds: (reference, data) each."""
        with translated(self._atomic.label):
            found = list(query.stream(**self._options()))
        for snapshot in found:
            self._learn(snapshot.reference.path, snapshot)
        return [(snapshot.reference, snapshot.to_dict()) for snapshot in found]

    def count(self, query: Any) -> int:
        """How many documents ``query`` finds, counted by Firestore (an aggregation: none of
        them is read, and none is checked at the commit)."""
        with translated(self._atomic.label):
            [[result]] = query.count().get(**self._options())
        return int(result.value)

    def write(self, ref: Any, data: Data | None) -> None:
        """At the commit, if the document is still as read here: set the fields of ``data``
        (its other fields stay; one absent, or not read, is created with these), or delete it
        (None)."""
        self._writes[ref.path] = (ref, data)

    def _learn(self, path: str, snapshot: Any) -> None:
        self._read[path] = snapshot.update_time if snapshot.exists else None
        self._cache[path] = snapshot.to_dict() if snapshot.exists else None

    def _options(self) -> dict[str, Any]:
        return call_options(self._deadline, self._atomic.timeout, self._atomic.label)

    def _commit(self) -> None:
        """Raises one of ``LOST_RACE`` when a document changed since it was read."""
        if not self._writes:
            return
        client, batch = self._atomic.client, self._atomic.client.batch()
        for path, (ref, data) in self._writes.items():
            update_time = self._read.get(path)
            if update_time is None:  # absent when read, or not read: it must be absent now
                if data is not None:
                    batch.create(ref, data)
                continue
            option = client.write_option(last_update_time=update_time)
            if data is None:
                batch.delete(ref, option=option)
            else:
                batch.update(ref, data, option=option)
        batch.commit(**self._options())


class Atomic:
    """A client of ``project``'s default database; every call is bounded by ``timeout``."""

    def __init__(self, project: str, *, timeout: float, label: str) -> None:
        self.client = new_client(project, label)
        self.timeout = timeout
        self.label = label

    def run(self, body: Callable[[Tx], T]) -> T:
        """``body``'s result once its writes are committed (see the module). Exceptions the
        body raises itself pass through; the backend's are ``StoreError``s."""
        deadline = time.monotonic() + self.timeout
        pause = FIRST_PAUSE
        while True:
            tx = Tx(self, deadline)
            result = body(tx)
            with translated(self.label):
                try:
                    tx._commit()
                    return result
                except LOST_RACE:
                    pass
            if time.monotonic() >= deadline:
                raise StoreUnavailable(f"Firestore {self.label}: no answer in {self.timeout}s")
            pause = after_lost_race(pause)

    def read(self, refs: Sequence[Any], fields: Sequence[str]) -> list[Data | None]:
        """Only ``fields`` of the documents (None: absent), in their order, in one round trip."""
        options = call_options(time.monotonic() + self.timeout, self.timeout, self.label)
        with translated(self.label):
            found = {
                snapshot.reference.path: snapshot.to_dict() if snapshot.exists else None
                for snapshot in self.client.get_all(list(refs), field_paths=list(fields), **options)
            }
        return [found[ref.path] for ref in refs]

    def create(self, ref: Any, data: Data) -> bool:
        """Create the document unless it exists; whether it was created."""
        options = call_options(time.monotonic() + self.timeout, self.timeout, self.label)
        with translated(self.label):
            try:
                ref.create(data, **options)
            except api_exceptions.AlreadyExists:
                return False
        return True

    def put_all(self, writes: Sequence[tuple[Any, Data | None]], per_commit: int) -> None:
        """Set (or delete: None) documents no decision depends on, ``per_commit`` to a commit
        (each commit bounded by ``timeout``): not atomic as a whole."""
        for start in range(0, len(writes), per_commit):
            batch = self.client.batch()
            for ref, data in writes[start : start + per_commit]:
                if data is None:
                    batch.delete(ref)
                else:
                    batch.set(ref, data)
            options = call_options(time.monotonic() + self.timeout, self.timeout, self.label)
            with translated(self.label):
                batch.commit(**options)

    def close(self) -> None:
        close_client(self.client)
