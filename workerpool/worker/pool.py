"""Exactly N running, and a hold on no more than N + prefetch messages.

The puller asks ``wait_for_room`` how many messages it may pull; ``admit`` queues them for the
slot threads (and releases at once anything beyond the bound); ``quiet`` gives back every
message not yet started; ``stop`` waits for running jobs until a deadline, then interrupts them.

A pull costs the same whether it brings one message or a hundred, so while more than half the
prefetch could start at once (a message behind its key cannot: counted, pulls went out with 21
of 100 slots running), the puller waits until half the hold is free and pulls that much at
once (pulls of a few messages each had become most of the CPU with short jobs). A pool whose
startable messages run low pulls at once, so no slot waits for a pull it could have had.

A message runs only while its slot thread holds one of N permits. There is a thread per
message held (N + prefetch), so a run that must wait before its handler starts (for a
concurrency slot, say) can put its permit down, letting another message run meanwhile: up to
``prefetch`` runs wait so, counted against the prefetch, never against N. But only about N
threads take messages at a time (``turns``): the prefetched ones wait in the queue, and a sync
run's thread takes the next with the permit it freed, unless a run waits in line for one.

A message whose run has ended but whose success is still being recorded off the slot thread
(the idempotency store's completion: a batch child's slot waits for it instead) has given its
permit back, but is held until it settles; so is one a hand-back took, until that is done
(then its key's later messages go back: their copies after its own). An async run keeps its
permit while its task runs on the event loop, but not its thread: the thread takes the next
message (waiting for a permit like any other), and when the task ends a slot thread is woken
to carry the rest of the run (``_resume``), one wake-up for all that ended meanwhile.

An async run whose middleware lets it (``Processor.starts_ahead``) need not wait for a permit
before its middleware: while every permit is taken, such runs go through the middleware
before the handler and wait, ready, with no thread (the hold bounds them: with every permit
taken, at most ``prefetch`` are held beyond). A freed permit goes to the oldest of them, and
the run starts on the thread that freed it: on the loop's own thread when an async run's task
ends, so the next one starts in the same loop iteration. Measured at N = 64 with 50 ms async
jobs, each run otherwise waited for three thread hand-offs between one run's end and the next
one's start (0.2-0.4 ms each, queued behind each other for the GIL, since ends come in
bursts), and 0.03 of the slots were idle for it. A thread that waits for a permit (a message
not made ready ahead, a parked run picking its permit up again) and came first still gets it
first, so sync runs of a mixed pool, and runs holding a fleet-wide slot, are not passed over.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

from workerpool.worker.delivery import Delivery
from workerpool.worker.handoff import Handoff
from workerpool.worker.interfaces import Leases
from workerpool.worker.limits import PoolLimits
from workerpool.worker.ordering import Place, Sequencer, Unordered
from workerpool.worker.permits import (
    AHEAD,
    HELD,
    NONE,
    PARKED,
    SlotPermit,
    Start,
    Starter,
    came_before,
)
from workerpool.worker.processor import Ending, Processor
from workerpool.worker.together import together
from workerpool.worker.turns import Turns
from workerpool.worker.watched import Watched

log = logging.getLogger(__name__)


class Pool:
    def __init__(
        self,
        processor: Processor,
        leases: Leases,
        limits: PoolLimits,
        *,
        name: str = "pool",
        sequencer: Sequencer | None = None,
    ) -> None:
        """``sequencer``: on an ordered subscription, runs a key's messages one at a time."""
        self.limits = limits
        self.name = name
        self._processor = processor
        self._leases = leases
        self._sequencer = sequencer or Unordered()
        # Admitted messages, and a slot thread's wake-up to carry on async runs (``_RESUME``).
        self._waiting: Handoff[Delivery | _Resume] = Handoff(name)
        self._resumed: collections.deque[tuple[SlotPermit, Delivery, Callable[[], Ending]]] = (
            collections.deque()
        )
        self._resume_pending = False
        self._held = 0
        self._held_bytes = 0
        self._free = limits.max_outstanding  # permits nobody holds
        self._parked = 0  # runs waiting without their permit
        self._starting: set[Delivery] = set()  # taken by a slot thread, waiting for a permit
        # Async runs made ready ahead, oldest first: their permit, and how to start them; and
        # every thread waiting for a permit, in the order they came (both hold a ticket).
        self._ready: collections.deque[tuple[SlotPermit, Start]] = collections.deque()
        self._waiters: dict[SlotPermit, int] = {}
        self._tickets = itertools.count()
        self._starter = Starter(name)
        self._unstarted = 0  # admitted, and not yet running or given back (``_startable``)
        self._low = limits.low_water
        self._most = self._sequencer.per_key or limits.max_held  # a pull's most: a key's share
        self._batch = max(1, min(limits.max_held // 2, self._most))  # else pull this much
        # One lock, entered as itself (a Condition's __enter__ is one more Python call), and
        # conditions: the puller and ``wait_idle`` watch the hold; slot threads wait for a
        # permit, one woken per freed permit, and for a turn (``Turns``).
        self._lock = lock = threading.Lock()
        self._cond = Watched(lock)
        self._permits = threading.Condition(lock)
        self._quiet = threading.Event()
        self._threads: list[threading.Thread] = []
        self._turns = Turns(lock, limits.max_outstanding)

    @property
    def running(self) -> int:
        return self.limits.max_outstanding - self._free

    @property
    def held(self) -> int:
        return self._held

    @property
    def quieted(self) -> bool:
        return self._quiet.is_set()

    def start(self) -> None:
        self._waiting.start()
        self._threads = [
            threading.Thread(target=self._slot, name=f"{self.name}-slot-{i}", daemon=True)
            for i in range(self.limits.max_held)
        ]
        for thread in self._threads:
            thread.start()

    def wait_for_room(self, timeout: float, *, startable: bool = False) -> int:
        """How many messages may be pulled now (0 after ``timeout`` or once quiet); with
        ``startable``, only as many as could start at once (a run waiting without its permit
        does not count). It waits for the hold to fall to ``look_at``: room for a pull."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._quiet.is_set():
                cap = self.limits.max_held  # the hold's bound, or what may start at once
                if startable:
                    cap = min(cap, self.limits.max_outstanding + self._parked)
                look_at = cap - (1 if self._startable() <= self._low else self._batch)
                # (Bytes are let go only as the hold falls: a fall to look_at is seen.)
                if self._held <= look_at and self._held_bytes < self.limits.max_bytes:
                    return min(cap - self._held, self._most)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining, look_at=look_at)
        return 0

    def admit(self, deliveries: list[Delivery]) -> None:
        accepted: list[Delivery] = []
        startable: list[Delivery] = []
        released: list[Delivery] = []
        with self._lock:
            for delivery in deliveries:
                fits = (
                    not self._quiet.is_set()
                    and self._held < self.limits.max_held
                    and (self._held_bytes < self.limits.max_bytes or self._held == 0)
                )
                place = self._sequencer.place(delivery) if fits else Place.BACK
                if not fits:
                    self._sequencer.refused(delivery)
                if place is Place.BACK:
                    released.append(delivery)
                    continue
                self._held += 1
                self._unstarted += 1
                self._held_bytes += delivery.size
                accepted.append(delivery)
                if place is Place.START:
                    startable.append(delivery)
            # Under the lock: a message waiting behind its key may start as soon as the one
            # before it settles, which may be before this lock is let go.
            if accepted:
                self._leases.add(accepted)
        if accepted:
            self._processor.admitted(accepted)
            self._waiting.put_many(startable)
        if released:
            # Beyond the bound or their key's share, or draining: another worker may have them.
            self._processor.give_back(released)
            log.info("%s released %d beyond its bound or key's share", self.name, len(released))

    def _slot(self) -> None:
        permit = SlotPermit(self)
        while True:
            self._turns.before_taking()
            item = self._waiting.get()
            if item is None:
                return
            if isinstance(item, _Resume):
                self._resume_all()
                continue
            delivery = item
            if delivery.settled:  # given back by quiet() while it waited
                with self._lock:
                    self._started_one()
                continue
            start = functools.partial(self._start, permit, delivery)
            if self._carry(permit, delivery, start) is Ending.CARRIED:
                permit = SlotPermit(self)  # the run keeps this one until it ends

    def _start(self, permit: SlotPermit, delivery: Delivery) -> Ending:
        if self._processor.starts_ahead(delivery) and self._go_ahead(permit):
            pass  # its middleware runs now; it starts once it is granted a permit
        elif not self._wait_for_permit(permit, delivery):
            self._processor.give_back([delivery])  # the pool went quiet: quiet() gave it back
            return Ending.SETTLED
        left = functools.partial(self._left, delivery)
        resume = functools.partial(self._resume, permit, delivery)
        return self._processor.process(delivery, permit, left, resume)

    def _carry(self, permit: SlotPermit, delivery: Delivery, step: Callable[[], Ending]) -> Ending:
        """Carry ``delivery``'s run through ``step`` on this thread; unless the run goes on
        without it, give its permit back (and, if it settled, its place in the hold)."""
        ending = Ending.SETTLED
        try:
            ending = step()
        except BaseException:  # the processor maps handler errors; this guards the slot
            log.exception("%s: processing %s failed", self.name, delivery.message_id)
            self._processor.give_back([delivery])  # if nothing took it: now
        finally:
            if ending is not Ending.CARRIED:
                self._end_run(permit, delivery, settled=ending is Ending.SETTLED)
        return ending

    def _end_run(self, permit: SlotPermit, delivery: Delivery, *, settled: bool) -> None:
        # (Its lease is let go where its ack or nack is queued, which may be on another
        # thread still: a hand-back that publishes a copy first. Its place in the hold too.)
        settled = settled and not (delivery.returned and delivery.leave_after(self._left))
        with self._lock:
            starts = self._let_go(permit)
            after = self._unhold(delivery) if settled else []  # one round trip of the lock
            self._cond.held(self._held)
        self._starter.launch(starts)
        if after:
            self._processor.give_back(after)

    def _let_go(self, permit: SlotPermit) -> list[Start]:
        """(Under the lock.) The run is done with ``permit``, whatever its state; what to
        start with a permit it freed (outside the lock, ``Starter``)."""
        starts = []
        if permit.state is HELD:
            starts = self._free_permit()
        elif permit.state is PARKED:
            self._parked -= 1
        elif permit.state is AHEAD:  # it ended before it was ready (a middleware ended it)
            self._started_one()
        permit.state = NONE
        return starts

    def _free_permit(self) -> list[Start]:
        """(Under the lock.) One permit is free: to a run made ready ahead (returned, to be
        launched outside the lock), or else to a waiting thread."""
        self._free += 1
        starts = self._dispatch()
        if self._free and self._waiters:  # (every thread waiting for one is in line)
            self._permits.notify()
        return starts

    def _dispatch(self) -> list[Start]:
        """(Under the lock.) Free permits go to the async runs made ready ahead, oldest
        first, each unless that many threads waiting for a permit came before it (the free
        permits are theirs); the starts are returned, to be launched outside the lock."""
        starts = []
        while self._free and self._ready and not self._quiet.is_set():
            ahead, start = self._ready[0]
            if came_before(ahead.ticket, self._waiters) >= self._free:
                break
            self._ready.popleft()
            self._free -= 1
            self._started_one()
            ahead.state = HELD
            starts.append(start)
        return starts

    def _go_ahead(self, permit: SlotPermit) -> bool:
        """Make an async run ready ahead, without a permit, if every permit is taken. (Its
        place is in the hold, which bounds it: it holds no thread.) Read without the lock: a
        permit freed meanwhile goes to it when it is ready (``start_when_held``)."""
        if self._quiet.is_set() or self._free:
            return False
        permit.state = AHEAD  # nobody else sees this permit yet
        permit.ticket = next(self._tickets)
        return True

    def start_when_held(self, permit: SlotPermit, start: Start) -> None:
        if permit.state is HELD:  # held: only its run changes its state, and that is us
            start(True)
            return
        with self._lock:
            if permit.state is AHEAD and not self._quiet.is_set():
                self._ready.append((permit, start))
                starts = self._dispatch()
                granted: bool | None = None  # by whoever frees a permit, or refused by quiet()
            else:
                starts = []
                granted = permit.state is HELD
                if not granted:
                    self._let_go(permit)
        if granted is not None:
            start(granted)
        self._starter.launch(starts)

    def _resume(self, permit: SlotPermit, delivery: Delivery, rest: Callable[[], Ending]) -> None:
        """(From the event loop's thread, or wherever a run that was ready ahead was refused.)
        Have a slot thread carry the rest of an async run whose task ended, once its permit
        went to the next run, started right here. One wake-up for all the runs that end
        before a slot thread looks: a thread woken per run would cost most of what the run
        saved by holding none."""
        if self._ready:  # (read without the lock: else the rest lets the permit go, as ever)
            with self._lock:
                starts = self._let_go(permit)
            self._starter.launch(starts)
        self._resumed.append((permit, delivery, rest))
        if not self._resume_pending:
            self._resume_pending = True
            self._waiting.put(_RESUME)

    def _resume_all(self) -> None:
        self._resume_pending = False  # first: a run that ends from here on wakes one again
        # One after another. The rest of a run rarely blocks (a dead-letter record, a batch
        # child's done record); while it does, runs that end meanwhile wake another thread,
        # which takes them and any left here: so another thread may empty the queue under it.
        while True:
            try:
                permit, delivery, rest = self._resumed.popleft()
            except IndexError:
                return
            if permit.state is NONE:  # it went to another run, carried on as it ends by a
                self._turns.give_up()  # thread with a turn, though this rest may block
            self._carry(permit, delivery, rest)

    def _left(self, delivery: Delivery) -> None:
        """``delivery``, settled after its run ended, is held no more (``together``)."""
        if delivery.returned and delivery.leave_after(self._left):  # (returned: rarely a call)
            return
        together(self._left_many, delivery)

    def _left_many(self, deliveries: list[Delivery]) -> None:
        with self._lock:
            after = [back for delivery in deliveries for back in self._unhold(delivery)]
            self._cond.held(self._held)
        if after:
            self._processor.give_back(after)

    def _unhold(self, delivery: Delivery) -> list[Delivery]:
        """(Under the lock.) ``delivery``, started, settled. On an ordered subscription the
        next message of its key may start now; or, if it was given back, the later ones of
        its key held here are returned, to be given back after it (outside the lock)."""
        self._held -= 1
        self._held_bytes -= delivery.size
        after, back = self._sequencer.settled(delivery)
        if after is not None:
            self._waiting.put(after)
        self._drop_unstarted(back)
        return back

    def _drop_unstarted(self, deliveries: list[Delivery]) -> None:
        """(Under the lock.) These, never started, are given back: held no more."""
        self._held -= len(deliveries)
        self._unstarted -= len(deliveries)
        self._held_bytes -= sum(d.size for d in deliveries)

    def put_down(self, permit: SlotPermit) -> bool:
        with self._lock:
            if permit.state is not HELD or self._parked >= self.limits.prefetch:
                return False
            self._parked += 1
            permit.state = PARKED
            starts = self._free_permit()
            self._cond.notify_all()
            self._turns.leave()  # its run waits: another thread runs a message on the permit
        self._starter.launch(starts)
        return True

    def _wait_for_permit(self, permit: SlotPermit, delivery: Delivery) -> bool:
        with self._lock:
            self._starting.add(delivery)
            try:
                return self._pick_up_locked(permit)
            finally:
                self._starting.discard(delivery)
                self._started_one()

    def _started_one(self) -> None:
        """(Under the lock.) An admitted message runs now, or will not run here."""
        self._unstarted -= 1
        if self._startable() == self._low:
            self._cond.notify_all()  # the puller may be waiting for this

    def _startable(self) -> int:
        """(Under the lock.) Admitted, not started, and not waiting behind their key."""
        return self._unstarted - self._sequencer.waiting

    def pick_up(self, permit: SlotPermit) -> bool:
        with self._lock:
            return self._pick_up_locked(permit)

    def _pick_up_locked(self, permit: SlotPermit) -> bool:
        """False once the pool is quiet: nothing that has not started starts any more. The
        wait is in line (a free permit may be a waiter's, woken for it; see ``_dispatch``), its
        turn given to another thread meanwhile; granted, the thread has one, over N or not."""
        if self._free <= len(self._waiters) and not self._quiet.is_set():
            ticket = self._waiters[permit] = next(self._tickets)
            self._turns.leave()
            try:
                while came_before(ticket, self._waiters) >= self._free and not self._quiet.is_set():
                    self._permits.wait()
                    if self._free and came_before(ticket, self._waiters) >= self._free:
                        self._permits.notify()  # woken for one ahead of it: pass it on
            finally:
                del self._waiters[permit]
        if self._quiet.is_set():
            return False
        self._turns.take_now()
        if permit.state is PARKED:
            self._parked -= 1
        self._free -= 1
        permit.state = HELD
        return True

    def stop_starting(self) -> int:
        """Admit nothing more and start nothing more; tell running jobs we are draining.
        Returns how many async runs made ready ahead it released unstarted."""
        with self._lock:
            self._quiet.set()
            refused = [start for _, start in self._ready]
            while self._ready:
                self._let_go(self._ready.popleft()[0])
        self._processor.draining.set()
        for start in refused:
            start(False)
        return len(refused)

    def quiet(self) -> int:
        """``stop_starting``, and give back what has not started (a message on its last
        delivery waits for its copy, up to the drain's deadline)."""
        released_ready = self.stop_starting()
        waiting: list[Delivery] = []
        resumes = 0
        for item in self._waiting.take_all():
            if isinstance(item, _Resume):
                resumes += 1
            else:
                waiting.append(item)
        for _ in range(resumes):  # async runs that ended still need a slot thread
            self._waiting.put(_RESUME)
        with self._lock:
            starting = list(self._starting)  # their threads count them out of held
            waiting += self._sequencer.release_all()  # behind their key: back with the rest
        # Each key's first (waiting for a permit, or queued) before its later ones, for their
        # copies' order (but a slot thread woken meanwhile gives its first back beside these).
        released = self._processor.give_back(starting + waiting)
        with self._lock:
            self._drop_unstarted(waiting)
            self._permits.notify_all()
            self._cond.notify_all()
        return released + released_ready

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no job runs, or the monotonic ``deadline`` passes."""
        with self._lock:
            while self.running or self._held:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def join(self, deadline: float) -> bool:
        """Stop the slots; wait for them until the monotonic ``deadline`` (a handler that
        ignores ``ctx.cancelled`` keeps its slot thread; it is a daemon). True if all ended."""
        with self._lock:
            self._turns.open()
        self._waiting.close()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


class _Resume:
    """In the slot threads' queue: wake up and carry on the async runs whose tasks ended."""


_RESUME = _Resume()
