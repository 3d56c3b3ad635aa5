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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, cast

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
    StoreError,
    StoreUnavailable,
    T,
)

# Worth trying again later: the service is down, slow, overloaded, or gave up on a conflict.
_UNAVAILABLE = (
    api_exceptions.ServiceUnavailable,
    api_exceptions.DeadlineExceeded,
    api_exceptions.RetryError,
    api_exceptions.InternalServerError,
    api_exceptions.TooManyRequests,
    api_exceptions.ResourceExhausted,
    api_exceptions.Unknown,
    api_exceptions.Aborted,
    api_exceptions.Cancelled,
    auth_exceptions.TransportError,
    ConnectionError,
    TimeoutError,
)
# Not soon better: PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT, bad credentials, or
# a closed channel (gRPC's ValueError "Cannot invoke RPC on closed channel!").
_FAILED = (api_exceptions.GoogleAPICallError, auth_exceptions.GoogleAuthError, ValueError)
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

    def _mutate_many(self, items: Sequence[tuple[str, Mutation[T]]]) -> list[T]:
        """Side by side, on daemon threads: renewing or releasing many claims costs one round
        trip and one ``timeout`` at most, not one per claim (a stalled Firestore would
        otherwise hold a drain for ``timeout`` per claim)."""
        if len(items) == 1:
            return [self._mutate(*items[0])]
        results: list[T | BaseException | None] = [None] * len(items)

        def one(index: int, job_id: str, mutation: Mutation[T]) -> None:
            try:
                results[index] = self._mutate(job_id, mutation)
            except BaseException as exc:
                results[index] = exc

        threads = [
            threading.Thread(target=one, args=(i, *item), daemon=True)
            for i, item in enumerate(items)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self._timeout + 1.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            raise StoreUnavailable(f"Firestore idempotency store: no answer in {self._timeout}s")
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return cast(list[T], results)

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
    except _FAILED as exc:
        raise StoreError(f"Firestore idempotency store: {type(exc).__name__}: {exc}") from exc
