"""One atomic read-decide-write of a Firestore document, bounded in time, with the backend's
errors translated to ``StoreError`` / ``StoreUnavailable``.

Atomicity comes from preconditioned writes (create-if-absent, or update/delete only if the
document's ``update_time`` is still the one we read): a lost race re-reads and decides again.
This is the optimistic form of a read-decide-write transaction; we do not use the library's
``Transaction`` because its begin/commit/rollback calls accept no timeout or retry (they keep
retrying UNAVAILABLE for 60 s), whereas every call here is bounded by ``timeout``.

A document that is asked about often (a busy key's waiters poll it) is watched: a real-time
listener keeps a copy of it, so a decision starts from the copy instead of a read. The copy is
at most a push behind (milliseconds); a write decided on an older one fails its precondition
like any lost race, so only a decision that changes nothing can be told apart, and it is taken
from a copy only when the caller says a slightly old answer will do.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast

from google.api_core import exceptions as api_exceptions
from google.api_core.retry import Retry, if_transient_error
from google.auth import exceptions as auth_exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.base_query import FieldFilter

from workerpool.stores import StoreError, StoreUnavailable

T = TypeVar("T")

# What a decision does to the document: None keeps it, a dict replaces it.
DocChange = dict[str, Any] | None
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
FIRST_PAUSE = 0.01
_MAX_PAUSE = 0.2
# A write whose precondition failed: someone changed the document since we read it.
LOST_RACE = (api_exceptions.Conflict, api_exceptions.FailedPrecondition, api_exceptions.NotFound)
# A watched copy not confirmed (by a push, a read or a write of ours) for this long is not
# used: a listener's stream that stalled without failing must not hide changes for longer.
_TRUST = 1.0
# A watch nobody asked through for this long is closed (a key nobody waits for any more).
_WATCH_IDLE = 30.0


def call_options(deadline: float, timeout: float, label: str) -> dict[str, Any]:
    """A call's retry and timeout, bounded by what is left until ``deadline`` (monotonic)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise StoreUnavailable(f"Firestore {label}: no answer in {timeout}s")
    retry = Retry(predicate=if_transient_error, initial=0.05, maximum=0.5, timeout=remaining)
    return {"retry": retry, "timeout": remaining}


