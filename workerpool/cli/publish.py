"""``workerpool publish``: one job, a file of them, delayed, or as one batch."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any

import click

from workerpool.errors import ConfigError
from workerpool.publishing import JobMessage, publish_batch, publish_many, read_jsonl
from workerpool.telemetry.exporters import publish_span
from workerpool.worker.envelope import parse_json


@click.command()
@click.option("--project", required=True)
@click.option("--topic", required=True)
@click.option("--job", "job_name", help="Job name (with --data).")
@click.option("--job-id", default="", help="Idempotency key.")
@click.option("--ordering-key", default="", help="Jobs of one key run in publish order.")
@click.option("--data", help="JSON object payload.")
@click.option(
    "--file", "jsonl", type=click.File("rb"),
    help='JSON lines: {"job","job_id","data","ordering_key"}.',
)  # fmt: skip
@click.option("--delay", help="Start no sooner than this from now: 90s, 5m, 2h, 2d.")
@click.option(
    "--not-before", help="Start no sooner than this RFC 3339 time (2026-12-24T09:00:00Z)."
)
@click.option("--on-complete", help="Publish them as one batch: the job to run when all end.")
@click.option("--batch-id", help="The batch's id (default: a new one).")
@click.option("--batch-deadline", default="1h", show_default=True, help="Finalize it then.")
@click.option("--idempotency-store", help="The store the workers share (for the batch).")
def publish(
    project: str,
    topic: str,
    job_name: str | None,
    job_id: str,
    ordering_key: str,
    data: str | None,
    jsonl: Any,
    delay: str | None,
    not_before: str | None,
    on_complete: str | None,
    batch_id: str | None,
    batch_deadline: str,
    idempotency_store: str | None,
) -> None:
    """Publish one job (--job/--data) or many (--file), now or delayed, or as one batch."""
    from workerpool.pubsub import connect, topic_path

    when = _not_before(delay, not_before)
    messages = _messages(jsonl, job_name, job_id, data)
    if ordering_key:  # for every line of a --file that names no key of its own
        messages = [m if m.ordering_key else dataclasses.replace(m, ordering_key=ordering_key)
                    for m in messages]  # fmt: skip
    if when:
        messages = [dataclasses.replace(m, not_before=when) for m in messages]
    deadline, path = _deadline(batch_deadline), topic_path(project, topic)
    clients = connect()  # once all of the input is known to be good
    try:
        if on_complete:
            made = publish_batch(
                path, messages, on_complete=on_complete, deadline=deadline,
                batch_id=batch_id, store=idempotency_store, publisher=clients.publisher,
            )  # fmt: skip
            click.echo(f"published batch {made} of {len(messages)} job(s) to {path}")
            return
        ids = publish_many(clients.publisher, path, messages)
        with (
            publish_span(path),
            click.progressbar(ids, length=len(messages), label="publishing") as bar,
        ):
            count = sum(1 for _ in bar)
        click.echo(f"published {count} job(s) to {path}")
    finally:
        clients.close()


def _deadline(text: str) -> timedelta:
    from workerpool.schedule.when import parse_delay

    try:
        return parse_delay(text)
    except ValueError as exc:
        raise ConfigError(f"--batch-deadline: {exc}") from None


def _messages(jsonl: Any, job_name: str | None, job_id: str, data: str | None) -> list[JobMessage]:
    """The jobs ``publish`` was given: the lines of --file, or --job with --data."""
    if jsonl is not None:
        return read_jsonl(jsonl, getattr(jsonl, "name", "--file"))
    if not (job_name and data is not None):
        raise ConfigError("give --job and --data, or --file")
    try:
        # As bytes, so that an argument that is not UTF-8 is refused as such
        payload = parse_json(os.fsencode(data))
    except ValueError as exc:
        raise ConfigError(f"--data is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ConfigError("--data: JSON nested too deeply to parse") from None
    if not isinstance(payload, dict):
        raise ConfigError("--data must be a JSON object")
    try:
        return [JobMessage(job_name, payload, job_id)]
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--job/--job-id: {exc}") from None


def _not_before(delay: str | None, not_before: str | None) -> str:
    """The not_before attribute the flags ask for ("" for none); ConfigError naming them."""
    from workerpool.schedule.when import not_before_text, parse_delay, parse_rfc3339

    if delay and not_before:
        raise ConfigError("give --delay or --not-before, not both")
    try:
        if delay:
            return not_before_text(parse_delay(delay))
        if not_before:
            return not_before_text(parse_rfc3339(not_before))
    except ValueError as exc:
        raise ConfigError(f"--delay/--not-before: {exc}") from None
    return ""
