"""One atomic read-decide-write of a Firestore document, bounded in time, with the backend's
errors translated to ``StoreError`` / ``StoreUnavailable``.

Atomicity comes from preconditioned writes (create-if-absent, or update/delete only if the
document's ``update_time`` is still the one we read): a lost race re-reads and decides again.
This is the optimistic form of a read-decide-write transaction; we do not use the library's
``Transaction`` because its begin/commit/rollback calls accept no timeout or retry (they keep
retrying UNAVAILABLE for 60 s), whereas every call here is bounded by ``timeout``.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, Literal, TypeVar, cast

from google.api_core import exceptions as api_exceptions
from google.api_core.retry import Retry, if_transient_error
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from workerpool.stores import StoreError, StoreUnavailable

T = TypeVar("T")

DELETE: Final = "delete"
# What a decision does to the document: None keeps it, DELETE removes it, a dict replaces it.
DocChange = dict[str, Any] | Literal["delete"] | None
# Given the document's data (None if absent), what to return and how to change it.
Decision = Callable[[dict[str, Any] | None], tuple[T, DocChange]]

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
# After a lost race, wait up to this long (doubling to _MAX_PAUSE) before reading again.
_FIRST_PAUSE = 0.01
_MAX_PAUSE = 0.2
# A write whose precondition failed: someone changed the document since we read it.
_LOST_RACE = (api_exceptions.Conflict, api_exceptions.FailedPrecondition, api_exceptions.NotFound)


class Documents:
    """The documents of one collection, each named by the SHA-256 of a key (keys may contain
    "/" or be longer than Firestore allows). ``timeout`` bounds each whole ``mutate``: all its
    reads, writes, retries and lost races."""

    def __init__(self, project: str, collection: str, *, timeout: float, label: str) -> None:
        self._client = firestore.Client(project=project)
        self._collection = self._client.collection(collection)
        self._timeout = timeout
        self._label = label

    def mutate(self, key: str, decide: Decision[T]) -> T:
        ref = self._collection.document(hashlib.sha256(key.encode()).hexdigest())
        deadline = time.monotonic() + self._timeout
        pause = _FIRST_PAUSE
        with self._translated():
            while True:
                snapshot = ref.get(**self._call_options(deadline))
                result, change = decide(snapshot.to_dict() if snapshot.exists else None)
                try:
                    self._write(ref, snapshot, change, deadline)
                    return result
                except _LOST_RACE:
                    # Writers of one hot document that all re-read at once lose again
                    # together (a livelock, measured on the emulator): spread them out.
                    time.sleep(random.uniform(0, pause))
                    pause = min(pause * 2, _MAX_PAUSE)

    def mutate_many(self, items: Sequence[tuple[str, Decision[T]]]) -> list[T]:
        """Side by side, on daemon threads: many documents cost one round trip and one
        ``timeout`` at most, not one each (a stalled Firestore would otherwise hold a drain
        for ``timeout`` per document). Raises the first failure."""
        if len(items) == 1:
            return [self.mutate(*items[0])]
        results: list[T | BaseException | None] = [None] * len(items)

        def one(index: int, key: str, decide: Decision[T]) -> None:
            try:
                results[index] = self.mutate(key, decide)
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
            raise StoreUnavailable(f"Firestore {self._label}: no answer in {self._timeout}s")
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return cast(list[T], results)

    def keys(self, prefix: str) -> list[str]:
        """The ``key`` fields starting with ``prefix`` (documents that keep their key there)."""
        deadline = time.monotonic() + self._timeout
        query = self._collection.where(filter=FieldFilter("key", ">=", prefix))
        if prefix:
            query = query.where(filter=FieldFilter("key", "<", prefix + "\U0010ffff"))
        with self._translated():
            found = [doc.get("key") for doc in query.stream(**self._call_options(deadline))]
        return sorted(key for key in found if isinstance(key, str))

    def _write(self, ref: Any, snapshot: Any, change: DocChange, deadline: float) -> None:
        if change is None:
            return
        options = self._call_options(deadline)
        if not snapshot.exists:
            if change != DELETE:
                ref.create(change, **options)
            return
        precondition = self._client.write_option(last_update_time=snapshot.update_time)
        if change == DELETE:
            ref.delete(option=precondition, **options)
        else:
            ref.update(change, option=precondition, **options)

    def _call_options(self, deadline: float) -> dict[str, Any]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreUnavailable(f"Firestore {self._label}: no answer in {self._timeout}s")
        retry = Retry(predicate=if_transient_error, initial=0.05, maximum=0.5, timeout=remaining)
        return {"retry": retry, "timeout": remaining}

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"Firestore {self._label}: {exc}") from exc
        except _FAILED as exc:
            raise StoreError(f"Firestore {self._label}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        # The public client has no close(); closing the gRPC channel frees its sockets and
        # threads now rather than at garbage collection.
        api = getattr(self._client, "_firestore_api_internal", None)
        if api is not None:
            api.transport.close()
