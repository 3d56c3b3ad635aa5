"""``workerpool ordering replay KEY``: run the job that blocked a key again, first, and let
the key go on only once it has completed.

A failure record carries no ordering key, so its replay is a message without one: it runs
as soon as a worker takes it, while its key stays blocked and the key's later messages wait.
That is what puts it first. Its completion is read from the idempotency store (the job id's
completion record, kept as long as completions are); then the key is unblocked. A replay that
fails again leaves a new failure record, and the key blocked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workerpool.errors import ConfigError
from workerpool.idempotency import IdempotencyStore, store_opener
from workerpool.ops.dlq import Replayed, Replayer
from workerpool.ordering import Block, blocked_now, unblock
from workerpool.stores import StoreError

# How often the job id's completion is read while the replay runs.
POLL_SECONDS = 0.5


# Republishes the failure record of a job id (one at most): what was done with it.
ReplayJob = Callable[[str], list[Replayed]]


def replaying(replayer: Replayer) -> ReplayJob:
    """``replayer``'s records of the job id, one at most."""
    return lambda job_id: list(replayer.replay(match=lambda r: r.job_id == job_id, limit=1))


class NotCompleted(Exception):
    """The replayed job did not complete within the wait: the key stays blocked."""


def replay_then_unblock(
    url: str, key: str, replay: ReplayJob, wait: float, say: Callable[[str], None]
) -> None:
    """Replay the failure record of the job that blocked ``key`` (the idempotency store
    ``url`` names keeps both), wait up to ``wait`` seconds for the job to complete, then
    unblock the key. ``ConfigError`` for a key not blocked, a record not found or a store
    that cannot be read; ``NotCompleted`` if the wait ran out."""
    block = _blocking(url, key)
    store = _completions(url)
    try:
        if _completed(store, block.job_id):
            say(f"job {block.job} ({block.job_id}) has completed already")
        else:
            topic = _replay(replay, block)
            say(f"job {block.job} ({block.job_id}) replayed to {topic}; waiting for it")
            if not _completes_within(store, block.job_id, wait):
                raise NotCompleted(
                    f"job {block.job} ({block.job_id}) has not completed in {wait:g} s; "
                    f"ordering key {key} stays blocked (`workerpool dlq list` shows a new "
                    "failure record if it failed again)"
                )
    finally:
        store.close()
    unblock(url, key)  # False if someone unblocked it meanwhile: it goes on either way
    say(f"job {block.job} ({block.job_id}) completed; ordering key {key} unblocked")


def _blocking(url: str, key: str) -> Block:
    block = blocked_now(url).get(key)
    if block is None:
        raise ConfigError(f"ordering key {key!r} is not blocked")
    return block


def _completions(url: str) -> IdempotencyStore:
    # Only a shared store gets here: none and memory:// (this process's) have no key blocked.
    try:
        opener = store_opener(url)
        assert opener is not None
        return opener()
    except (ValueError, ImportError, StoreError) as exc:
        raise ConfigError(f"idempotency_store (for completions): {exc}") from None


def _replay(replay: ReplayJob, block: Block) -> str:
    results = replay(block.job_id)
    if not results:
        raise ConfigError(
            f"no failure record of job {block.job} ({block.job_id}) on the dead-letter "
            "subscription: nothing replayed, the key stays blocked"
        )
    [result] = results
    if result.status != "replayed":
        raise NotCompleted(f"job {block.job} ({block.job_id}) not replayed: {result.detail}")
    return result.topic


def _completed(store: IdempotencyStore, job_id: str) -> bool:
    try:
        return store.completed_at(job_id) is not None
    except StoreError as exc:
        raise ConfigError(f"idempotency_store (for completions): {exc}") from None


def _completes_within(store: IdempotencyStore, job_id: str, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while not _completed(store, job_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True
