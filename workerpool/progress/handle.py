"""One run's checkpoints and progress (``ctx.checkpoint``, ``ctx.last_checkpoint``,
``ctx.progress``): a checkpoint is written at once, progress only kept here for the writer."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from workerpool.progress.store import MAX_CHECKPOINT_BYTES, JobStateStore
from workerpool.worker.delivery import Delivery

log = logging.getLogger(__name__)


class CheckpointTooLarge(ValueError):
    """A checkpoint's JSON is over ``MAX_CHECKPOINT_BYTES``."""


class RunHandle:
    """Holds the run's delivery, not the run: the run's context holds this, and a cycle per
    run would be left to the garbage collector."""

    __slots__ = (
        "_delivery", "_last", "_loaded", "_store", "changed", "job", "job_id", "key",
        "progress", "replica", "started", "touched",
    )  # fmt: skip

    def __init__(
        self, store: JobStateStore, job: str, job_id: str, replica: str, delivery: Delivery
    ) -> None:
        self._store = store
        self._delivery = delivery
        self.job = job
        self.job_id = job_id
        self.replica = replica
        self.key = f"{replica}/{job_id}"
        self.started = time.time()
        self._loaded = False
        self._last: Any = None
        # Whether the job id has a checkpoint to delete once it finishes (this run saved one
        # or found one): a job that never checkpoints costs the store nothing.
        self.touched = False
        self.progress: tuple[float | None, float | None, str] = (None, None, "")
        self.changed = 0  # counts reports, for the writer to tell a new one

    def last(self) -> Any:
        if not self._loaded:
            self.read(self._store.load(self.job_id))
        return self._last

    def read(self, text: str | None) -> None:
        """The job id's checkpoint as read from the store (None: it has none)."""
        self._last = None if text is None else json.loads(text)
        self._loaded = True
        self.touched = self.touched or text is not None

    def save(self, state: Any) -> None:
        text = json.dumps(state, separators=(",", ":"), allow_nan=False)
        size = len(text.encode())
        if size > MAX_CHECKPOINT_BYTES:
            raise CheckpointTooLarge(
                f"checkpoint of job {self.job} ({self.job_id}) is {size:,} bytes as JSON; the "
                f"limit is {MAX_CHECKPOINT_BYTES:,}: keep where to resume, not the data"
            )
        if self._delivery.settled:
            # Handed back (the drain deadline, a lost claim): the job id's next run may
            # already be checkpointing, and this run's older state must not overwrite it.
            log.warning("job %s (%s): checkpoint after its run was handed back, not stored",
                        self.job, self.job_id)  # fmt: skip
            return
        self._store.save(self.job_id, text, time.time())
        self._last = json.loads(text)  # a copy: what a next run would get
        self._loaded = self.touched = True

    def report(self, done: float, total: float | None, note: str) -> None:
        self.progress = (done, total, note)
        self.changed += 1
