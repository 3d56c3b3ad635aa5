"""``workerpool schedule``: delayed jobs waiting in the workers' schedule, and the periodic
schedules (listed, paused, resumed, triggered, backfilled)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from workerpool import constants as c
from workerpool.assembly.named import find_all
from workerpool.cli.options import load_jobs, store_options
from workerpool.config import load_settings
from workerpool.errors import ConfigError
from workerpool.registry import registry


@click.group()
def schedule() -> None:
    """Delayed jobs waiting in the workers' schedule, and the periodic schedules."""


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
    with _periodic(config_file, idempotency_store) as control:
        rows = control.rows()
    for row in rows:
        click.echo(str(row))
    if rows:
        click.echo(f"{len(rows)} periodic schedule(s)")


def _periodic(config_file: str | None, idempotency_store: str | None) -> Any:
    """The operations on the periodic schedules (workerpool.periodic.control)."""
    from workerpool.periodic.control import operating

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    find_all(settings)  # first: a job may take an option one of them declares
    load_jobs(settings.jobs)
    return operating(settings, registry)


def _on_schedule(command: str, help_text: str, act: Callable[[Any, str], str]) -> None:
    """A ``schedule`` command on one periodic schedule NAME: ``act(control, NAME)`` says
    what it did."""

    @schedule.command(command, help=help_text)
    @click.argument("name")
    @store_options
    def on_schedule(name: str, config_file: str | None, idempotency_store: str | None) -> None:
        with _periodic(config_file, idempotency_store) as control:
            said = act(control, name)
        click.echo(f"{name}: {said}")


_on_schedule(
    "pause",
    "Stop a periodic schedule firing, on every worker, until it is resumed.",
    lambda control, name: control.pause(name, True) or "paused",
)
_on_schedule(
    "resume",
    "Fire a paused schedule's ticks again, from the next (those missed while paused, never).",
    lambda control, name: control.pause(name, False) or "resumed",
)
_on_schedule("trigger", "Run a periodic schedule's job once now, under a job id of its own.",
             lambda control, name: f"triggered {control.trigger(name)} (the next worker to "
             "look publishes it)")  # fmt: skip


@schedule.command("backfill")
@click.argument("name")
@click.option("--from", "start", required=True, help="RFC 3339 time: the first tick, included.")
@click.option("--to", "end", required=True, help="RFC 3339 time: the last tick, included.")
@store_options
def schedule_backfill(
    name: str, start: str, end: str, config_file: str | None, idempotency_store: str | None
) -> None:
    """Fire each tick of a periodic schedule in a past range once (fired ones: not again)."""
    with _periodic(config_file, idempotency_store) as control:
        fired, before = control.backfill(name, start, end)
    click.echo(f"{name}: {fired} tick(s) to fire, {before} fired already")
