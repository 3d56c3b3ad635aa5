"""The slot store interface, its result types, and the rules every backend shares.

A key (``bigquery-exports``, ``partner:acme``) has one record: its holders, each with an
expiry and a fencing token, and the next token to hand out; the jobs deferred because it was
full have a record of their own beside it. A slot is a lease: ``acquire``
grants one while fewer than ``limit`` live holders exist, ``renew_many`` extends live ones,
``release_many`` gives them up, and a holder that stops renewing (it died) drops out once its
lease expires. Backends only provide an atomic read-modify-write of records (``_mutate_many``);
the decisions live here, once, so every backend behaves the same.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from workerpool.stores import guarded

T = TypeVar("T")


@dataclass(frozen=True)
class Holding:
    until: float  # the store's clock (wall time): the lease lapses then unless renewed
    token: int
    since: float  # when it was granted
    job_id: str = ""  # the job it was granted to, whose booking goes with its release


@dataclass(frozen=True)
class Waiter:
    """A place in the key's line: taken at ``since``, kept while it is refreshed; ``job_id``
    (a booked job's), for the holding it may be handed."""

    since: float
    until: float
    job_id: str = ""


@dataclass(frozen=True)
class Booking:
    """A deferred job's place in the key's line (``since``: when it first found the key
    full) and when it was told to come back (``at``)."""

    since: float
    at: float


@dataclass(frozen=True)
class Share:
    """A replica's share of a key leased in bulk: ``granted`` slots until ``until`` (wall
    time), fenced by ``token``; ``want``: how many its runs used and waited for, when it last
    wrote (for the others' fair targets)."""

    granted: int
    want: int
    until: float
    token: int


@dataclass(frozen=True)
class Table:
    """A key's record: its holders; the replicas waiting for it now (one waiter per replica:
    each replica's own line waits behind it); the jobs deferred because it was full, by job
    id; and how long a slot is held, on average, once released (``hold``, 0 until known).
    Waiters and deferred jobs are served oldest first. ``next_token`` only grows: a token
    names one grant, ever. The deferred jobs are stored as a record of their own (the
    key's bookings: a ``Table`` with ``booked`` only); ``SlotStore.table`` joins the two."""

    holders: dict[str, Holding] = field(default_factory=dict)
    next_token: int = 1
    waiters: dict[str, Waiter] = field(default_factory=dict)
    booked: dict[str, Booking] = field(default_factory=dict)
    hold: float = 0.0
    # Replicas' shares of the key, by replica, where it is leased in bulk (``allocation``);
    # per-run holders and shares count against one limit.
    shares: dict[str, Share] = field(default_factory=dict)
    part: int = 0  # a shard's record (``sharding``): its part of the key's limit,
    part_token: int = 0  # the key's token for that part,
    part_until: float = 0.0  # and when it lapses unless a rebalance renews it (``parts``);
    rebalanced: float = 0.0  # a split key's own record: when it was last rebalanced

    def live(self, now: float) -> dict[str, Holding]:
        return {h: holding for h, holding in self.holders.items() if holding.until > now}

    def live_shares(self, now: float) -> dict[str, Share]:
        return {r: share for r, share in self.shares.items() if share.until > now}

    def shared(self, now: float) -> int:
        """Slots held now by replicas' shares (they count against the limit with holders)."""
        return sum(share.granted for share in self.live_shares(now).values())

    def line(self, now: float) -> dict[str, Waiter]:
        return {h: waiter for h, waiter in self.waiters.items() if waiter.until > now}

    def bookings(self, now: float) -> dict[str, Booking]:
        """Bookings whose job may still come back (past ``at`` by BOOKING_GRACE at most)."""
        return {j: b for j, b in self.booked.items() if b.at + BOOKING_GRACE > now}


@dataclass(frozen=True)
class Granted:
    """The caller holds a slot of ``key``; ``token`` grows with every grant of that key, so a
    downstream system can refuse a holder whose lease was taken over (a fencing token)."""

    key: str
    holder: str
    token: int
    # Seconds between the lease's last renewal (or grant) and this answer: a slot handed to
    # a waiter by a release is found already held, its lease running since the release.
    age: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class Full:
    """No slot of the key is free for the caller: ``holders`` hold one, ``ahead`` waiters
    came first. ``since``: the caller's place in the key's line (wall time, as every place
    in it is), kept from its booking where it was deferred before (``booked``)."""

    holders: int
    ahead: int = 0
    since: float = field(default=math.inf, compare=False)
    booked: bool = field(default=False, compare=False)


# Given a key's record (None if it has none) and the time, what to return and the record to
# write (None: leave it as it is).
TableMutation = Callable[[Table | None, float], tuple[T, Table | None]]
# A place in line that is not refreshed for this long lapses (its replica died or gave up).
WAITER_TTL = 3.0
# How much of the mean hold time one more release moves it.
_HOLD_WEIGHT = 0.2
# A booking whose job has not come back this long after its time is dropped: the job ran
# elsewhere, was dead-lettered, or comes back as a newcomer.
BOOKING_GRACE = 120.0
# A deferred job comes back after this share of its expected wait, and never sooner than
# MIN_COME_BACK seconds (each return is a delivery: the front of a busy line must not spin).
_EARLY = 0.8
MIN_COME_BACK = 1.0
# Bookings kept per key at most (the record is rewritten whole on every change); beyond it, a
# deferred job comes back by the line's length alone, without a place of its own.
MAX_BOOKINGS = 2000
# A key's bookings are the record of this name after the key's: deferrals come in bursts (a
# replica pulls a backlog it has no room to wait for), and in the key's own record every one
# of them was a write its grants and releases had to race (measured on the Firestore
# emulator: releases lost a race in a third of their writes, grants waited behind bookings).
_BOOKINGS = "\x1fbookings"


def bookings_of(key: str) -> str:
    """The name of the record of ``key``'s bookings."""
    return key + _BOOKINGS


class SlotStore(ABC):
    """Every method may raise ``StoreError`` (``StoreUnavailable`` when trying again later
    may help), and nothing else."""

    # How often (seconds) a replica waiting for a full key may ask again: what an ask costs.
    poll_every: float = 0.05

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self._clock = clock

    @abstractmethod
    def _mutate_many(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        """Atomically, per key: read its record, call the mutation with it and the time,
        write what it returns; a backend may do them all in one round trip."""

    def _mutate_recent(self, key: str, mutation: TableMutation[T]) -> T:
        """``_mutate_many`` of one key, for a decision that may be made on a copy of the
        record a few milliseconds old when it changes nothing: a waiter's ask (a slot freed
        that recently is seen at its next ask). A backend that keeps such copies answers
        those without a round trip; a change is always decided on the record as it is."""
        return self._mutate_many([(key, mutation)])[0]

    def on_change(self, key: str, callback: Callable[[], None]) -> None:  # noqa: B027
        """Call ``callback`` soon after ``key``'s record changes, here or in another process,
        where the backend is told of changes (Firestore's listener); elsewhere waiters find
        changes by asking every ``poll_every`` seconds, and this does nothing."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    @abstractmethod
    def _records(self, prefix: str) -> list[str]:
        """The names of the records starting with ``prefix``, sorted."""

    def keys(self, prefix: str) -> list[str]:
        """The keys starting with ``prefix`` that have a record, sorted (for ``status``)."""
        return [
            key
            for key in self._guarded(lambda: self._records(prefix))
            if not key.endswith(_BOOKINGS)
        ]

    def acquire(
        self,
        key: str,
        holder: str,
        limit: int,
        ttl: float,
        *,
        wait: bool = False,
        job_id: str = "",
    ) -> Granted | Full:
        """A slot for ``holder`` if fewer than ``limit`` live holders have one and no waiter
        that came before it is still waiting for it. A job that was deferred (``job_id``
        booked) keeps the place it had then. With ``wait``, a caller that gets none takes (or
        keeps) a place in line. Asking again as a live holder (a reply lost on the way, or a
        slot a release handed to the caller's place in line) returns the same grant, renewed
        unless the lease is younger than half its TTL: a slot handed over so is taken from
        the watch's copy where the backend keeps one, without a write. The job's booking is
        given up with the slot.

        A job's booking was made when it was deferred, seconds before it comes back, so
        it is looked up first, on its own, from a recent copy where the backend has one."""
        booking = self._booked(key, self._clock()).get(job_id) if job_id else None

        def mutation(table: Table | None, now: float) -> tuple[Granted | Full, Table | None]:
            table = table or Table()
            live, line = table.live(now), table.line(now)
            mine = live.get(holder)
            if mine is not None:
                age = now - (mine.until - ttl)
                if age < ttl / 2:
                    return Granted(key, holder, mine.token, max(0.0, age)), None
                live[holder] = replace(mine, until=now + ttl)
                return Granted(key, holder, mine.token), replace(table, holders=live)
            place = line.pop(holder, None)
            since = min(
                now if place is None else place.since, now if booking is None else booking.since
            )
            ahead = sum(1 for h, w in line.items() if (w.since, h) < (since, holder))
            if len(live) + table.shared(now) + ahead < limit:
                token = table.next_token
                live[holder] = Holding(now + ttl, token, now, job_id if booking else "")
                granted = replace(table, holders=live, waiters=line, next_token=token + 1)
                return Granted(key, holder, token), granted
            full = Full(len(live), ahead, since, booked=booking is not None)
            if not wait:
                return full, None
            if place is not None and place.until - now > WAITER_TTL / 2:
                return full, None  # a read: the place is refreshed only now and then
            line[holder] = Waiter(since, now + WAITER_TTL, job_id if booking else "")
            return full, replace(table, holders=live, waiters=line)

        return self._guarded(lambda: self._mutate_recent(key, mutation))

    def come_back(self, key: str, job_id: str, limit: int) -> Booking:
        """When the job ``job_id``, which found ``key`` full, should come back (``at``, wall
        time), and its place in the key's line (``since``): about when a slot may be free for
        it, from its place (the replicas waiting now, then the jobs deferred before it) and the
        key's mean hold time, a little early rather than late (a slot idles while its next job
        is away). A job booked before keeps its place, so one that came back too early is not
        sent to the end. The returns of a long backlog so come spread out, each a likely start,
        instead of all at once or in ever longer backoffs. Until a release has measured a hold
        time, a job comes back about when the oldest slot has been held as long again: soon for
        short jobs, in doubling steps for long ones.

        Decided on recent copies of the key's records where the backend has them, and written
        by ``book_many``: it is an estimate, and a deferral must not wait for a write (on a
        shared document that took up to a second a deferral, each holding its message)."""
        now = self._clock()
        table = self._guarded(lambda: self._mutate_recent(key, _reading))
        booked = self._booked(key, now)
        booking = booked.get(job_id)
        since = now if booking is None else booking.since
        if table.hold:
            running = {h.job_id for h in table.live(now).values()}
            ahead = sum(
                1 for j, b in booked.items() if (b.since, j) < (since, job_id) and j not in running
            )
            places = len(table.line(now)) + ahead + 1
            return Booking(since, now + max(MIN_COME_BACK, _EARLY * places * table.hold / limit))
        held = [now - h.since for h in table.live(now).values()]
        return Booking(since, now + max([MIN_COME_BACK, *held]))

    def book_many(self, bookings: Sequence[tuple[str, str, Booking]]) -> None:
        """Keep ``(key, job_id, booking)`` places in their keys' lines (from ``come_back``);
        a job booked before keeps its earlier ``since``."""
        by_key: dict[str, list[tuple[str, Booking]]] = {}
        for key, job_id, place in bookings:
            by_key.setdefault(key, []).append((job_id, place))

        def keeping(items: list[tuple[str, Booking]]) -> TableMutation[None]:
            def mutation(record: Table | None, now: float) -> tuple[None, Table | None]:
                booked = (record or Table()).bookings(now)
                changed = False
                for job_id, new in items:
                    old = booked.get(job_id)
                    if old is None and len(booked) >= MAX_BOOKINGS:
                        continue
                    if old is not None and old.at + BOOKING_GRACE / 2 >= new.at:
                        # It outlives the job's return as it is: every write of the record
                        # is one more the key's other bookings may lose a race to.
                        continue
                    booked[job_id] = new if old is None else replace(new, since=old.since)
                    changed = True
                return None, Table(booked=booked) if changed else None

            return mutation

        self._guarded(
            lambda: self._mutate_many(
                [(bookings_of(key), keeping(items)) for key, items in by_key.items()]
            )
        )

    def renew_many(self, leases: Sequence[tuple[str, str]], ttl: float) -> list[bool]:
        """Extend ``(key, holder)`` leases; for each, True if it was still live. A lapsed one
        is not revived, even when nobody took its place yet: another holder may have been
        granted a slot while it did not count."""

        def renewal(holder: str) -> TableMutation[bool]:
            def mutation(table: Table | None, now: float) -> tuple[bool, Table | None]:
                mine = None if table is None else table.live(now).get(holder)
                if table is None or mine is None:
                    return False, None
                holders = {**table.holders, holder: replace(mine, until=now + ttl)}
                return True, replace(table, holders=holders)

            return mutation

        return self._guarded(
            lambda: self._mutate_many([(key, renewal(holder)) for key, holder in leases])
        )

    def release_many(
        self, leases: Sequence[tuple[str, str]], *, held_for: float | None = None
    ) -> None:
        """Give up ``(key, holder)`` slots, or places in line; ``held_for`` (seconds) says
        how long a slot was held, for the key's mean hold time. Once the slots are free, the
        bookings of the jobs that held them are given up too."""
        self._release(leases, held_for, None)

    def release(self, key: str, holder: str, *, held_for: float, limit: int, ttl: float) -> None:
        """``release_many`` of one slot its run held for ``held_for`` seconds, handing it in
        the same write to the first live waiter in the key's line (a lease of ``ttl``), while
        the key has fewer than ``limit`` other holders. The waiter finds it held at its next
        ask, from the watch's copy where the backend keeps one: a slot changes hands in one
        write instead of two, and idles only while the release reaches the waiter."""
        self._release([(key, holder)], held_for, (limit, ttl))

    def _release(
        self,
        leases: Sequence[tuple[str, str]],
        held_for: float | None,
        hand_over: tuple[int, float] | None,
    ) -> None:
        def releasing(holder: str) -> TableMutation[str]:
            def mutation(table: Table | None, now: float) -> tuple[str, Table | None]:
                if table is None or (holder not in table.holders and holder not in table.waiters):
                    return "", None
                live, line = table.live(now), table.line(now)
                held = live.pop(holder, None)
                line.pop(holder, None)
                token = table.next_token
                if held is not None and hand_over is not None and line:
                    limit, ttl = hand_over
                    if len(live) + table.shared(now) < limit:
                        first = min(line, key=lambda h: (line[h].since, h))
                        waiter = line.pop(first)
                        live[first] = Holding(now + ttl, token, now, waiter.job_id)
                        token += 1
                hold = table.hold
                if held is not None and held_for is not None:
                    # The caller counts from before its ask, so its figure includes the
                    # ask's own wait (up to a second on a busy store, which made jobs
                    # deferred then come back late); the record counts from the grant, by
                    # a clock another host's may skew. The shorter is the slot's hold.
                    sample = min(held_for, now - held.since)
                    hold = sample if not hold else hold + _HOLD_WEIGHT * (sample - hold)
                return (
                    "" if held is None else held.job_id,
                    replace(table, holders=live, waiters=line, hold=hold, next_token=token),
                )

            return mutation

        def unbooking(job_id: str) -> TableMutation[None]:
            def mutation(record: Table | None, now: float) -> tuple[None, Table | None]:
                if record is None or job_id not in record.booked:
                    return None, None
                booked = record.bookings(now)
                booked.pop(job_id, None)
                return None, Table(booked=booked)

            return mutation

        def release() -> None:
            jobs = self._mutate_many([(key, releasing(holder)) for key, holder in leases])
            booked = [(key, job) for (key, _), job in zip(leases, jobs, strict=True) if job]
            if booked:
                self._mutate_many([(bookings_of(key), unbooking(job)) for key, job in booked])

        self._guarded(release)

    def mutate_records(self, items: Sequence[tuple[str, TableMutation[T]]]) -> list[T]:
        """``_mutate_many``, for the rules of records kept in modules of their own (the
        shares of keys leased in bulk, ``allocation``): one transaction, or round trip,
        where the backend allows."""
        return self._guarded(lambda: self._mutate_many(items))

    def table(self, key: str) -> Table:
        """The key's record as it is now, lapsed holders, waiters and shares left out, with
        its bookings (for ``workerpool status``)."""
        now = self._clock()
        table, record = self._guarded(
            lambda: self._mutate_many([(key, _reading), (bookings_of(key), _reading)])
        )
        return replace(
            table,
            holders=table.live(now),
            waiters=table.line(now),
            booked=record.booked,
            shares=table.live_shares(now),
        )

    def _booked(self, key: str, now: float) -> dict[str, Booking]:
        return self._guarded(lambda: self._mutate_recent(bookings_of(key), _reading)).bookings(now)

    def _guarded(self, call: Callable[[], T]) -> T:
        return guarded(self, call)


def _reading(table: Table | None, now: float) -> tuple[Table, None]:
    return table or Table(), None
