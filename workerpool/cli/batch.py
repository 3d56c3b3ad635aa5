"""``workerpool batch``: batches and how far each has got."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click

from workerpool.cli.options import store_options
from workerpool.config import load_settings
from workerpool.errors import ConfigError


@click.group()
def batch() -> None:
    """Batches and how far each has got."""


def _open_batches(config_file: str | None, idempotency_store: str | None) -> Any:
    from workerpool.batches import batch_opener

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    opener = batch_opener(settings.idempotency_store)
    if opener is None:
        raise ConfigError(f"idempotency_store {settings.idempotency_store}: keeps no batches")
    return opener()


def _batch_line(b: Any) -> str:
    deadline = datetime.fromtimestamp(b.deadline, UTC).isoformat(timespec="seconds")
    if b.finalized_by:
        state = f"finalized by {b.finalized_by}"
    else:
        state = "open" if b.committed else "publishing (not open yet)"
    return (
        f"{b.batch_id}  total {b.total}  done {b.done}  failed {b.failed}  pending {b.pending}"
        f"  deadline {deadline}  {state}"
    )


@batch.command("status")
@click.argument("batch_id")
@store_options
def batch_status(batch_id: str, config_file: str | None, idempotency_store: str | None) -> None:
    """Show one batch: totals, done, failed, pending, its deadline and state."""
    store = _open_batches(config_file, idempotency_store)
    try:
        found = store.get(batch_id)
    finally:
        store.close()
    if found is None:
        raise ConfigError(f"no batch {batch_id}")
    click.echo(_batch_line(found))


@batch.command("list")
@store_options
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
def batch_list(config_file: str | None, idempotency_store: str | None, limit: int) -> None:
    """Show the batches, soonest deadline first."""
    store = _open_batches(config_file, idempotency_store)
    try:
        found = store.batches(limit)
    finally:
        store.close()
    for each in found:
        click.echo(_batch_line(each))
    click.echo(f"{len(found)} batch(es)")


@batch.command("cancel")
@click.argument("batch_id")
@click.option("--reason", default="", help="Why, kept with each child's cancel.")
@store_options
def batch_cancel(
    batch_id: str, reason: str, config_file: str | None, idempotency_store: str | None
) -> None:
    """Cancel the children of a batch not finished yet; its completion counts them."""
    from workerpool.control.cancel import cancel_batch

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    answers = cancel_batch(batch_id, reason=reason, store=settings)
    cancelled = sum(answer.state != "finished" for answer in answers)
    click.echo(f"batch {batch_id}: {cancelled} children cancelled")
