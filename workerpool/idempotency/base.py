"""The idempotency store interface, its result types, and the rules every backend shares.

A record per job id is either a *claim* (someone is running the job until ``until``) or a
*completion* (``completed_at`` is set). Every claim granted on a job id gets the next fencing
token of that job id (``token``); a record outlives its claim's release to keep the count, for
as long as a completion is kept (``retention``). Backends only provide an atomic
read-modify-write of one record (``_mutate``); the decisions live here, once, so all backends
behave identically.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Final, Literal, TypeGuard, TypeVar

from workerpool.stores import StoreError, StoreUnavailable, guarded

DEFAULT_RETENTION: Final = 7 * 24 * 3600.0  # Pub/Sub's longest message retention
# Minutes of failed runs counted that are kept (a day; the dashboard charts the last hour).
FAILED_MINUTES_KEPT: Final = 24 * 60

__all__ = ["StoreError", "StoreUnavailable"]  # re-exported: where callers found them first

T = TypeVar("T")
RunState = Literal["unclaimed", "running", "ended"]


@dataclass(frozen=True)
class Claimed:
    """The caller now holds the claim and may run the job; ``failures`` earlier runs of the
    job id failed (deferrals and hand-backs are not failures). ``token`` is the claim's
    fencing token: it grows with every claim granted on the job id, so a resource the job
    writes can refuse a holder whose claim was taken over (an older token)."""

    failures: int = 0
    token: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Done:
    """The job id already completed: ack without running."""

    completed_at: float


@dataclass(frozen=True)
class HeldElsewhere:
    """A live claim exists (possibly by the same owner, for another or the same message)."""

    owner: str
    message_id: str
    until: float
    token: int = field(default=0, compare=False)  # the live claim's


ClaimResult = Claimed | Done | HeldElsewhere


@dataclass(frozen=True)
class Record:
    """What a backend stores per job id; ``completed_at`` is None while it is only a claim.
    A claim given up after failed runs stays, held by nobody (owner ""), to count them."""

    owner: str
    message_id: str
    until: float
    completed_at: float | None = None
    failures: int = 0
    token: int = 0  # the last claim's fencing token (0: none yet)

    def expire_at(self, retention: float) -> float:
        """When the record stops mattering and may be purged."""
        return (self.until if self.completed_at is None else self.completed_at) + retention


# What a mutation does to the stored record: None keeps it, a Record replaces it (a record is
# never deleted but by the purge of expired ones: it keeps the job id's fencing tokens growing).
Change = Record | None
Mutation = Callable[[Record | None, float], tuple[T, Change]]


class IdempotencyStore(ABC):
    """Claims and completions keyed by job id; a claim is identified by (owner, message_id).

    ``complete`` records Done even if the caller's claim expired and another worker took it
    over: the side effect has happened, so further runs must stop. The first completion wins
    (its ``completed_at`` is kept), and the other worker's ``renew`` returns False from then on.
    ``renew`` succeeds on our own claim even after ``until`` passed, as long as nobody took it
    over (no one else can have run the job). Every method may raise ``StoreError`` (its
    subclass ``StoreUnavailable`` when trying again later may help), and nothing else.
    """

    def __init__(self, *, retention: float, clock: Callable[[], float]) -> None:
        self.retention = retention
        self._clock = clock

    def lapses_in(self, claim: HeldElsewhere) -> float:
        """Seconds until ``claim`` lapses unless its holder renews it, by this store's clock."""
        return claim.until - self._clock()

    @abstractmethod
    def _mutate(self, job_id: str, mutation: Mutation[T]) -> T:
        """Atomically read the record, call ``mutation(record, now)``, apply its change."""

    def _mutate_many(self, items: Sequence[tuple[str, Mutation[T]]]) -> list[T]:
        """``_mutate`` for each item, in order; a backend may do them in one round trip.
        Raises at the first failure (earlier items may have been applied)."""
        return [self._mutate(job_id, mutation) for job_id, mutation in items]

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def _is_live(self, record: Record, now: float) -> bool:
        if record.completed_at is None:
            return record.until > now
        return record.completed_at + self.retention > now

    def claim(self, job_id: str, owner: str, message_id: str, ttl: float) -> ClaimResult:
        return self.claim_many([(job_id, message_id)], owner, ttl)[0]

    def claim_many(
        self, claims: Sequence[tuple[str, str]], owner: str, ttl: float
    ) -> list[ClaimResult]:
        """Claim ``(job_id, message_id)`` pairs for ``owner``, in one round trip where the
        backend can (a pull's messages as they are admitted); a result for each, in order."""
        items = [(job_id, self._claiming(owner, message_id, ttl)) for job_id, message_id in claims]
        return self._guarded(lambda: self._mutate_many(items))

    def _claiming(self, owner: str, message_id: str, ttl: float) -> Mutation[ClaimResult]:
        def mutation(record: Record | None, now: float) -> tuple[ClaimResult, Change]:
            if record is None or not self._is_live(record, now):
                failures = 0 if record is None or record.completed_at else record.failures
                token = (0 if record is None else record.token) + 1
                claim = Record(owner, message_id, now + ttl, failures=failures, token=token)
                return Claimed(failures, token), claim
            if record.completed_at is not None:
                return Done(record.completed_at), None
            return HeldElsewhere(record.owner, record.message_id, record.until, record.token), None

        return mutation

    def run_state(self, job_id: str) -> RunState:
        """Where the run of ``job_id`` is, for the overlap policies of periodic jobs:
        "running" while a live claim holds it; "ended" once it completed, or a run of it
        failed and gave its claim up; "unclaimed" if no worker holds it (none claimed it yet,
        or it was handed back, or its holder died: Pub/Sub delivers it again)."""

        def looking(record: Record | None, now: float) -> tuple[RunState, Change]:
            if record is None:
                return "unclaimed", None
            if record.completed_at is not None or (not record.owner and record.failures):
                return "ended", None
            return ("running" if record.until > now else "unclaimed"), None

        return self._guarded(lambda: self._mutate(job_id, looking))

    def completed_at(self, job_id: str) -> float | None:
        """When ``job_id`` completed, while its completion is kept; else None."""

        def looking(record: Record | None, now: float) -> tuple[float | None, Change]:
            if record is None or record.completed_at is None or not self._is_live(record, now):
                return None, None
            return record.completed_at, None

        return self._guarded(lambda: self._mutate(job_id, looking))

    def renew(self, job_id: str, owner: str, message_id: str, ttl: float) -> bool:
        return self.renew_many([(job_id, message_id)], owner, ttl)[0]

    def renew_many(self, claims: Sequence[tuple[str, str]], owner: str, ttl: float) -> list[bool]:
        """Renew ``(job_id, message_id)`` claims of ``owner``, in one round trip where the
        backend can; for each, True if it is still ours."""

        def renewal(message_id: str) -> Mutation[bool]:
            def mutation(record: Record | None, now: float) -> tuple[bool, Change]:
                if _owns(record, owner, message_id):
                    return True, replace(record, until=now + ttl)
                return False, None

            return mutation

        items = [(job_id, renewal(message_id)) for job_id, message_id in claims]
        return self._guarded(lambda: self._mutate_many(items))

    def complete(self, job_id: str, owner: str, message_id: str) -> None:
        self.complete_many([(job_id, message_id)], owner)

    def complete_many(self, completions: Sequence[tuple[str, str]], owner: str) -> None:
        """Record ``(job_id, message_id)`` runs of ``owner`` as done, in one round trip where
        the backend can; all or, on an error, possibly only some of them."""
        items = [
            (job_id, self._completing(owner, message_id)) for job_id, message_id in completions
        ]
        self._guarded(lambda: self._mutate_many(items))

    def _completing(self, owner: str, message_id: str) -> Mutation[None]:
        def mutation(record: Record | None, now: float) -> tuple[None, Change]:
            if record and record.completed_at is not None and self._is_live(record, now):
                return None, None  # keep the first completion
            token = 0 if record is None else record.token
            return None, Record(owner, message_id, until=now, completed_at=now, token=token)

        return mutation

    def release(self, job_id: str, owner: str, message_id: str, *, failed: bool = False) -> None:
        """Give the claim up; ``failed``: the run failed, and counts as a failed attempt."""
        self.release_many([(job_id, message_id)], owner, failed=failed)

    def release_many(
        self, claims: Sequence[tuple[str, str]], owner: str, *, failed: bool = False
    ) -> None:
        def releasing(message_id: str) -> Mutation[None]:
            def mutation(record: Record | None, now: float) -> tuple[None, Change]:
                if not _owns(record, owner, message_id):
                    return None, None
                # Held by nobody from now on, so no late renewal can revive it; kept for its
                # count of failures and its token (the next claim's is the next one).
                failures = record.failures + failed
                return None, Record("", "", until=now, failures=failures, token=record.token)

            return mutation

        items = [(job_id, releasing(message_id)) for job_id, message_id in claims]
        self._guarded(lambda: self._mutate_many(items))

    def count_failed(self, count: int = 1) -> None:
        """Add ``count`` failed runs to this minute's count, for the dashboard's chart (each
        run whose handler raised, whether it is retried or dead-lettered)."""
        self._guarded(lambda: self._add_failed(int(self._clock() // 60), count))

    def _add_failed(self, minute: int, count: int) -> None:  # noqa: B027
        """Add ``count`` to ``minute``'s failed runs, and forget the minutes older than
        FAILED_MINUTES_KEPT; a backend that does not count them does nothing."""

    def failed_per_minute(self, since: float) -> dict[int, int] | None:
        """How many runs failed (``count_failed``) in each minute (seconds since the epoch
        // 60) from ``since`` on, for the dashboard; None from a backend that does not count
        them."""
        return None

    def completed_per_minute(self, since: float) -> dict[int, int] | None:
        """How many job ids completed in each minute (seconds since the epoch // 60) from
        ``since`` on, for the dashboard; None from a backend that cannot count them."""
        return None

    def _guarded(self, call: Callable[[], T]) -> T:
        return guarded(self, call)

    def __enter__(self) -> IdempotencyStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _owns(record: Record | None, owner: str, message_id: str) -> TypeGuard[Record]:
    return (
        record is not None
        and record.completed_at is None
        and (record.owner, record.message_id) == (owner, message_id)
    )
