"""The checkpoints middleware: gives each run its ``RunHandle`` (``ctx.checkpoint``,
``ctx.last_checkpoint``, ``ctx.progress``), lists it with the writer while it runs, and has a
finished job's checkpoint deleted.

It sits inside the claim (a duplicate never reads a checkpoint) and just outside the time
limit, so it sees only runs that start their handler. A sync run reads its checkpoint when it
first asks for it. An async one must have it before its handler starts, since the handler
must not wait for the store on the event loop: the async jobs of a pull have theirs read in
one read as the pull is admitted (after their claims: while this worker holds a job id, only
its run writes the job's checkpoint), or, if that read failed or began before the run's claim
was granted (refused at admission, held by another worker's run), each here on a slot thread.
One read a pull instead of one a run: on SQLite at N = 64, a read at each start was a third
of what the defaults added to an async job's CPU.

A job finishes when its message is acked as done (after its completion is recorded),
dead-lettered or cancelled; a run handed back, retried or killed leaves the checkpoint for the
next run of its job id. A run that never met a checkpoint (read none, wrote none) has none to
delete, but a cancelled one may have ended before it read its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from workerpool.constants import Label
from workerpool.progress.handle import RunHandle
from workerpool.progress.store import JobStateStore
from workerpool.progress.writer import ProgressWriter
from workerpool.stores import StoreError
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import job_id_of
from workerpool.worker.middleware import Ended, Middleware
from workerpool.worker.outcome import Outcome, Unavailable
from workerpool.worker.run import Run, Settled

# Where a job finishes by a run that met its checkpoint (a cancelled one, whatever its run
# did: see ``settled``), no later run of its job id resumes.
_FINISHED = frozenset({Label.DONE, Label.DEAD_LETTERED})


class Checkpoints(Middleware):
    """``is_async``: whether a delivery's job is an ``async def`` (its checkpoint is read as
    it is admitted)."""

    def __init__(
        self,
        store: JobStateStore,
        replica: str,
        *,
        interval: float = 1.0,
        is_async: Callable[[Delivery], bool] = lambda delivery: False,
    ) -> None:
        self._store = store
        self._replica = replica
        self._is_async = is_async
        self.writer = ProgressWriter(store, interval=interval)
        self._lock = threading.Lock()
        # Read as admitted, until the job id's run starts or its message leaves: its
        # checkpoint (None for none), and when the read began (``time.monotonic``).
        self._read: dict[str, tuple[str | None, float]] = {}

    def start(self) -> None:
        self.writer.start()

    def before(self, run: Run) -> Outcome | None:
        job = run.job
        handle = RunHandle(self._store, job.name, job.job_id, self._replica, run.delivery)
        run.ctx.run_state = handle
        if job.spec.is_async:
            with self._lock:
                read = self._read.pop(job.job_id, None)
            try:
                # A read that began before the run's claim was granted may predate what
                # another worker's run wrote while it held the job id: read again.
                if read is not None and (run.claimed_at is None or read[1] >= run.claimed_at):
                    handle.read(read[0])
                else:
                    handle.last()
            except StoreError as exc:
                return Unavailable(f"checkpoints: {exc}")
        self.writer.started(handle)
        return None

    def after(self, run: Run, ended: Ended) -> Ended:
        handle = run.ctx.run_state  # the one ``before`` gave it
        if isinstance(handle, RunHandle):
            self.writer.ended(handle)
        return ended

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        job_ids = [job_id_of(delivery) for delivery in deliveries if self._is_async(delivery)]
        if not job_ids:
            return
        began = time.monotonic()
        try:
            found = self._store.load_many(job_ids)
        except StoreError:
            return  # each run reads its own as it starts
        with self._lock:
            for job_id in job_ids:
                self._read[job_id] = (found.get(job_id), began)

    def settled(self, event: Settled) -> None:
        if self._read:
            with self._lock:
                self._read.pop(event.job_id, None)  # never ran here (or ran: popped already)
        if event.label is Label.CANCELLED:
            # Its run may have ended before it could read the checkpoint an earlier run left
            # (cancelled at the gate, or before its handler): delete whatever there is. One
            # delete a cancel, which is rare.
            self.writer.forget(event.job_id)
        elif event.label in _FINISHED and event.run is not None:
            handle = event.run.ctx.run_state
            if isinstance(handle, RunHandle) and handle.touched:
                self.writer.forget(event.job_id)

    def close(self, timeout: float) -> None:
        self.writer.close(timeout)
