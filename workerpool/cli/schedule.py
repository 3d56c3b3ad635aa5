"""``workerpool schedule``: what waits in the workers' schedule."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from workerpool import constants as c
from workerpool.cli.options import store_options
from workerpool.config import load_settings
from workerpool.errors import ConfigError


@click.group()
def schedule() -> None:
    """Delayed jobs waiting in the workers' schedule."""


@schedule.command("list")
@store_options
@click.option("--project", help="With --topic: only the jobs of this topic.")
@click.option("--topic", help="Only the jobs of this topic.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
def schedule_list(
    config_file: str | None,
    idempotency_store: str | None,
    project: str | None,
    topic: str | None,
    limit: int,
) -> None:
    """Show the delayed jobs soonest due first: when, in how long, the job and its id."""
    from workerpool.schedule import schedule_opener
    from workerpool.schedule.when import span

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    opener = schedule_opener(settings.idempotency_store)
    if opener is None:
        raise ConfigError(f"idempotency_store {settings.idempotency_store}: has no schedule")
    if topic and not topic.startswith("projects/"):
        if not (project or settings.project):
            raise ConfigError("--topic: give --project or a projects/P/topics/T path")
        topic = f"projects/{project or settings.project}/topics/{topic}"
    store = opener()
    try:
        entries = store.entries(topic, limit)
    finally:
        store.close()
    now = datetime.now(UTC).timestamp()
    for entry in entries:
        due = datetime.fromtimestamp(entry.due, UTC).isoformat(timespec="seconds")
        job = entry.attributes.get(c.ATTR_JOB, "?")
        click.echo(f"{due}  in {span(entry.due - now):>9}  {job}  {entry.job_id}  {entry.topic}")
    click.echo(f"{len(entries)} delayed job(s)")
