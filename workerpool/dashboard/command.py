"""``workerpool dashboard``: serve the dashboard (``create_app``) with uvicorn."""

from __future__ import annotations

import click

from workerpool.config import load_settings
from workerpool.dashboard.schedules import load_job_modules
from workerpool.errors import ConfigError


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ConfigError for anything else."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--bind {bind!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--idempotency-store", help="The store the workers share.")
@click.option(
    "--jobs",
    multiple=True,
    help="Module that registers jobs (repeatable), as for run: their @job schedules show.",
)
@click.option(
    "--bind",
    default="127.0.0.1:8080",
    show_default=True,
    help="HOST:PORT to listen on (only this machine unless told otherwise).",
)
@click.option(
    "--dead-letter-subscription",
    default="",
    help="Where the failure records are read [default: DEAD_LETTER_TOPIC-sub].",
)
@click.option(
    "--token",
    envvar="WORKERPOOL_DASHBOARD_TOKEN",
    default="",
    help="Allow actions (replay, delete), each confirmed with this token [default: read-only; "
    "WORKERPOOL_DASHBOARD_TOKEN].",
)
def dashboard(
    config_file: str | None,
    idempotency_store: str | None,
    jobs: tuple[str, ...],
    bind: str,
    dead_letter_subscription: str,
    token: str,
) -> None:
    """Serve the web dashboard: replicas, keys, batches, schedules and dead letters."""
    host, port = parse_bind(bind)
    settings = load_settings(config_file, {"idempotency_store": idempotency_store, "jobs": jobs})
    load_job_modules(settings)
    try:
        import uvicorn

        from workerpool.dashboard.app import create_app
    except ImportError as exc:
        raise ConfigError(
            f"the dashboard needs its extra: pip install 'workerpool[dashboard]' ({exc})"
        ) from None
    try:
        app = create_app(settings, dead_letter_subscription=dead_letter_subscription, token=token)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"idempotency_store {settings.idempotency_store}: {exc}") from None
    click.echo(f"workerpool dashboard on http://{host}:{port}/")
    uvicorn.run(app, host=host, port=port, log_level="warning")
