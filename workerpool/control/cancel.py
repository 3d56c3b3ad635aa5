"""``workerpool.cancel``: record cancels of job ids in the store the fleet shares, unless a
job already finished (its completion recorded): that cancel changes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from workerpool.batches import batch_opener
from workerpool.config import Settings, load_settings
from workerpool.control.opening import cancel_opener
from workerpool.control.store import SEEN_WITHIN, Cancel
from workerpool.errors import ConfigError
from workerpool.idempotency import store_opener
from workerpool.stores import require_shared

State = Literal["cancelled", "already_cancelled", "finished"]


@dataclass(frozen=True)
class Answer:
    """What a cancel of ``job_id`` did: recorded it (``cancelled``), found an earlier cancel
    (``already_cancelled``: its reason and time stand), or nothing (``finished``: ``at`` is
    when the job completed)."""

    job_id: str
    state: State
    at: float
    reason: str = ""

    def line(self) -> str:
        when = datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds")
        match self.state:
            case "cancelled":
                return f"{self.job_id}: cancelled"
            case "already_cancelled":
                return f"{self.job_id}: already cancelled at {when}"
        return f"{self.job_id}: already finished at {when}; nothing changed"


def cancel(
    job_ids: str | Sequence[str],
    *,
    reason: str = "",
    store: str | Settings | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Answer]:
    """Cancel jobs by id: one not started when this returns never starts, a running one sees
    ``ctx.cancelled`` and ends ``cancelled``, on whatever replica holds it. ``store`` is the
    idempotency store's URL, or the settings that name it (default: the settings of the
    config file and the environment). A new cancel makes this wait ``SEEN_WITHIN`` after
    writing it, the time within which every worker has read it before starting its job.
    Raises ``ConfigError`` for a store that keeps no cancels, ``StoreError`` if it cannot
    be reached."""
    ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
    url = _url(store)
    try:
        open_cancels, open_claims = cancel_opener(url), store_opener(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None
    if open_cancels is None or open_claims is None:
        raise ConfigError(f"idempotency_store {url}: keeps no cancels")
    require_shared(url, "cancels")
    claims = open_claims()
    try:
        cancels = open_cancels()
        try:
            answers = [
                _one(job_id, reason, claims.completed_at, cancels.add, clock) for job_id in ids
            ]
        finally:
            cancels.close()
    finally:
        claims.close()
    if any(answer.state == "cancelled" for answer in answers):
        sleep(SEEN_WITHIN)
    return answers


def cancel_batch(
    batch_id: str, *, reason: str = "", store: str | Settings | None = None
) -> list[Answer]:
    """Cancel the children of a batch that have no final outcome yet (``cancel`` each): the
    rest never start, a running one is cancelled, and the batch's completion runs once, with
    them counted as ``cancelled``. Raises ``ConfigError`` for a batch the store does not have."""
    url = _url(store)
    try:
        open_batches = batch_opener(url)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store: {exc}") from None
    if open_batches is None:
        raise ConfigError(f"idempotency_store {url}: keeps no batches")
    batches = open_batches()
    try:
        batch = batches.get(batch_id)
        if batch is None:
            raise ConfigError(f"no batch {batch_id}")
        pending = batches.pending(batch_id, batch.total)
    finally:
        batches.close()
    return cancel(pending, reason=reason, store=url) if pending else []


def _one(
    job_id: str,
    reason: str,
    completed_at: Callable[[str], float | None],
    add: Callable[[Cancel], Cancel],
    clock: Callable[[], float],
) -> Answer:
    finished = completed_at(job_id)
    if finished is not None:
        return Answer(job_id, "finished", finished)
    asked = Cancel(job_id, reason, clock())
    kept = add(asked)
    state: State = "cancelled" if kept == asked else "already_cancelled"
    return Answer(job_id, state, kept.at, kept.reason)


def _url(store: str | Settings | None) -> str:
    if isinstance(store, Settings):
        return store.idempotency_store
    return store if store is not None else load_settings().idempotency_store
