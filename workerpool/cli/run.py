"""``workerpool run``, ``jobs`` and ``demo``: running jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from workerpool.assembly.named import find_all
from workerpool.cli.options import load_jobs, log_format
from workerpool.config import Settings, load_settings
from workerpool.registry import registry
from workerpool.worker.signals import held

_RUN_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file."),
    click.option("--project", help="Google Cloud project."),
    click.option("--subscription", help="Subscription to pull jobs from."),
    click.option(
        "--dead-letter-topic",
        help="Topic for failure records (default: the subscription's dead-letter topic).",
    ),
    click.option("--max-outstanding", type=int, help="Jobs running at once, at most."),
    click.option(
        "--prefetch",
        type=int,
        help="Messages held beyond max-outstanding [default: a quarter of it, at least 2].",
    ),
    click.option("--max-bytes", type=int, help="Bytes held at most."),
    click.option(
        "--max-payload-bytes", type=int, help="Bigger message data is dead-lettered as oversize."
    ),
    click.option("--drain-timeout", type=float, help="Seconds running jobs get on SIGTERM."),
    click.option("--lease-extension", type=float, help="Seconds each lease extension adds."),
    click.option("--min-backoff", type=float, help="First retry delay, seconds."),
    click.option("--max-backoff", type=float, help="Longest retry delay, seconds."),
    click.option("--jobs", multiple=True, help="Module that registers jobs (repeatable)."),
    click.option(
        "--middleware",
        multiple=True,
        help="Middleware to add, innermost: an entry point of workerpool.middleware or "
        "module:Name (repeatable).",
    ),
    click.option(
        "--idempotency-store",
        help="sqlite:///PATH (default), firestore://PROJECT/COLLECTION, memory:// or none.",
    ),
    click.option("--claim-ttl", type=float, help="Seconds a job claim lives unless renewed."),
    click.option(
        "--metrics-port",
        type=int,
        help="Serve /metrics, /healthz and /readyz on this port (default: nothing listens).",
    ),
    click.option(
        "--heartbeat-interval",
        type=float,
        help="Seconds between this replica's heartbeats, read by the autoscaler (0: none).",
    ),
    click.option(
        "--rate-limit",
        multiple=True,
        help="Declare a rate limit NAME=RATE/s[:BURST] (repeatable), e.g. partner=20/s:5.",
    ),
    click.option(
        "--concurrency",
        multiple=True,
        help="Declare a fleet-wide limit KEY=LIMIT (repeatable), e.g. bigquery-exports=2, "
        "or per key of a prefix: 'partner:*=1'; LIMIT/bulk leases slots to replicas in "
        "shares, LIMIT/bulk/S splits the key's record into S shards.",
    ),
    click.option("--slot-ttl", type=float, help="Seconds a concurrency slot lives unless renewed."),
    click.option(
        "--slot-wait", type=float, help="Seconds a job waits for a free slot before deferring."
    ),
    click.option(
        "--pool-concurrency",
        help="A key every job of this worker holds a slot of: it pulls only while one is free.",
    ),
]


def _run_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_RUN_OPTIONS):
        func = option(func)
    return func


@click.command()
@_run_options
@log_format
def run(config_file: str | None, jobs: tuple[str, ...], **flags: Any) -> None:
    """Pull and run jobs until SIGTERM or SIGINT, then drain."""
    from workerpool.assembly.service import exit_now, serve

    settings = load_settings(config_file, {**flags, "jobs": jobs})
    find_all(settings)  # first: a job may take an option one of them declares
    load_jobs(settings.jobs)
    serve(settings, held())
    exit_now(0)


@click.command("jobs")
@click.option("--jobs", "modules", multiple=True, help="Module that registers jobs.")
@click.option("--middleware", multiple=True, help="Middleware whose job options they take.")
def list_jobs(modules: tuple[str, ...], middleware: tuple[str, ...]) -> None:
    """List the registered jobs."""
    find_all(Settings(middleware=middleware))
    load_jobs(modules)
    for spec in registry.specs():
        payload = spec.payload.__name__ if spec.payload else "dict"
        click.echo(
            f"{spec.name:<28} timeout={spec.timeout:g}s max_attempts={spec.max_attempts} "
            f"payload={payload}  ({spec.handler.__module__}.{spec.handler.__name__})"
        )


@click.command()
@click.option(
    "--jobs",
    "count",
    type=click.IntRange(1, 10_000),
    default=24,
    show_default=True,
    help="How many sleep jobs to publish.",
)
@click.option("--max-outstanding", type=click.IntRange(1, 256), default=4, show_default=True)
@log_format
def demo(count: int, max_outstanding: int) -> None:
    """Run the whole thing on the local emulator: provision, publish, run, drain, summarise."""
    from workerpool.ops.demo import run_demo

    run_demo(count=count, max_outstanding=max_outstanding, echo=click.echo)
