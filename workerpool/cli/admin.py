"""``workerpool provision`` and ``status``: the subscription and what the fleet holds."""

from __future__ import annotations

from typing import Any

import click

from workerpool.config import load_settings


@click.command()
@click.option("--project", required=True)
@click.option("--topic", required=True)
@click.option("--subscription", required=True)
@click.option("--dead-letter-topic", required=True)
@click.option("--dead-letter-subscription", default="", help="Default: DEAD_LETTER_TOPIC-sub.")
@click.option("--ack-deadline", type=click.IntRange(10, 600), default=60, show_default=True)
@click.option("--max-delivery-attempts", type=click.IntRange(5, 100), default=10, show_default=True)
@click.option("--min-backoff", type=click.FloatRange(0, 600), default=10, show_default=True)
@click.option("--max-backoff", type=click.FloatRange(0, 600), default=600, show_default=True)
@click.option("--filter", "filter_", default="", help="Subscription filter expression.")
@click.option("--exactly-once", is_flag=True, help="Enable exactly-once delivery.")
@click.option("--ordered", is_flag=True, help="Enable message ordering (by ordering key).")
def provision(**options: Any) -> None:
    """Create the topic, subscription, dead-letter topic and its subscription (idempotent)."""
    from workerpool.ops.admin import ProvisionRequest
    from workerpool.ops.admin import provision as provision_resources
    from workerpool.pubsub import connect

    options["filter"] = options.pop("filter_")
    clients = connect()
    try:
        for resource, created in provision_resources(
            clients.publisher, clients.subscriber, ProvisionRequest(**options)
        ):
            click.echo(f"{'created' if created else 'exists '}  {resource}")
    finally:
        clients.close()


@click.command()
@click.option("--project", help="Required but with --running.")
@click.option("--subscription", help="Required but with --running.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--idempotency-store", help="The store the workers share (slots, progress).")
@click.option("--concurrency", multiple=True, help="A limit KEY=LIMIT to show (repeatable).")
@click.option("--running", is_flag=True, help="Only the jobs running now, with their progress.")
def status(
    project: str | None,
    subscription: str | None,
    config_file: str | None,
    idempotency_store: str | None,
    concurrency: tuple[str, ...],
    running: bool,
) -> None:
    """Show a subscription's settings, its backlog where Cloud Monitoring is reachable, and
    each declared concurrency key's limit, holders and waiters; or (--running) the jobs
    running in the fleet: job, job id, replica, started, progress, note."""
    from workerpool.ops.status import slot_lines, status_lines
    from workerpool.pubsub import connect, subscription_path
    from workerpool.slots import open_slot_store

    flags = {"idempotency_store": idempotency_store, "concurrency": concurrency}
    settings = load_settings(config_file, flags)
    if running:
        from workerpool.progress.running import running_now

        for line in running_now(settings.idempotency_store):
            click.echo(line)
        return
    if not project or not subscription:
        raise click.UsageError("--project and --subscription are required (but with --running)")
    slots: list[tuple[str, str]] = []
    if settings.concurrency:
        store = open_slot_store(settings.idempotency_store)
        try:
            slots = slot_lines(store, settings.concurrency, settings.concurrency_shards)
        finally:
            store.close()
    clients = connect()
    try:
        lines = status_lines(clients.subscriber, subscription_path(project, subscription), slots)
    finally:
        clients.close()
    from workerpool.ordering import blocked_status

    for line in lines + blocked_status(settings.idempotency_store):
        click.echo(line)
