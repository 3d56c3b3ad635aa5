"""``workerpool cancel``: job control from outside the worker."""

from __future__ import annotations

import click

from workerpool.cli.options import store_options
from workerpool.config import load_settings


@click.command("cancel")
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--reason", default="", help="Why, kept with the cancel and logged by the worker.")
@store_options
def cancel(
    job_ids: tuple[str, ...], reason: str, config_file: str | None, idempotency_store: str | None
) -> None:
    """Cancel jobs by id: one not started yet never starts, a running one is cancelled."""
    from workerpool.control.cancel import cancel as cancel_jobs

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    for answer in cancel_jobs(job_ids, reason=reason, store=settings):
        click.echo(answer.line())
