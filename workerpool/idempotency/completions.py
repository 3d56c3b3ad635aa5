"""Completions recorded in batches on a thread of their own, as acks are sent.

A slot whose run succeeded hands its completion over and goes on to its next message; the
store sees one ``complete_many`` per batch instead of a call, and a wait for the answer, per
job (with a hundred slots, the waits and the hand-offs of the GIL they cost were most of a
no-op job's time). Each completion's ``then`` hears Succeeded once it is durable, or why it
could not be recorded; its message is acked, or not, from there. Before a batch's ``then``s,
``let_go`` hears once what each completion held its job id with (its claim's lease): one
call, and one lock round, a batch instead of one a job.

Completions of jobs that take a while end one by one: each would be a write, a commit and a
wake-up of this thread of its own. So the first of a batch waits up to ``LINGER`` for others
to join it, until ``enough`` have; not at all where something waits for an answer: a slot of
an exactly-once subscription (its ack waits for it) or of a batch child (its ledger does), or
the next message of an ordering key (it starts once the one before is settled). A message
stays held until its completion is recorded, so ``enough`` is what the pool can spare: half
its prefetch (a pool of a few slots spares none, and never waits). Measured at N = 64 with
50 ms jobs on SQLite: the linger took this thread from 95-124 us of CPU a job to 28-57.

A completion whose claim has lapsed by the time its batch is sent (``lapsed``: the process was
paused past the claim's deadline, and another worker may have claimed the job id since) is
not recorded: it is answered ``LostLease``, and its message goes back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from workerpool.idempotency.base import IdempotencyStore, StoreError, StoreUnavailable
from workerpool.worker.outcome import (
    LAPSED_COME_BACK,
    SUCCEEDED,
    LostLease,
    Outcome,
    Unavailable,
)
from workerpool.worker.together import one_round

log = logging.getLogger(__name__)

L = TypeVar("L")  # what holds a completion's job id until it is answered
LINGER = 0.005  # seconds the first completion of a batch waits for others to join it
_FIRST_DELAY = 0.2  # between attempts while the store is unavailable, doubling
_MAX_DELAY = 5.0


# Not frozen: one is made per job, and a frozen dataclass's __init__ costs five times as much
# (0.9 against 0.17 us for six fields, measured). Nothing changes it once made.
@dataclass(slots=True)
class _Completion(Generic[L]):
    job_id: str
    message_id: str
    give_up_at: float  # monotonic: past it, an unavailable store is not waited for any more
    # Whether its message was handed back (a drain's deadline, a lost claim): then it is not
    # waited for any more either. Not the run's ``cancelled``: a run past its timeout that
    # succeeded all the same did its work, and giving up would run it again.
    handed_back: Callable[[], bool]
    held: L
    then: Callable[[Outcome], None]
    awaited: bool  # something waits for the answer: no lingering for others


class Completions(Generic[L]):
    def __init__(
        self,
        store: IdempotencyStore,
        owner: str,
        *,
        patience: float,
        let_go: Callable[[list[L]], None],
        lapsed: Callable[[L], bool],
        enough: int = 1,
        linger: float = LINGER,
    ) -> None:
        """``enough``: completions a batch is written with at once; the first of a smaller
        batch waits up to ``linger`` seconds for more (1: it never waits)."""
        self._store = store
        self._enough = enough
        self._linger = linger
        # While a batch lingers: how many more would make it enough (read by ``add``).
        self._wanted = enough
        self._hurry = threading.Event()  # a lingering batch is written now
        self._owner = owner
        self._patience = patience
        self._let_go = let_go
        self._lapsed = lapsed
        self._queue: queue.SimpleQueue[_Completion[L] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._closing = threading.Lock()  # a completion is queued before the stop, or not at all
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="workerpool-completions", daemon=True
        )
        self._thread.start()

    def add(
        self,
        job_id: str,
        message_id: str,
        handed_back: Callable[[], bool],
        held: L,
        then: Callable[[Outcome], None],
        *,
        awaited: bool = False,
    ) -> None:
        """Record ``job_id`` as done soon; ``then`` hears how it went, on this object's thread
        (or at once on the caller's, once stopped), after ``held`` is let go. ``awaited``:
        something waits for that, so its batch is recorded without lingering."""
        completion = _Completion(
            job_id, message_id, time.monotonic() + self._patience, handed_back, held, then,
            awaited,
        )  # fmt: skip
        with self._closing:  # else queued after the thread's last look, never answered
            stopping = self._stopping.is_set()
            if not stopping:
                self._queue.put(completion)
        if stopping:
            self._answer([completion], Unavailable("completion not recorded: worker stopping"))
        elif (
            self._enough > 1
            and (awaited or self._queue.qsize() >= self._wanted)
            and not self._hurry.is_set()
        ):
            # After the put: the batch it ends takes this one. Set once: with a backlog most
            # adds find the batch full, and setting an Event is a lock and a notify (measured:
            # three in four of a 100-slot worker's completions set it). One read stale as the
            # thread clears it leaves the batch to linger, as long as a linger is.
            self._hurry.set()

    def close(self, timeout: float) -> None:
        """Record what is queued once more (no waiting for an unavailable store), then stop."""
        with self._closing:
            self._stopping.set()
            self._queue.put(None)
        self._hurry.set()  # a batch that lingers is written now
        if self._thread is not None:
            self._thread.join(timeout)

    # --- on the thread -----------------------------------------------------------------

    def _run(self) -> None:
        pending: list[_Completion[L]] = []
        delay = _FIRST_DELAY
        stop = False
        while not stop or pending:
            if not pending:
                first = self._queue.get()
                if first is None:
                    stop = True
                    continue
                pending.append(first)
                stop = self._gather(pending)
            stop = self._take_queued(pending) or stop
            try:
                pending = self._still_held(pending)
                unavailable = self._record(pending, final=stop) if pending else None
            except Exception:  # a bug: no message may stay held for good, nor this thread end
                log.exception("recording %d completions failed", len(pending))
                self._answer(pending, Unavailable("completion not recorded"))
                unavailable = None
            if unavailable is None:
                pending, delay = [], _FIRST_DELAY
                continue
            pending = self._still_waiting(pending, unavailable)
            if pending:
                self._stopping.wait(delay)  # close() ends the wait: one last attempt
                delay = min(delay * 2, _MAX_DELAY)
        self._take_queued(pending)  # queued while closing: too late
        self._answer(pending, Unavailable("completion not recorded: worker stopping"))

    def _gather(self, pending: list[_Completion[L]]) -> bool:
        """Let others join the batch of ``pending``'s first completion for up to the linger:
        until enough have, one comes that something waits for, or the recorder closes. True
        if the stop sentinel came."""
        if self._enough <= 1 or pending[0].awaited:
            return False
        self._hurry.clear()  # then look: what ``add`` queued before it is seen below
        stop = self._take_queued(pending)
        self._wanted = wanted = self._enough - len(pending)
        # (An ``add`` that read the last batch's ``_wanted`` queued before the line above: the
        # queue's size counts it.)
        enough = wanted <= 0 or self._queue.qsize() >= wanted
        if not (stop or enough or any(c.awaited for c in pending)):
            self._hurry.wait(self._linger)
        self._wanted = self._enough  # until the next batch lingers: only a full queue hurries
        return stop

    def _take_queued(self, pending: list[_Completion[L]]) -> bool:
        """Move everything queued to ``pending``; True if the stop sentinel was among it."""
        stop = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return stop
            if item is None:
                stop = True
            else:
                pending.append(item)

    def _still_held(self, pending: list[_Completion[L]]) -> list[_Completion[L]]:
        """Those whose claim has not lapsed; the others are answered, not recorded."""
        held: list[_Completion[L]] = []
        lapsed: list[_Completion[L]] = []
        for c in pending:
            (lapsed if self._lapsed(c.held) else held).append(c)
        for c in lapsed:
            log.error("job %s done, but its claim lapsed before it was recorded: not recorded, "
                      "its message goes back", c.job_id)  # fmt: skip
        self._answer(lapsed, LostLease(after=LAPSED_COME_BACK))
        return held

    def _record(self, pending: list[_Completion[L]], *, final: bool) -> StoreUnavailable | None:
        """One attempt at the whole batch, everyone answered; except, unless ``final``, when
        the store was unavailable: then that, and the batch is to be tried again."""
        try:
            self._store.complete_many([(c.job_id, c.message_id) for c in pending], self._owner)
        except StoreUnavailable as exc:
            if not final:
                return exc
            self._not_recorded(pending, exc)
        except StoreError as exc:  # not going to get better by waiting
            self._not_recorded(pending, exc)
        else:
            self._answer(pending, SUCCEEDED)
        return None

    def _still_waiting(
        self, pending: list[_Completion[L]], exc: StoreUnavailable
    ) -> list[_Completion[L]]:
        """Give up on those past their patience, or whose message was handed back; the rest
        wait."""
        now = time.monotonic()
        waiting: list[_Completion[L]] = []
        given_up: list[_Completion[L]] = []
        for c in pending:
            (waiting if now < c.give_up_at and not c.handed_back() else given_up).append(c)
        if given_up:
            self._not_recorded(given_up, exc)
        return waiting

    def _not_recorded(self, completions: list[_Completion[L]], exc: StoreError) -> None:
        for c in completions:
            log.error("job %s done but not recorded: %s", c.job_id, exc)
        self._answer(completions, Unavailable(f"completion not recorded: {exc}"))

    def _answer(self, completions: list[_Completion[L]], outcome: Outcome) -> None:
        if not completions:
            return
        try:
            self._let_go([completion.held for completion in completions])
        except Exception:  # a bug: the messages must still be settled
            log.exception("letting %d recorded job ids go failed", len(completions))
        with one_round():  # their messages leave the pool together
            for completion in completions:
                try:
                    completion.then(outcome)
                except Exception:  # one message's settlement must not stop everyone else's
                    log.exception("settling job %s after its completion failed", completion.job_id)
