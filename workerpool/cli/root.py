"""The ``workerpool`` group: logging set up once, configuration errors as one line."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from workerpool.errors import ConfigError
from workerpool.telemetry.logs import setup_logging
from workerpool.worker.signals import release


class _Group(click.Group):
    """Turns configuration errors into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            click.echo(f"workerpool: error: {exc}", err=True)
            sys.exit(2)


# The commands that take the signals held since start over: they stop as soon as they can.
_DRAINING = frozenset({"run", "autoscale"})


@click.group(cls=_Group)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging (--log-level debug).")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    envvar="WORKERPOOL_LOG_LEVEL",
    help="Lowest level logged; warning drops the per-job start and end lines.",
)
@click.pass_context
def main(ctx: click.Context, verbose: bool, log_level: str) -> None:
    """Run jobs from a Pub/Sub subscription as a bounded worker pool."""
    if ctx.invoked_subcommand not in _DRAINING:
        release()  # held since the process started (workerpool/worker/signals.py)
    level = logging.DEBUG if verbose else logging.getLevelNamesMapping()[log_level.upper()]
    setup_logging(level=level)
