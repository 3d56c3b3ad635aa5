"""``workerpool dlq``: failure records on a dead-letter subscription."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import click


@click.group()
def dlq() -> None:
    """Inspect and replay failure records on a dead-letter subscription."""


_DLQ_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--project", required=True),
    click.option("--subscription", required=True, help="The dead-letter subscription."),
    click.option("--job", "job_name", help="Only records of this job."),
]


def _dlq_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_DLQ_OPTIONS):
        func = option(func)
    return func


@dlq.command("list")
@_dlq_options
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
def dlq_list(project: str, subscription: str, job_name: str | None, limit: int) -> None:
    """Show failure records as a table, leaving them on the subscription."""
    from workerpool.ops.dlq import peek, table
    from workerpool.pubsub import connect, describe_subscription, subscription_path

    clients = connect()
    try:
        path = subscription_path(project, subscription)
        describe_subscription(clients.subscriber, path)  # a missing one: exit 2, one line
        records = peek(clients.subscriber, path, limit=limit, job=job_name)
    finally:
        clients.close()
    for line in table(records):
        click.echo(line)
    click.echo(f"{len(records)} record(s) on {path}")


@dlq.command("replay")
@_dlq_options
@click.option("--limit", type=click.IntRange(1), help="Replay at most this many.")
@click.option("--dry-run", is_flag=True, help="Say what would be replayed; change nothing.")
def dlq_replay(
    project: str, subscription: str, job_name: str | None, limit: int | None, dry_run: bool
) -> None:
    """Republish failure records to their source topic; ack each once that is confirmed."""
    from workerpool.ops.dlq import Replayer
    from workerpool.pubsub import connect, describe_subscription, subscription_path

    clients = connect()
    counts: Counter[str] = Counter()
    try:
        path = subscription_path(project, subscription)
        describe_subscription(clients.subscriber, path)
        results = Replayer(clients.subscriber, clients.publisher, path).replay(
            job=job_name, limit=limit, dry_run=dry_run
        )
        label = "checking" if dry_run else "replaying"
        with click.progressbar(results, length=limit, label=label) as bar:
            for result in bar:
                counts[result.status] += 1
                if result.status != "replayed":
                    record = result.record
                    detail = f": {result.detail}" if result.detail else f" to {result.topic}"
                    click.echo(f"\n{result.status} {record.job} {record.job_id}{detail}")
    finally:
        clients.close()
    summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    click.echo(f"{summary or 'nothing to replay'} from {path}")
    if counts["failed"]:
        sys.exit(1)
