"""Firestore backend: one document per job id, shared by replicas on many hosts.

Atomicity comes from preconditioned writes (create-if-absent, or update/delete only if the
document's ``update_time`` is still the one we read): a lost race re-reads and decides again.
This is the optimistic form of a read-decide-write transaction; we do not use the library's
``Transaction`` because its begin/commit/rollback calls accept no timeout or retry (they keep
retrying UNAVAILABLE for 60 s), whereas every call here is bounded by ``timeout``.
Set a TTL policy on the ``expire_at`` field to have Firestore purge old records.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.api_core.retry import Retry, if_transient_error
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    DELETE,
    Change,
    IdempotencyStore,
    Mutation,
    Record,
    StoreUnavailable,
    T,
)

_UNAVAILABLE = (
    api_exceptions.ServiceUnavailable,
    api_exceptions.DeadlineExceeded,
    api_exceptions.RetryError,
    api_exceptions.InternalServerError,
    api_exceptions.TooManyRequests,
    api_exceptions.ResourceExhausted,
    api_exceptions.Unknown,
    auth_exceptions.TransportError,
    ConnectionError,
    TimeoutError,
)
# A write whose precondition failed: someone changed the document since we read it.
_LOST_RACE = (api_exceptions.Conflict, api_exceptions.FailedPrecondition, api_exceptions.NotFound)


class FirestoreStore(IdempotencyStore):
    """Records live in ``collection`` of ``project``'s default database.

    ``timeout`` bounds each whole operation (all reads, writes, retries and lost races).
    Document ids are SHA-256 hashes of the job id, because job ids may contain "/" or be
    longer than Firestore allows; the job id itself is kept in a field for people.
    """

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
        self._client = firestore.Client(project=project)
        self._collection = self._client.collection(collection)
        self._timeout = timeout

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        ref = self._collection.document(hashlib.sha256(job_id.encode()).hexdigest())
        deadline = time.monotonic() + self._timeout
        with _translated():
            while True:
                snapshot = ref.get(**self._call_options(deadline))
                record = _decode(snapshot.to_dict()) if snapshot.exists else None
                result, change = mutation(record, self._clock())
                try:
                    self._write(ref, snapshot, job_id, change, deadline)
                    return result
                except _LOST_RACE:
                    continue

    def _write(self, ref: Any, snapshot: Any, job_id: str, change: Change, deadline: float) -> None:
        if change is None:
            return
        options = self._call_options(deadline)
        if not snapshot.exists:
            if change != DELETE:
                ref.create(self._encode(job_id, change), **options)
            return
        precondition = self._client.write_option(last_update_time=snapshot.update_time)
        if change == DELETE:
            ref.delete(option=precondition, **options)
        else:
            ref.update(self._encode(job_id, change), option=precondition, **options)

    def _call_options(self, deadline: float) -> dict[str, Any]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreUnavailable(f"Firestore idempotency store: no answer in {self._timeout}s")
        retry = Retry(predicate=if_transient_error, initial=0.05, maximum=0.5, timeout=remaining)
        return {"retry": retry, "timeout": remaining}

    def _encode(self, job_id: str, record: Record) -> dict[str, Any]:
        expire_at = datetime.fromtimestamp(record.expire_at(self.retention), tz=UTC)
        return {
            "job_id": job_id,
            "owner": record.owner,
            "message_id": record.message_id,
            "until": float(record.until),
            "completed_at": None if record.completed_at is None else float(record.completed_at),
            "expire_at": expire_at,
        }

    def close(self) -> None:
        # The public client has no close(); closing the gRPC channel frees its sockets and
        # threads now rather than at garbage collection.
        api = getattr(self._client, "_firestore_api_internal", None)
        if api is not None:
            api.transport.close()


def _decode(data: dict[str, Any] | None) -> Record:
    assert data is not None
    completed_at = data.get("completed_at")
    return Record(
        owner=data["owner"],
        message_id=data["message_id"],
        until=float(data["until"]),
        completed_at=None if completed_at is None else float(completed_at),
    )


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(f"Firestore idempotency store: {exc}") from exc
