"""Blocking an ordering key whose job exhausted its attempts, for the jobs that ask for it.

``@job(..., ordered_exhausted="block")``: when such a job's message is recorded as
``attempts_exhausted`` (the failure record, as for any job), its ordering key is blocked in
the shared store, and every later message of the key is given back unrun (deferred) until
``workerpool ordering unblock KEY``. The default, ``"record"``, records and goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import ClassVar

from workerpool import constants as c
from workerpool.constants import Label
from workerpool.ordering import open_blocked_keys
from workerpool.ordering.blocks import BlockedKeys, MemoryBlocks
from workerpool.registry import JobSpec
from workerpool.worker.middleware import Middleware
from workerpool.worker.outcome import Deferred, Outcome
from workerpool.worker.run import Run, Settled

log = logging.getLogger(__name__)

OPTION = "ordered_exhausted"
BLOCK, RECORD = "block", "record"

# How long a message of a blocked key stays away before it comes back to look again: each
# give-back counts as a delivery attempt, so not often.
BLOCKED_RECHECK_SECONDS = 5.0


class KeyBlocks(Middleware):
    options: ClassVar[frozenset[str]] = frozenset({OPTION})

    def __init__(self, blocks: BlockedKeys, on_block: Callable[[str], None]) -> None:
        """``on_block(job)``: a key was blocked by a job of that name (the metric)."""
        self._blocks = blocks
        self._on_block = on_block

    def before(self, run: Run) -> Outcome | None:
        key = run.delivery.ordering_key
        if key and self._blocks.blocked(key):
            return Deferred(f"ordering key {key!r} is blocked", BLOCKED_RECHECK_SECONDS)
        return None

    def settled(self, event: Settled) -> None:
        run = event.run
        if (
            run is None
            or event.label is not Label.DEAD_LETTERED
            or event.error_type != c.ERR_ATTEMPTS_EXHAUSTED
            or run.job.spec.options.get(OPTION) != BLOCK
            or not run.delivery.ordering_key
        ):
            return
        try:
            self._blocks.block(run.delivery.ordering_key, event.job, event.job_id)
        except Exception:  # must not raise: the failure record is published either way
            log.exception("ordering key %r not blocked", run.delivery.ordering_key)
            return
        self._on_block(event.job)
        log.warning(
            "ordering key %r blocked: job %s (%s) exhausted its attempts; "
            "`workerpool ordering unblock` lets it go on",
            run.delivery.ordering_key, event.job, event.job_id,
        )  # fmt: skip


def key_blocks(
    specs: Iterable[JobSpec], store_url: str, on_block: Callable[[str], None]
) -> list[Middleware]:
    """The middleware, for a worker with a job that sets the option (the store opened only
    where one blocks: a ``ConfigError`` if it cannot be); else none."""
    choices = {spec.options[OPTION] for spec in specs if OPTION in spec.options}
    if not choices:
        return []
    blocks = open_blocked_keys(store_url) if BLOCK in choices else MemoryBlocks()
    return [KeyBlocks(blocks, on_block)]
