"""SQLite backend: the embedded default, shared safely by several worker processes on one host."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from workerpool.idempotency.base import (
    DEFAULT_RETENTION,
    FAILED_MINUTES_KEPT,
    Claimed,
    ClaimResult,
    Done,
    HeldElsewhere,
    IdempotencyStore,
    Mutation,
    Record,
    StoreError,
    StoreUnavailable,
    T,
)
from workerpool.idempotency.sqlite_statements import (
    ADD_FAILED,
    CLAIM_BINDS,
    COMPLETE,
    COMPLETE_BINDS,
    COMPLETED_PER_MINUTE,
    DELETE_FAILED_BEFORE,
    FAILED_SINCE,
    RECORD,
    SCHEMA,
    claim_sql,
    complete_sql,
    delete_expired,
    marks,
    record_row,
    replace_sql,
)
from workerpool.stores.sqlite import add_column, connect, immediate, translated

_LABEL = "idempotency store"
_PURGE_EVERY = 1000  # mutations between purges; the expire_at index keeps each purge cheap
# One batch's upsert binds 8 values per record: stay under SQLite's historical limit of 999.
_MAX_BATCH = 999 // 8
# Rows of one claim or completion statement, at most (its binds permitting): a pull's or a
# batch's job ids in one statement up to this many. Each number of rows is a statement's text
# kept for good (``claim_sql``), about 50 bytes a row: this bounds them to 2 MB a kind.
_MAX_ROWS = 256


# Not frozen, made once a job: see completions._Completion.
@dataclass(slots=True)
class _Claim:
    owner: str
    message_id: str
    ttl: float


@dataclass(slots=True)
class _Complete:
    owner: str
    message_id: str


class _Request:
    """One caller's mutation and, once a leader has committed its batch, its outcome. A claim
    or a completion is its ``op`` instead, so a batch can apply them set-wise in SQL (its
    mutation is built only if the batch must run in order: see ``SqliteStore._mutation``)."""

    __slots__ = ("error", "job_id", "mutation", "op", "result", "signal")

    def __init__(
        self, job_id: str, mutation: Mutation[Any] | None, op: _Claim | _Complete | None = None
    ) -> None:
        self.job_id = job_id
        self.mutation = mutation
        self.op = op
        self.result: Any = None
        self.error: BaseException | None = None
        # Released by the leader once done: a one-shot event. Only the last request of a
        # submission has one (``_submit``): its caller waits for that one alone.
        self.signal: threading.Lock | None = None

    def finish(self) -> None:
        if self.signal is not None:
            self.signal.release()


class SqliteStore(IdempotencyStore):
    """Group commit, leader/follower: a caller queues its mutation; if the commit lock is free
    it becomes the leader and commits everything queued, in BEGIN IMMEDIATE transactions of a
    bounded batch each, until the queue is empty; else it waits for a leader to finish its
    request. A lone caller so commits its own mutation on its own thread, with no hand-off
    (claims and completions in one statement: see below); callers that arrive while a leader
    commits share its next transaction and its fsync.

    Why not a lock around one transaction per call: the sqlite3 module releases the GIL around
    every statement, so a thread holding the store lock also waited to get the GIL back, once
    per statement, while every other caller queued behind it (a lock convoy), and each call
    paid its own fsync. A writer thread fixed that but cost two thread hand-offs per call even
    with nothing to batch (5,331 vs 14,501 claim+complete pairs/s on one thread, measured).
    WAL lets readers and the single writer proceed together; the busy timeout bounds how long a
    batch waits for another process's write lock before its callers get ``StoreUnavailable``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention: float = DEFAULT_RETENTION,
        clock: Callable[[], float] = time.time,
        busy_timeout: float = 5.0,
    ) -> None:
        super().__init__(retention=retention, clock=clock)
        self._queue: list[_Request] = []
        self._queue_lock = threading.Lock()  # guards _queue and _closed
        self._commit_lock = threading.Lock()  # held by the leader: it alone uses _conn
        self._closed = False
        self._since_purge = 0
        self._conn = connect(path, busy_timeout, _LABEL, self._create)
        self._variables = self._conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.executescript(SCHEMA)
        # A store file written before failed attempts were counted lacks the column.
        add_column(conn, "idempotency", "failures", "INTEGER NOT NULL DEFAULT 0")
        add_column(conn, "idempotency", "token", "INTEGER NOT NULL DEFAULT 0")  # fencing tokens
        delete_expired(conn, self._clock())

    # --- claim and complete: on the caller's thread when no batch is being committed -------
    #
    # The two calls every job makes. A lone caller (the commit lock is free and nothing is
    # queued) runs one UPSERT in autocommit instead of a batch transaction's four statements
    # (BEGIN, SELECT, INSERT, COMMIT): each statement gives up the GIL and must win it back.
    # A lone caller's many (a pull's claims, a batch of completions) go in one statement each,
    # with no request, lock or queue per job (16.2 against 12.2 us a job at ten, measured).
    # The WHERE clauses (the claim's in ``claim_sql``) are base.IdempotencyStore's rules for
    # these two calls, in SQL; the parametrized backend suite holds both forms to the same
    # behaviour.

    def claim(self, job_id: str, owner: str, message_id: str, ttl: float) -> ClaimResult:
        alone = self._guarded(
            lambda: self._alone(lambda: self._claim_now(job_id, owner, message_id, ttl))
        )
        if alone is not None:
            return alone
        request = _Request(job_id, None, _Claim(owner, message_id, ttl))
        return cast(ClaimResult, self._guarded(lambda: self._submit([request])[0]))

    def complete(self, job_id: str, owner: str, message_id: str) -> None:
        if self._guarded(
            lambda: self._alone(lambda: self._complete_now(job_id, owner, message_id))
        ):
            return
        request = _Request(job_id, None, _Complete(owner, message_id))
        self._guarded(lambda: self._submit([request]))

    def claim_many(
        self, claims: Sequence[tuple[str, str]], owner: str, ttl: float
    ) -> list[ClaimResult]:
        if len(claims) == 1:  # nothing to batch: one statement, if the connection is free
            job_id, message_id = claims[0]
            return [self.claim(job_id, owner, message_id, ttl)]
        alone = self._guarded(
            lambda: self._alone(
                lambda: self._claim_many_now(claims, owner, ttl), len(claims), wait=True
            )
        )
        if alone is not None:
            return alone
        # A job id twice: in the group commit, in order, as if each came alone.
        requests = [
            _Request(job_id, None, _Claim(owner, message_id, ttl)) for job_id, message_id in claims
        ]
        return cast(list[ClaimResult], self._guarded(lambda: self._submit(requests)))

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        if len(completions) == 1:
            job_id, message_id = completions[0]
            self.complete(job_id, owner, message_id)
            return
        self._guarded(
            lambda: self._alone(
                lambda: self._complete_many_now(completions, owner), len(completions), wait=True
            )
        )

    def _alone(self, call: Callable[[], T], mutations: int = 1, *, wait: bool = False) -> T | None:
        """``call()`` with the connection to itself; None when a batch has it, or is queued
        (then the caller joins the batches), or when ``call`` says None itself. ``wait``: a
        caller of many waits for the batch, then commits what queued before it, and goes in
        one statement, not a request a job id (measured: two thirds of a 100-slot worker's
        claims and completions went in requests, the puller's joining the completer's)."""
        if not self._commit_lock.acquire(blocking=wait):
            return None
        try:
            with self._queue_lock:
                if self._closed:
                    raise StoreUnavailable("SQLite idempotency store: closed")
                queued = bool(self._queue)
            if queued:
                if not wait:
                    return None
                while self._commit_queued():
                    pass
            with translated(_LABEL):
                result = call()
                self._since_purge += mutations
                if self._since_purge >= _PURGE_EVERY:
                    self._purge()
                    self._since_purge = 0
                return result
        finally:
            self._commit_lock.release()
            self._lead()  # for anyone who queued while we held the lock

    @contextlib.contextmanager
    def _connection(self) -> Iterator[None]:
        """The connection to the caller alone, waiting for a batch being committed; then
        whatever was queued meanwhile is committed. (Holding the commit lock without that left
        the claims and completions queued meanwhile with no leader: the worker stalled.)"""
        with self._commit_lock:
            yield
        self._lead()

    def _claim_now(self, job_id: str, owner: str, message_id: str, ttl: float) -> ClaimResult:
        now = self._clock()
        won = self._conn.execute(
            claim_sql(1), (now, self.retention, job_id, owner, message_id, now + ttl)
        ).fetchone()
        if won:
            return Claimed(won[1], won[2])
        record = self._records([job_id]).get(job_id)
        if record is None:  # released between the two statements: claim it after all
            return self._claim_now(job_id, owner, message_id, ttl)
        return _lost(record)

    def _claim_many_now(
        self, claims: Sequence[tuple[str, str]], owner: str, ttl: float
    ) -> list[ClaimResult] | None:
        """A pull's claims in one statement in autocommit (no BEGIN and COMMIT: 0.7 us a job
        less at ten a pull, measured), or as many as binding them takes; None if they must go
        through the batches (a job id twice)."""
        if len({job_id for job_id, _ in claims}) < len(claims):
            return None
        rows = [(j, owner, m, ttl) for j, m in claims]
        now, per = self._clock(), self._bindable(CLAIM_BINDS)
        claimed: list[ClaimResult] = []
        for start in range(0, len(rows), per):
            claimed += self._claim_rows(rows[start : start + per], now)
        return claimed

    def _complete_many_now(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        """A batch's completions in one statement in autocommit (or as many as binding them
        takes), not a transaction's three (0.9 us a job less at eleven, measured), in order (a
        job id twice: the first stays, as in the batches)."""
        now, per = self._clock(), self._bindable(COMPLETE_BINDS)
        for start in range(0, len(completions), per):
            chunk = completions[start : start + per]
            params: list[object] = [now, self.retention]
            for job_id, message_id in chunk:
                params += (job_id, owner, message_id)
            self._conn.execute(complete_sql(len(chunk)), params)

    def _bindable(self, per_row: int) -> int:
        """Rows of ``per_row`` parameters (after two shared ones) one statement may bind."""
        return max(1, min(_MAX_ROWS, (self._variables - 2) // per_row))

    def _complete_now(self, job_id: str, owner: str, message_id: str) -> bool:
        self._conn.execute(COMPLETE, (job_id, owner, message_id, self._clock(), self.retention))
        return True

    # --- everything else: group commit ---------------------------------------------------

    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        return self._mutate_many([(job_id, mutation)])[0]

    def _mutate_many(self, items: Sequence[tuple[str, Mutation[T]]]) -> list[T]:
        return self._submit([_Request(job_id, mutation) for job_id, mutation in items])

    def _submit(self, requests: list[_Request]) -> list[Any]:
        if not requests:
            return []
        signal = requests[-1].signal = threading.Lock()
        signal.acquire()
        with self._queue_lock:
            if self._closed:
                # Not a programming error: the launcher closes the store while interrupted
                # jobs may still finish; they must neither run nor ack, as in an outage.
                raise StoreUnavailable("SQLite idempotency store: closed")
            self._queue.extend(requests)
        self._lead()
        # Led by us or by whoever holds the commit lock: wait on our own request, not on the
        # lock, where a hundred followers would wake one after another (a convoy: 69 % of a
        # slot thread's time in a 100-slot worker was spent there, measured).
        signal.acquire()
        results = []
        for request in requests:
            if isinstance(request.error, sqlite3.OperationalError):
                # A new exception per caller: a failed batch's callers share this cause, and
                # re-raising one object in many threads would splice their tracebacks together.
                raise StoreUnavailable(f"SQLite idempotency store: {request.error}") from (
                    request.error
                )
            if isinstance(request.error, sqlite3.Error):
                raise StoreError(f"SQLite idempotency store: {request.error}") from request.error
            if request.error is not None:
                raise request.error
            results.append(request.result)
        return results

    def _lead(self) -> None:
        """Commit what is queued if nobody else is. Whoever holds the commit lock drains the
        queue and, once it has let go, looks again: a request queued while the lock was held
        is never left without a leader."""
        while self._commit_lock.acquire(blocking=False):
            try:
                while self._commit_queued():
                    pass
            finally:
                self._commit_lock.release()
            with self._queue_lock:
                if not self._queue:
                    return

    def _queued(self) -> int:
        with self._queue_lock:
            return len(self._queue)

    def _commit_queued(self) -> bool:
        """As leader (commit lock held): commit a bounded batch of what is queued; False if
        nothing was."""
        with self._queue_lock:
            batch, self._queue = self._queue[:_MAX_BATCH], self._queue[_MAX_BATCH:]
        if not batch:
            return False
        try:
            self._commit(batch)
        finally:
            for request in batch:
                request.finish()
        return True

    def _commit(self, batch: list[_Request]) -> None:
        """Apply the batch in one transaction; on failure nothing of it is kept and every
        caller gets the error (unless its own mutation had already failed)."""
        purge = self._since_purge + len(batch) >= _PURGE_EVERY
        try:
            with immediate(self._conn):
                self._apply(batch)
                if purge:
                    self._purge()
        except BaseException as exc:  # every caller of the batch must hear of it, or it loops
            for request in batch:
                request.error = request.error or exc
            return
        self._since_purge = 0 if purge else self._since_purge + len(batch)

    def _apply(self, batch: list[_Request]) -> None:
        # A batch of many job ids, none twice (the common case): claims and completions in
        # SQL, row by row inside SQLite, the rest in order in Python. With a job id twice,
        # everything in order, as if each came alone.
        if len({r.job_id for r in batch}) < len(batch):
            self._apply_in_order(batch)
            return
        claims = [r for r in batch if isinstance(r.op, _Claim)]
        completions = [r for r in batch if isinstance(r.op, _Complete)]
        others = [r for r in batch if r.op is None]
        if others:
            self._apply_in_order(others)
        now = self._clock()
        if completions:
            self._conn.executemany(
                COMPLETE,
                [(r.job_id, r.op.owner, r.op.message_id, now, self.retention)
                 for r in completions if isinstance(r.op, _Complete)],
            )  # fmt: skip
        if claims:
            self._claim_all(claims, now)

    def _claim_all(self, claims: list[_Request], now: float) -> None:
        rows = []
        for r in claims:
            assert isinstance(r.op, _Claim)
            rows.append((r.job_id, r.op.owner, r.op.message_id, r.op.ttl))
        for request, result in zip(claims, self._claim_rows(rows, now), strict=True):
            request.result = result

    def _claim_rows(
        self, rows: Sequence[tuple[str, str, str, float]], now: float
    ) -> list[ClaimResult]:
        """Claim ``(job_id, owner, message_id, ttl)`` rows: one statement whose RETURNING
        names the claims won; only those lost (done, or held elsewhere) are read again, to say
        by whom (outside a transaction, one may have been released meanwhile: it is claimed
        again). The job ids are distinct (a second row of one id would lose to the first, and
        both would read as won)."""
        params: list[object] = [now, self.retention]
        for job_id, owner, message_id, ttl in rows:
            params += (job_id, owner, message_id, now + ttl)
        won = {
            job_id: (failures, token)
            for job_id, failures, token in self._conn.execute(claim_sql(len(rows)), params)
        }
        lost = [row[0] for row in rows if row[0] not in won]
        records = self._records(lost) if lost else {}
        return [
            Claimed(*grant) if (grant := won.get(row[0]))
            else _lost(record) if (record := records.get(row[0]))
            else self._claim_now(*row)  # released between the two statements: claim it again
            for row in rows
        ]  # fmt: skip

    def _records(self, job_ids: list[str]) -> dict[str, Record]:
        """The stored records of ``job_ids`` (those that have one), in one statement."""
        rows = self._conn.execute(
            f"SELECT {RECORD} FROM idempotency WHERE job_id IN ({marks(len(job_ids))})",
            job_ids,
        ).fetchall()
        return {row[0]: Record(*row[1:]) for row in rows}

    def _apply_in_order(self, batch: list[_Request]) -> None:
        # Read every record once, run the mutations in queue order on these copies (so two on
        # one job id see each other), then write each changed record once. A mutation that
        # raises has changed nothing yet, so it fails only its own caller. Few statements per
        # batch matters: each one gives up the GIL and must wait to get it back.
        records: dict[str, Record | None] = dict(
            self._records(list({r.job_id: None for r in batch}))
        )
        changed: set[str] = set()
        for request in batch:
            try:
                request.result, change = self._mutation(request)(
                    records.get(request.job_id), self._clock()
                )
            except Exception as exc:
                request.error = exc
                continue
            if change is not None:
                records[request.job_id] = change
                changed.add(request.job_id)
        kept = [(job_id, r) for job_id in changed if (r := records[job_id]) is not None]
        if kept:
            self._conn.execute(
                replace_sql(len(kept)),
                [value for job_id, r in kept for value in record_row(job_id, r, self.retention)],
            )

    def _mutation(self, request: _Request) -> Mutation[Any]:
        match request.op:
            case _Claim(owner, message_id, ttl):
                return self._claiming(owner, message_id, ttl)
            case _Complete(owner, message_id):
                return self._completing(owner, message_id)
        assert request.mutation is not None  # every request has one or the other
        return request.mutation

    def completed_per_minute(self, since: float) -> dict[int, int] | None:
        # A scan of the table (no index on completed_at: every completion would pay for one).
        with self._connection(), translated(_LABEL):
            return {int(m): int(n) for m, n in self._conn.execute(COMPLETED_PER_MINUTE, (since,))}

    def _add_failed(self, minute: int, count: int) -> None:
        with self._connection(), translated(_LABEL), immediate(self._conn):
            self._conn.execute(ADD_FAILED, (minute, count))
            self._conn.execute(DELETE_FAILED_BEFORE, (minute - FAILED_MINUTES_KEPT,))

    def failed_per_minute(self, since: float) -> dict[int, int] | None:
        with self._connection(), translated(_LABEL):
            return {int(m): int(n) for m, n in self._conn.execute(FAILED_SINCE, (since,))}

    def _purge(self) -> None:
        delete_expired(self._conn, self._clock())

    def close(self) -> None:
        """Refuse new calls, let queued ones finish, close the connection. Idempotent."""
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
        with self._commit_lock:
            while self._commit_queued():
                pass
            self._conn.close()


def _lost(record: Record) -> ClaimResult:
    """What a claim that did not win says: done, or held by whom."""
    if record.completed_at is not None:
        return Done(record.completed_at)
    return HeldElsewhere(record.owner, record.message_id, record.until, record.token)
