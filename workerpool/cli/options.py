"""Options and steps several commands share."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import click

from workerpool.registry import import_job_modules, load_entry_points
from workerpool.telemetry.logs import LOG_FORMATS, setup_logging


def _set_log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # The group has set logging up from WORKERPOOL_LOG_FORMAT or the terminal; a choice here
    # replaces its handler, at the level it set.
    if value is not None:
        setup_logging(level=logging.getLogger().level, json_lines=value == "json")


log_format = click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    callback=_set_log_format,
    expose_value=False,
    is_eager=True,
    help="json (Cloud Logging) or text [default: text on a terminal, else json; "
    "WORKERPOOL_LOG_FORMAT].",
)


def load_jobs(modules: tuple[str, ...]) -> None:
    load_entry_points()
    import_job_modules(modules)


_STORE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file."),
    click.option("--idempotency-store", help="The store the workers share."),
]


def store_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_STORE_OPTIONS):
        func = option(func)
    return func
