"""Blocking an ordering key whose job exhausted its attempts, for the jobs that ask for it.

``@job(..., ordered_exhausted="block")``: when such a job's message is to be recorded as
``attempts_exhausted`` (the failure record, as for any job), its ordering key is blocked in
the shared store first, and every later message of the key is given back unrun (deferred)
until ``workerpool ordering unblock KEY``. The default, ``"record"``, records and goes on. The
block is written before the record is published and the message acked: if it cannot be, the
message is given back, as when its record cannot be published, and no later message of the
key runs meanwhile. The message that blocked its key runs again if it comes back (its record
did not go out), to be recorded then.

The gauge ``workerpool.ordering.keys_blocked`` reads the keys blocked now from the shared
store, by the job that blocked them, each time a reader collects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

from workerpool import constants as c
from workerpool.ordering import open_blocked_keys
from workerpool.ordering.blocks import BlockedKeys, MemoryBlocks
from workerpool.registry import JobSpec
from workerpool.stores import StoreError
from workerpool.worker.delivery import Delivery
from workerpool.worker.middleware import Middleware
from workerpool.worker.outcome import Deferred, Outcome, Unavailable
from workerpool.worker.run import Run

log = logging.getLogger(__name__)

OPTION = "ordered_exhausted"
BLOCK, RECORD = "block", "record"

# How long a message of a blocked key stays away before it comes back to look again: each
# give-back counts as a delivery attempt, so not often.
BLOCKED_RECHECK_SECONDS = 5.0

# The keys blocked now, by the job that blocked them; None when the store cannot be read.
BlockedNow = Callable[[], Mapping[str, int] | None]


class KeyBlocks(Middleware):
    options: ClassVar[frozenset[str]] = frozenset({OPTION})

    def __init__(self, blocks: BlockedKeys, blocking_jobs: Iterable[str] = ()) -> None:
        """``blocking_jobs``: this worker's jobs that block their key (0 is reported for
        each of them while none is blocked)."""
        self._blocks = blocks
        self._blocking_jobs = sorted(blocking_jobs)

    def before(self, run: Run) -> Outcome | None:
        key = run.delivery.ordering_key
        if not key:
            return None
        try:
            blocker = self._blocks.blocker(key)
        except StoreError as exc:  # not known: neither run it out of turn nor count a failure
            return Unavailable(f"blocked ordering keys: {exc}")
        if blocker is not None and blocker != run.job.job_id:
            return Deferred(f"ordering key {key!r} is blocked", BLOCKED_RECHECK_SECONDS)
        return None

    def blocked_now(self) -> dict[str, int] | None:
        """The keys blocked now in the shared store, by the job that blocked them; None if
        the store cannot be read (the gauge then reports nothing rather than a wrong 0)."""
        try:
            blocks = self._blocks.all()
        except StoreError as exc:
            log.warning("blocked ordering keys not read for the gauge: %s", exc)
            return None
        counts = dict.fromkeys(self._blocking_jobs, 0)
        for block in blocks:
            counts[block.job] = counts.get(block.job, 0) + 1
        return counts

    def close(self, timeout: float) -> None:
        self._blocks.close()

    def dead_lettering(self, delivery: Delivery, run: Run | None, error_type: str) -> None:
        key = delivery.ordering_key
        if (
            run is None
            or error_type != c.ERR_ATTEMPTS_EXHAUSTED
            or run.job.spec.options.get(OPTION) != BLOCK
            or not key
        ):
            return
        self._blocks.block(key, run.job.name, run.job.job_id)  # (a StoreError: given back)
        log.warning(
            "ordering key %r blocked: job %s (%s) exhausted its attempts; "
            "`workerpool ordering unblock` lets it go on",
            key, run.job.name, run.job.job_id,
        )  # fmt: skip


def key_blocks(
    specs: Iterable[JobSpec], store_url: str, watch: Callable[[BlockedNow], None]
) -> list[Middleware]:
    """The middleware, for a worker with a job that sets the option (the store opened only
    where one blocks: a ``ConfigError`` if it cannot be; ``watch`` is then given what the
    gauge reads); else none."""
    choices = {spec.name: spec.options[OPTION] for spec in specs if OPTION in spec.options}
    if not choices:
        return []
    blocking = [name for name, choice in choices.items() if choice == BLOCK]
    if not blocking:
        return [KeyBlocks(MemoryBlocks())]
    middleware = KeyBlocks(open_blocked_keys(store_url), blocking)
    watch(middleware.blocked_now)
    return [middleware]
