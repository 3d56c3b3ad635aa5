"""The worker's side of batches.

A child's final outcome goes to the batch's ledger: done once its job's done record is
written, and before its message is acked (a failed write is a retry, and the retry finds the
job done; a child's slot waits for that record, which other jobs leave to a batched write off
their slots), dead-lettered once its failure record is out and before its ack (a crash in
between brings the message back). The deadline is a delayed job of the batch's own
(``DEADLINE_JOB``, published with the children, due at the deadline): when it runs it
finalizes whatever is still open. Whichever call finalizes a batch puts its completion in the
schedule, due now, to be published by a firer (this worker's at once). A completion
finalized but never put in the schedule (its worker died in between) is put there by whoever
touches the batch next: a redelivery of one of its children, its deadline job, or any worker
as it starts. A dead-lettered child's message is acked whatever happens, so where its record
finalized the batch and the hand-over failed (a store blip), the hand-over is retried from a
thread of its own until it succeeds or the worker stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from workerpool import constants as c
from workerpool.batches.store import DEADLINE_JOB, BatchStore, Completion, deliver
from workerpool.errors import PermanentError
from workerpool.schedule.delays import Firer
from workerpool.schedule.store import ScheduleStore
from workerpool.stores import StoreError
from workerpool.worker.delivery import Delivery
from workerpool.worker.middleware import Around, Middleware
from workerpool.worker.outcome import (
    SUCCEEDED,
    AlreadyDone,
    Cancelled,
    Outcome,
    Rejected,
    Succeeded,
    Unavailable,
)
from workerpool.worker.run import Run, recorded_now

log = logging.getLogger(__name__)

# Seconds before the first retry of a completion's hand-over to the schedule, and at most
# between retries.
HAND_OVER_FIRST_RETRY = 1.0
HAND_OVER_MAX_RETRY = 60.0


def no_batches(ctx: object, payload: object) -> None:
    """``DEADLINE_JOB``'s handler where the worker keeps no batches: never runs there."""
    raise PermanentError("this worker's idempotency store keeps no batches")


class Batches(Middleware):
    def __init__(
        self,
        batches: BatchStore,
        schedule: ScheduleStore,
        firer: Firer,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._batches = batches
        self._schedule = schedule
        self._firer = firer
        self._clock = clock
        self._closing = threading.Event()  # ends hand-overs still being retried

    def start(self) -> None:
        self._batches.purge()
        try:
            for completion in self._batches.unsent():
                log.warning(
                    "batch %s: finalized, its completion not in the schedule (its worker died "
                    "before handing it over, or is just doing so); handing it over",
                    completion.batch.batch_id,
                )
                self._deliver(completion)
        except StoreError as exc:  # a child's redelivery or the deadline hands it over later
            log.warning("batches with a completion not handed over were not read (%s)", exc)

    def before(self, run: Run) -> Outcome | None:
        return self._expire(run.job.payload) if run.job.name == DEADLINE_JOB else None

    def around(self, run: Run) -> Around | None:
        batch_id = run.job.attributes.get(c.ATTR_BATCH_ID)
        return self._record_child(run, batch_id) if batch_id else None

    def _record_child(self, run: Run, batch_id: str) -> Around:
        outcome = yield
        if isinstance(outcome, Succeeded | AlreadyDone | Cancelled):
            if run.completion is not None:
                # The job's done record first, on this thread: counted in its batch while
                # that record could still fail, the child would run again, maybe after its
                # batch had completed.
                recording, run.completion = recorded_now(run.completion), None
                if not isinstance(recording, Succeeded):
                    return recording  # not recorded: it comes back, and is written then
            cancelled = isinstance(outcome, Cancelled)
            try:
                self._deliver(
                    self._batches.record(batch_id, run.job.job_id, not cancelled,
                                         cancelled=cancelled)
                )  # fmt: skip
            except StoreError as exc:  # the retry finds the job done (or cancelled) then
                return Unavailable(f"batch store: {exc}")
        return outcome

    def dead_lettered(self, delivery: Delivery, job_id: str) -> None:
        batch_id = delivery.attributes.get(c.ATTR_BATCH_ID)
        if not batch_id:
            return
        try:
            completion = self._batches.record(batch_id, job_id, False)
        except StoreError as exc:
            log.error(
                "batch %s: dead-lettered child %s not recorded (%s); the batch's deadline "
                "finalizes it",
                batch_id,
                job_id,
                exc,
            )
            return
        if completion is None:
            return  # the batch is still open, or this changed nothing
        try:
            self._deliver(completion)
        except StoreError as exc:
            # Its message is acked next: no redelivery will touch the batch again, and its
            # deadline may be an hour away. Hand the completion over from a thread of its own.
            log.warning(
                "batch %s: finalized by dead-lettered child %s, its completion not handed "
                "over (%s); trying again",
                batch_id,
                job_id,
                exc,
            )
            threading.Thread(
                target=self._hand_over, args=(completion,), name="workerpool-batch-handover",
                daemon=True,
            ).start()  # fmt: skip

    def _hand_over(self, completion: Completion) -> None:
        """Retry ``_deliver`` with capped backoff until it succeeds or the worker stops (the
        next worker to start hands it over then, or the batch's deadline job)."""
        delay = HAND_OVER_FIRST_RETRY
        while not self._closing.wait(delay):
            try:
                self._deliver(completion)
            except StoreError:
                delay = min(delay * 2, HAND_OVER_MAX_RETRY)
                continue
            except Exception:  # a bug (or the store closed under it as the worker stopped)
                if not self._closing.is_set():
                    log.exception("batch %s: handing its completion over failed",
                                  completion.batch.batch_id)  # fmt: skip
                return  # the batch's deadline job hands it over
            log.info("batch %s: completion handed over", completion.batch.batch_id)
            return

    def _expire(self, payload: object) -> Outcome:
        batch_id = payload.get("batch_id") if isinstance(payload, dict) else None
        if not isinstance(batch_id, str) or not batch_id:
            return Rejected(c.ERR_INVALID_PAYLOAD, f"{DEADLINE_JOB} needs a batch_id")
        try:
            self._deliver(self._batches.expire(batch_id))
        except StoreError as exc:
            return Unavailable(f"batch store: {exc}")
        return SUCCEEDED

    def _deliver(self, completion: Completion | None) -> None:
        due = deliver(completion, self._batches, self._schedule, self._clock)
        if due is not None:
            self._firer.expect(due)

    def close(self, timeout: float) -> None:
        self._closing.set()
        self._batches.close()
