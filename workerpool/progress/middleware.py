"""The checkpoints middleware: gives each run its ``RunHandle`` (``ctx.checkpoint``,
``ctx.last_checkpoint``, ``ctx.progress``), lists it with the writer while it runs, and has a
finished job's checkpoint deleted.

It sits inside the claim (a duplicate never reads a checkpoint) and just outside the time
limit, so it sees only runs that start their handler. A sync run reads its checkpoint when it
first asks for it; an async one here, on a slot thread, since its handler must not wait for
the store on the event loop. A job finishes when its message is acked as done (after its
completion is recorded) or dead-lettered; a run handed back, retried or killed leaves the
checkpoint for the next run of its job id.
"""

from __future__ import annotations

from workerpool.constants import Label
from workerpool.progress.handle import RunHandle
from workerpool.progress.store import JobStateStore
from workerpool.progress.writer import ProgressWriter
from workerpool.stores import StoreError
from workerpool.worker.middleware import Around, Middleware
from workerpool.worker.outcome import Unavailable
from workerpool.worker.run import Run, Settled

# A cancelled run is finished too: no later run of its job id resumes.
_FINISHED = frozenset({Label.DONE, Label.DEAD_LETTERED, Label.CANCELLED})


class Checkpoints(Middleware):
    def __init__(self, store: JobStateStore, replica: str, *, interval: float = 1.0) -> None:
        self._store = store
        self._replica = replica
        self.writer = ProgressWriter(store, interval=interval)

    def start(self) -> None:
        self.writer.start()

    def around(self, run: Run) -> Around:
        job = run.job
        handle = RunHandle(self._store, job.name, job.job_id, self._replica, run.delivery)
        run.ctx.run_state = handle
        if job.spec.is_async:
            try:
                handle.last()
            except StoreError as exc:
                return Unavailable(f"checkpoints: {exc}")
        self.writer.started(handle)
        try:
            return (yield)
        finally:
            self.writer.ended(handle)

    def settled(self, event: Settled) -> None:
        if event.label in _FINISHED and event.run is not None:
            handle = event.run.ctx.run_state
            if isinstance(handle, RunHandle) and handle.touched:
                self.writer.forget(event.job_id)

    def close(self, timeout: float) -> None:
        self.writer.close(timeout)
