"""``workerpool ordering``: ordering keys blocked after a job exhausted its attempts (listed,
let go on)."""

from __future__ import annotations

import click

from workerpool.cli.options import store_options
from workerpool.config import load_settings
from workerpool.errors import ConfigError


@click.group()
def ordering() -> None:
    """Ordering keys blocked until an operator lets them go on."""


@ordering.command("blocked")
@store_options
def ordering_blocked(config_file: str | None, idempotency_store: str | None) -> None:
    """List the blocked keys, with the job that exhausted its attempts."""
    from workerpool.ordering import blocked_lines

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    lines = blocked_lines(settings.idempotency_store)
    for line in lines:
        click.echo(line)
    click.echo(f"{len(lines)} blocked key(s)")


@ordering.command("unblock")
@click.argument("key")
@store_options
def ordering_unblock(key: str, config_file: str | None, idempotency_store: str | None) -> None:
    """Let KEY go on: its later messages run, in order (the exhausted one is not run again;
    its failure record is on the dead-letter topic, for `workerpool dlq replay`)."""
    from workerpool.ordering import unblock

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    if not unblock(settings.idempotency_store, key):
        raise ConfigError(f"ordering key {key!r} is not blocked")
    click.echo(f"ordering key {key} unblocked")


@ordering.command("replay")
@click.argument("key")
@click.option("--project", required=True)
@click.option(
    "--dead-letter-subscription", required=True, help="Where the failure records are read."
)
@click.option(
    "--wait", type=click.FloatRange(0), default=600.0, show_default=True,
    help="Seconds to wait for the replayed job to complete before giving up.",
)  # fmt: skip
@store_options
def ordering_replay(
    key: str,
    project: str,
    dead_letter_subscription: str,
    wait: float,
    config_file: str | None,
    idempotency_store: str | None,
) -> None:
    """Run the job that blocked KEY again, first, then let KEY go on once it has completed
    (exit 1, KEY still blocked, if it has not within --wait)."""
    from workerpool.ops.dlq import Replayer
    from workerpool.ordering.replay import NotCompleted, replay_then_unblock, replaying
    from workerpool.pubsub import connect, describe_subscription, subscription_path

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    clients = connect()
    try:
        path = subscription_path(project, dead_letter_subscription)
        describe_subscription(clients.subscriber, path)  # a missing one: exit 2, one line
        replay = replaying(Replayer(clients.subscriber, clients.publisher, path))
        replay_then_unblock(settings.idempotency_store, key, replay, wait, click.echo)
    except NotCompleted as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        clients.close()
