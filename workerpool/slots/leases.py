"""A process's slots of the fleet's concurrency keys, leased from the store every replica
shares: ``SlotLeases`` takes them for runs (the ``Concurrency`` middleware's, the pool gate's).

A run waits for a slot first come, first served among this process's runs of that key (only
the first in line asks the store, the others wait their turn), for at most ``patience``
seconds, then defers its message with jitter. A slot is kept alive by a ``LeaseKeeper`` for
as long as its run runs (a run whose slot cannot be renewed is handed back before the slot
can lapse, so the limit holds even then), and released as soon as the run ends, whatever its
outcome; a holder killed outright frees its slot when the lease's TTL runs out.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

from workerpool import constants as c
from workerpool.slots.bookings import BookingWriter
from workerpool.slots.keys import Limits
from workerpool.slots.shares import ShareManager, ShareUse, should_stop
from workerpool.slots.store import Granted, SlotStore
from workerpool.stores import StoreError
from workerpool.worker.keeper import Held, LeaseKeeper
from workerpool.worker.run import Run
from workerpool.worker.timers import Timers

log = logging.getLogger(__name__)

_Key = tuple[str, str]  # (key, holder)
# The first in line asks the store again after this long, doubling up to the store's
# ``poll_every`` (jittered): a slot another replica frees sits idle for about half of that.
# Its place in the key's line is written about once a second; the asks between are reads.
FIRST_POLL = 0.02
# Runs further back in line look at their run (draining? handed back?) this often.
_CHECK_EVERY = 0.25


class GaveUp(Enum):
    """Why a run got no slot: its patience ran out, no room was left to wait without a
    permit (the pool's prefetch is taken), or it must not start any more (draining)."""

    PATIENCE = "patience"
    NO_ROOM = "no_room"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Lease:
    """A slot of ``key``; ``token`` only grows from one grant of the key to the next."""

    key: str
    holder: str
    token: int


@dataclass(eq=False)
class Taken:
    lease: Lease
    held: Held[_Key] | None  # None: a slot of this replica's share of a bulk key
    since: float
    run: Run  # (the lease names its run only while it is kept alive)
    # Named after the work it guards (``ctx.slot(key, holder=...)``): a run handed back
    # leaves it held for the next run of that work.
    named: bool = False
    share: ShareUse | None = None


@dataclass(eq=False)
class _Ticket:
    """A run's place in this process's line: its place in the key's line once the store has
    told it (a job deferred before keeps the place it had then), until then last."""

    since: float = math.inf


@dataclass(eq=False)
class _Line:
    """This process's runs waiting for one key, by their places in the key's line (in
    arrival order, but for jobs deferred before: they go ahead of those that came later)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    queue: list[_Ticket] = field(default_factory=list)
    # Changes whenever a slot of the key is released here or the line moves, so the first
    # in line never sleeps through a slot freed while it was asking the store.
    version: int = 0

    def moved(self) -> None:
        with self.cond:
            self.version += 1
            self.cond.notify_all()

    @contextmanager
    def joined(self) -> Iterator[_Ticket]:
        ticket = _Ticket()
        with self.cond:
            self.queue.append(ticket)
        try:
            yield ticket
        finally:
            with self.cond:
                self.queue.remove(ticket)
            self.moved()

    def first(self, ticket: _Ticket) -> tuple[bool, int]:
        """Whether ``ticket`` is first in line, and the line's version now."""
        with self.cond:
            return self.queue[0] is ticket, self.version

    def place(self, ticket: _Ticket, since: float) -> None:
        """``ticket``'s place in the key's line is ``since``: ahead of every run here whose
        place is later."""
        with self.cond:
            if since >= ticket.since:
                return
            first = self.queue[0]
            self.queue.remove(ticket)
            ticket.since = since
            bisect.insort_right(self.queue, ticket, key=lambda t: t.since)
            if self.queue[0] is not first:  # the one it displaced must stop asking
                self.version += 1
                self.cond.notify_all()

    def wait(self, version: int, timeout: float) -> bool:
        """Wait up to ``timeout`` unless the line moved since ``version``; False if there
        is no time left."""
        if timeout <= 0:
            return False
        with self.cond:
            if self.version == version:
                self.cond.wait(timeout)
        return True


class SlotLeases:
    """Takes, keeps and gives back slots for runs."""

    def __init__(
        self,
        store: SlotStore,
        owner: str,
        limits: Limits,
        timers: Timers,
        *,
        ttl: float = c.DEFAULT_SLOT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._owner = owner
        self.limits = limits
        self._clock = clock
        self.keeper: LeaseKeeper[_Key] = LeaseKeeper(
            "slot",
            timers,
            ttl,
            renew=lambda keys: store.renew_many(keys, ttl),
            release=store.release_many,
            close_store=store.close,
        )
        self._bookings = BookingWriter(store)
        # Keys leased in bulk: their runs take slots of this replica's shares.
        self.shares = ShareManager(store, owner, limits, timers, ttl=ttl, clock=clock)
        self._lines: dict[str, _Line] = {}
        self._taken: dict[Run, list[Taken]] = {}
        # The one run that may wait holding its permit, and its line (``_wait_in_front``).
        self._front: tuple[Run, _Line] | None = None
        self._picking_up = 0  # runs granted a slot, waiting to take their permits back
        self._lock = threading.Lock()

    def take(
        self, key: str, run: Run, patience: float, *, park: bool = True, holder: str = ""
    ) -> Taken | GaveUp:
        """A slot of ``key`` for ``run``, waiting up to ``patience`` seconds; with ``park``
        (a run that has not started), without the run's permit, so it counts against the
        pool's prefetch, not its N; under ``holder``'s name if given (the same slot as any
        earlier grant to that name still live). Raises ``StoreError``; ``KeyError`` if
        ``key`` has no declared limit."""
        limit = self.limits.of(key)
        if limit is None:
            raise KeyError(key)
        if self.limits.bulk(key):
            return self._take_share(key, run, patience, park)
        return self._take_per_run(key, limit, run, patience, park, holder)

    def _take_per_run(
        self, key: str, limit: int, run: Run, patience: float, park: bool, holder: str
    ) -> Taken | GaveUp:
        named = bool(holder)
        holder = holder or self.new_holder()
        line = self._line(key)
        deadline = self._clock() + patience
        poll = FIRST_POLL
        asked = waited = queued = booked = False
        ahead = 0
        # A run not started yet asks without its permit where the pool has room for that:
        # an ask can take a while (a Firestore write), and arrivals that held permits while
        # asking kept the runs already granted a slot from taking theirs back.
        parked = park and run.permit.put_down()
        with line.joined() as ticket:
            try:
                while not should_stop(run):
                    first, version = line.first(ticket)
                    if queued and not first:
                        # A job deferred before went ahead of it here: its place in the
                        # key's line goes, or a release could hand it a slot it no longer
                        # asks for (given up so, a slot it was handed is freed too).
                        self._leave(key, holder)
                        queued = False
                    wait = _CHECK_EVERY
                    # The first in this process's line asks the store; so does every run
                    # once, on arrival: a job deferred earlier may be ahead of all here.
                    if first or not asked:
                        asked = True
                        sent = self._clock()
                        # In the key's line only once it has waited here: a run that
                        # cannot wait leaves no place behind.
                        result = self._store.acquire(
                            key, holder, limit, self.keeper.ttl, wait=waited,
                            job_id=run.job.job_id,
                        )  # fmt: skip
                        queued = queued or waited
                        if isinstance(result, Granted):
                            queued = False
                            lease = Lease(key, holder, result.token)
                            taken = self.keep(run, lease, sent - result.age, named=named)
                            # Asked without its permit: it takes one back only now, its
                            # slot kept alive meanwhile.
                            if parked and not self._pick_up(run):
                                self._drop(taken)
                                return GaveUp.STOPPED
                            return taken
                        booked = booked or result.booked
                        ahead = result.ahead
                        line.place(ticket, result.since)
                        first = line.first(ticket)[0]
                        if first:
                            wait = poll * random.uniform(0.5, 1.0)
                            poll = min(poll * 2, self._store.poll_every)
                    # A run not started yet waits without its permit; a running handler
                    # (ctx.slot) keeps it.
                    if park and not parked:
                        where = self._wait_where(run, line, booked and first and not ahead)
                        if where is None:
                            return GaveUp.NO_ROOM
                        parked = where
                    waited = True
                    if not line.wait(version, min(wait, deadline - self._clock())):
                        return GaveUp.PATIENCE
                return GaveUp.STOPPED
            finally:
                self._leave_front(run)
                if queued:
                    self._leave(key, holder)

    def _take_share(self, key: str, run: Run, patience: float, park: bool) -> Taken | GaveUp:
        use = self.shares.take(key, run, patience, park=park)
        if isinstance(use, str):
            return GaveUp(use)
        lease = Lease(key, self._owner, use.share.token)
        return Taken(lease, None, use.since, run, share=use)

    def start(self) -> None:
        self.keeper.start()
        if self.limits.bulk_entries:
            self.shares.start()

    @property
    def healthy(self) -> bool:
        return self.keeper.healthy and self.shares.healthy

    def _wait_where(self, run: Run, line: _Line, may_lead: bool) -> bool | None:
        """Where a run not started waits: without its permit (True), holding it at the
        front of the line (False, if it ``may_lead``), or nowhere (None: no room)."""
        if run.permit.put_down():
            self._leave_front(run)
            return True
        if may_lead and self._wait_in_front(run, line):
            return False
        return None

    def _wait_in_front(self, run: Run, line: _Line) -> bool:
        """Whether ``run`` may wait holding its permit, as the one run of this process that
        does. It is a job deferred before, first in its key's line here and in the key's
        line (no replica's waiter is ahead of it), and the pool has no room for it to wait
        without (the prefetch is taken by runs waiting so, often newer messages that came
        while it was away). Deferred again, the front of the line was sent away on every
        return and ran late, after many deliveries. One permit is the cost, one at a time:
        the first of the same line takes it over (the one it displaced gives up), and none
        waits so while a run granted its slot waits for a permit (with N = 1, this one's)."""
        with self._lock:
            if self._picking_up:
                return False
            if self._front is None or self._front[0] is run or self._front[1] is line:
                self._front = (run, line)
                return True
            return False

    def _leave_front(self, run: Run) -> None:
        with self._lock:
            if self._front is not None and self._front[0] is run:
                self._front = None

    def _pick_up(self, run: Run) -> bool:
        """``run.permit.pick_up()``, counted while it waits (see ``_wait_in_front``)."""
        with self._lock:
            self._picking_up += 1
        try:
            return run.permit.pick_up()
        finally:
            with self._lock:
                self._picking_up -= 1

    def _leave(self, key: str, holder: str) -> None:
        try:
            self._store.release_many([(key, holder)])
        except StoreError as exc:  # the place lapses on its own, soon
            log.warning("place in the line of %s not given up: %s", key, exc)

    def come_back_in(self, key: str, job_id: str) -> float:
        """Seconds until job ``job_id``, which found ``key`` full, should come back (its
        booking in the key's line); raises ``StoreError``."""
        if self.limits.bulk(key):
            return self.shares.come_back_in(key)
        booking = self._store.come_back(key, job_id, self.limits.of(key) or 1)
        self._bookings.put(key, job_id, booking)
        return max(0.0, booking.at - time.time())

    def close(self, timeout: float) -> None:
        """Write the bookings not written yet, then release the interrupted runs' slots and
        close the store, all within ``timeout``."""
        deadline = time.monotonic() + timeout
        self._bookings.close(timeout / 2)
        self.shares.close(max(0.0, deadline - time.monotonic()) / 2)
        self.keeper.close(max(0.0, deadline - time.monotonic()))

    def give(self, taken: Taken) -> None:
        """Release the slot (the run ended); a release that fails is left to expire."""
        if taken.share is not None:
            self.shares.give(taken.share)
            return
        assert taken.held is not None
        self.keeper.let_go(taken.held)
        self._forget(taken)
        lease = taken.lease
        try:
            held_for = self._clock() - taken.since
            self._store.release(
                lease.key,
                lease.holder,
                held_for=held_for,
                limit=self.limits.of(lease.key) or 0,  # slots are only taken of declared keys
                ttl=self.keeper.ttl,
            )
        except StoreError as exc:
            log.warning("slot of %s not released (%s); it expires on its own", lease.key, exc)
        finally:
            self._line(lease.key).moved()

    def leave(self, taken: Taken) -> None:
        """Stop keeping the slot alive without releasing it: it lapses after its TTL unless
        a run asks for it again by its holder's name (a share's slot is given back: shares
        have no names)."""
        if taken.share is not None:
            self.shares.give(taken.share)
            return
        assert taken.held is not None
        self.keeper.let_go(taken.held)
        self._forget(taken)

    def _drop(self, taken: Taken) -> None:
        """Release a slot its run never used (no hold time measured)."""
        assert taken.held is not None  # (a share's slot is given back by the share)
        self.keeper.let_go(taken.held)
        self._forget(taken)
        self._leave(taken.lease.key, taken.lease.holder)
        self._line(taken.lease.key).moved()

    def interrupted(self, run: Run) -> None:
        """``run`` was handed back: its slots are released by the keeper, soon (named ones
        are left to the next run of their work)."""
        with self._lock:
            taken = self._taken.pop(run, [])
        self.shares.interrupted(run)
        for each in taken:
            assert each.held is not None  # (only per-run slots are listed here)
            if each.named:
                self.keeper.let_go(each.held)
            else:
                self.keeper.interrupted((each.lease.key, each.lease.holder))

    @property
    def store(self) -> SlotStore:
        return self._store

    def new_holder(self) -> str:
        """A holder name of this process for one slot or place in line."""
        return f"{self._owner}/{uuid.uuid4().hex[:12]}"

    def keep(self, run: Run, lease: Lease, sent: float, *, named: bool = False) -> Taken:
        """Keep ``lease``, granted to a request sent at ``sent``, alive while ``run`` runs;
        ``give`` releases it."""
        held = self.keeper.hold(run, (lease.key, lease.holder), sent)
        taken = Taken(lease, held, sent, run, named)
        with self._lock:
            self._taken.setdefault(run, []).append(taken)
        return taken

    def _forget(self, taken: Taken) -> None:
        with self._lock:
            held = self._taken.get(taken.run)
            if held is not None and taken in held:
                held.remove(taken)
                if not held:
                    del self._taken[taken.run]

    def _line(self, key: str) -> _Line:
        with self._lock:
            line = self._lines.get(key)
            if line is None:
                line = self._lines[key] = _Line()
                # A slot freed elsewhere (or handed to this line) wakes the first in line
                # at once where the store says so, instead of at its next ask.
                self._store.on_change(key, line.moved)
            return line