@contextmanager
def translated(label: str) -> Iterator[None]:
    """The backend's errors as ``StoreUnavailable`` / ``StoreError`` naming ``label``."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(f"Firestore {label}: {exc}") from exc
    except _FAILED as exc:
        raise StoreError(f"Firestore {label}: {type(exc).__name__}: {exc}") from exc


def after_lost_race(pause: float) -> float:
    """Wait a random part of ``pause`` before reading again; the next pause. Writers of one
    hot document that all re-read at once lose again together (a livelock, measured on the
    emulator): spread them out."""
    time.sleep(random.uniform(0, pause))
    return min(pause * 2, _MAX_PAUSE)


def new_client(project: str, label: str) -> Any:
    """A client of ``project``'s default database; no credentials (and no emulator) is a
    ``StoreError``, which a worker turns into one line naming the store, not a traceback."""
    with translated(label):
        return firestore.Client(project=project)


def close_client(client: Any) -> None:
    # The public client has no close(); closing the gRPC channel frees its sockets and
    # threads now rather than at garbage collection.
    api = getattr(client, "_firestore_api_internal", None)
    if api is not None:
        api.transport.close()


@dataclass(frozen=True)
class _State:
    """A document's data (None: absent) and ``update_time`` as of ``as_of`` (the service's
    clock), learnt at ``learnt`` (ours, monotonic)."""

    data: dict[str, Any] | None
    update_time: datetime | None
    as_of: datetime
    learnt: float


@dataclass(eq=False)
class _Ask:
    """One decision waiting to be written, then its outcome."""

    decide: Decision[Any]
    recent: bool
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Doc:
    """This process's decisions on one document not taken by a batch yet; the thread that
    holds ``writing`` takes them all."""

    writing: threading.Lock = field(default_factory=threading.Lock)
    asks: list[_Ask] = field(default_factory=list)
    users: int = 0


def _decided(
    batch: list[_Ask], data: dict[str, Any] | None
) -> tuple[list[tuple[Any, BaseException | None]], DocChange]:
    """Each ask's result (or its own error), deciding each on what the ones before it left,
    and the change they make together."""
    outcomes: list[tuple[Any, BaseException | None]] = []
    changed = False
    for ask in batch:
        try:
            result, change = ask.decide(data)
        except Exception as exc:  # that decision's own failure, not its batch's
            outcomes.append((None, exc))
            continue
        outcomes.append((result, None))
        if change is not None:
            changed = True
            data = change
    return outcomes, data if changed else None


@dataclass
class _Watched:
    watch: Any  # the library's Watch (untyped)
    used: float
    state: _State | None = None


class Documents:
    """The documents of one collection, each named by the SHA-256 of a key (keys may contain
    "/" or be longer than Firestore allows). ``timeout`` bounds each whole ``mutate``: all its
    reads, writes, retries and lost races."""

    def __init__(self, project: str, collection: str, *, timeout: float, label: str) -> None:
        self._client = new_client(project, label)
        self._collection = self._client.collection(collection)
        self._timeout = timeout
        self._label = label
        self._copies = _Copies()
        self._lock = threading.Lock()
        self._pending: dict[str, _Doc] = {}

    def mutate(self, key: str, decide: Decision[T], *, recent: bool = False) -> T:
        """Decide on the document and write the change. Decisions on one document made at
        once in this process are written together: each is decided on what the one before
        it left, and one write (or none) carries them all, so they never race each other.
        With ``recent``, the document is watched, and a decision that changes nothing may
        be made on the watch's copy (a change made a push ago, milliseconds, may not be
        seen yet), without waiting for a write in flight."""
        ref = self._ref(key)
        deadline = time.monotonic() + self._timeout
        with self._translated():
            copy = self._copies.get(ref, watch=recent)
            if recent and copy is not None:
                result, change = decide(copy.data)
                if change is None:
                    return result
            ask = _Ask(decide, recent)
            with self._joined(ref.id, ask) as doc:
                if doc.writing.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    try:
                        if not ask.done:
                            self._commit(ref, doc, deadline)
                    finally:
                        doc.writing.release()
            if not ask.done:  # still waiting behind another batch
                raise StoreUnavailable(f"Firestore {self._label}: no answer in {self._timeout}s")
            if ask.error is not None:
                raise ask.error
            return cast(T, ask.result)

    def _commit(self, ref: Any, doc: _Doc, deadline: float) -> None:
        """Decide every ask waiting on ``doc`` in turn and write the outcome once (asks that
        come while a lost race is tried again join it); each ask gets its result, or the
        error that stopped them all."""
        batch: list[_Ask] = []
        try:
            state = self._copies.get(ref, watch=False)
            copied = state is not None
            pause = FIRST_PAUSE
            while True:
                batch += self._taken(doc)
                if state is None:
                    state, copied = self._read(ref, deadline), False
                outcomes, change = _decided(batch, state.data)
                if change is None and copied and not all(ask.recent for ask in batch):
                    state = None  # only a read tells "nothing to change" for certain
                    continue
                try:
                    self._write(ref, state, change, deadline)
                    break
                except LOST_RACE:
                    pause = after_lost_race(pause)
                    state = None
        except BaseException as exc:
            outcomes = [(None, exc)] * len(batch)
        for ask, (result, error) in zip(batch, outcomes, strict=True):
            ask.result, ask.error, ask.done = result, error, True

    @contextmanager
    def _joined(self, doc_id: str, ask: _Ask) -> Iterator[_Doc]:
        with self._lock:
            doc = self._pending.setdefault(doc_id, _Doc())
            doc.users += 1
            doc.asks.append(ask)
        try:
            yield doc
        finally:
            with self._lock:
                doc.users -= 1
                if ask in doc.asks:  # gave up before any batch took it
                    doc.asks.remove(ask)
                if not doc.users:
                    del self._pending[doc_id]

    def _taken(self, doc: _Doc) -> list[_Ask]:
        with self._lock:
            batch, doc.asks = doc.asks, []
        return batch

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

    def put(self, key: str, data: dict[str, Any]) -> None:
        """Write the document whatever it holds: for a record only one writer ever changes
        (a replica's heartbeat), where a read to decide on would be a wasted round trip."""
        deadline = time.monotonic() + self._timeout
        with self._translated():
            self._ref(key).set(data, **self._call_options(deadline))

    def add(self, key: str, data: dict[str, Any], counter: str, count: int) -> None:
        """Add ``count`` to the document's ``counter`` field (0 if missing) and set ``data``:
        one write, no read, however many writers add to it at once."""
        deadline = time.monotonic() + self._timeout
        with self._translated():
            self._ref(key).set(
                {**data, counter: firestore.Increment(count)}, merge=True,
                **self._call_options(deadline),
            )  # fmt: skip

    def at_least(self, field_name: str, value: Any) -> list[dict[str, Any]]:
        """The data of the documents whose ``field_name`` is ``value`` or more."""
        deadline = time.monotonic() + self._timeout
        query = self._collection.where(filter=FieldFilter(field_name, ">=", value))
        with self._translated():
            return [doc.to_dict() or {} for doc in query.stream(**self._call_options(deadline))]

    def get(self, key: str) -> dict[str, Any] | None:
        """The document's data, None if there is none: one read, for a record only one
        writer changes (a job's checkpoint), so no copy is kept to decide on."""
        deadline = time.monotonic() + self._timeout
        with self._translated():
            snapshot = self._ref(key).get(**self._call_options(deadline))
        return snapshot.to_dict() if snapshot.exists else None

    def remove(self, key: str) -> None:
        deadline = time.monotonic() + self._timeout
        with self._translated():
            self._ref(key).delete(**self._call_options(deadline))

    def matching(self, field_name: str, value: Any) -> list[tuple[str, dict[str, Any]]]:
        """The documents whose ``field_name`` equals ``value``: (document id, data)."""
        deadline = time.monotonic() + self._timeout
        query = self._collection.where(filter=FieldFilter(field_name, "==", value))
        with self._translated():
            return [
                (doc.id, doc.to_dict() or {})
                for doc in query.stream(**self._call_options(deadline))
            ]

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The data of the documents of these keys that exist, by key: one round trip."""
        deadline = time.monotonic() + self._timeout
        by_id = {self._ref(key).id: key for key in keys}
        refs = [self._collection.document(doc_id) for doc_id in by_id]
        with self._translated():
            found = self._client.get_all(refs, **self._call_options(deadline))
            return {by_id[doc.id]: doc.to_dict() or {} for doc in found if doc.exists}

    def remove_ids(self, doc_ids: Sequence[str]) -> None:
        """Delete documents by id (as ``matching`` returned them), in one batch."""
        deadline = time.monotonic() + self._timeout
        batch = self._client.batch()
        for doc_id in doc_ids:
            batch.delete(self._collection.document(doc_id))
        with self._translated():
            batch.commit(**self._call_options(deadline))

    def _ref(self, key: str) -> Any:
        return self._collection.document(hashlib.sha256(key.encode()).hexdigest())

    def _read(self, ref: Any, deadline: float) -> _State:
        snapshot = ref.get(**self._call_options(deadline))
        data = snapshot.to_dict() if snapshot.exists else None
        state = _State(data, snapshot.update_time, snapshot.read_time, time.monotonic())
        self._copies.learn(ref, state)
        return state

    def _write(self, ref: Any, state: _State, change: DocChange, deadline: float) -> None:
        """Write ``change`` if the document is still as ``state`` says; a change names every
        field of the document, so the copy of a watched one is what we wrote."""
        if change is None:
            return
        options = self._call_options(deadline)
        if state.update_time is None:
            written = ref.create(change, **options).update_time
        else:
            precondition = self._client.write_option(last_update_time=state.update_time)
            written = ref.update(change, option=precondition, **options).update_time
        self._copies.learn(ref, _State(change, written, written, time.monotonic()))

    def _call_options(self, deadline: float) -> dict[str, Any]:
        return call_options(deadline, self._timeout, self._label)

    def _translated(self) -> AbstractContextManager[None]:
        return translated(self._label)

    def on_push(self, key: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the listener's thread) whenever a watched copy of the
        document learns of a change, made here or elsewhere."""
        self._copies.on_push(self._ref(key).id, callback)

    def close(self) -> None:
        self._copies.close()
        close_client(self._client)


class _Copies:
    """Copies of watched documents, each kept by a real-time listener (``on_snapshot``) and
    by our own reads and writes, whichever is newest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, _Watched] = {}
        self._callbacks: dict[str, list[Callable[[], None]]] = {}
        self._swept = time.monotonic()

    def get(self, ref: Any, *, watch: bool) -> _State | None:
        """The document's copy if it is trusted now; with ``watch``, start watching it."""
        now = time.monotonic()
        self._sweep(now)
        with self._lock:
            watched = self._watched.get(ref.id)
            if watched is not None and not watched.watch.is_active:
                del self._watched[ref.id]  # its stream ended for good: start another
                watched = None
            if watched is None:
                if watch:
                    self._watched[ref.id] = _Watched(self._listen(ref), now)
                return None
            if watch:
                watched.used = now
            state = watched.state
        return state if state is not None and now - state.learnt < _TRUST else None

    def learn(self, ref: Any, state: _State) -> None:
        with self._lock:
            watched = self._watched.get(ref.id)
            if watched is not None and (
                watched.state is None or state.as_of >= watched.state.as_of
            ):
                watched.state = state

    def on_push(self, doc_id: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.setdefault(doc_id, []).append(callback)

    def _listen(self, ref: Any) -> Any:
        def pushed(docs: list[Any], changes: Any, read_time: datetime) -> None:
            doc = docs[0] if docs else None
            if doc is not None and doc.exists:
                self.learn(ref, _State(doc.to_dict(), doc.update_time, read_time, time.monotonic()))
            else:
                self.learn(ref, _State(None, None, read_time, time.monotonic()))
            with self._lock:
                callbacks = list(self._callbacks.get(ref.id, ()))
            for callback in callbacks:
                callback()

        return ref.on_snapshot(pushed)

    def _sweep(self, now: float) -> None:
        if now - self._swept < _WATCH_IDLE:
            return
        with self._lock:
            self._swept = now
            idle = [d for d, w in self._watched.items() if now - w.used > _WATCH_IDLE]
            watches = [self._watched.pop(d).watch for d in idle]
        for watch in watches:  # outside the lock: closing joins the listener's thread
            watch.unsubscribe()

    def close(self) -> None:
        with self._lock:
            watches = [w.watch for w in self._watched.values()]
            self._watched.clear()
        for watch in watches:
            watch.unsubscribe()
