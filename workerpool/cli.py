"""The ``workerpool`` command."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from workerpool import constants as c
from workerpool.assembly.named import find_all
from workerpool.assembly.service import exit_now, serve
from workerpool.config import Settings, load_settings
from workerpool.errors import ConfigError
from workerpool.ops.admin import (
    ProvisionRequest,
    describe_subscription,
    subscription_path,
    topic_path,
)
from workerpool.ops.admin import provision as provision_resources
from workerpool.publishing import JobMessage, publish_batch, publish_many, read_jsonl
from workerpool.registry import import_job_modules, load_entry_points, registry
from workerpool.telemetry.exporters import publish_span
from workerpool.telemetry.logs import LOG_FORMATS, setup_logging
from workerpool.worker.clients import connect
from workerpool.worker.envelope import parse_json
from workerpool.worker.signals import held, release


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


def _set_log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # The group has set logging up from WORKERPOOL_LOG_FORMAT or the terminal; a choice here
    # replaces its handler, at the level it set.
    if value is not None:
        setup_logging(level=logging.getLogger().level, json_lines=value == "json")


_LOG_FORMAT = click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    callback=_set_log_format,
    expose_value=False,
    is_eager=True,
    help="json (Cloud Logging) or text [default: text on a terminal, else json; "
    "WORKERPOOL_LOG_FORMAT].",
)


def _load_jobs(modules: tuple[str, ...]) -> None:
    load_entry_points()
    import_job_modules(modules)


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
        "or per key of a prefix: 'partner:*=1'.",
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


@main.command()
@_run_options
@_LOG_FORMAT
def run(config_file: str | None, jobs: tuple[str, ...], **flags: Any) -> None:
    """Pull and run jobs until SIGTERM or SIGINT, then drain."""
    settings = load_settings(config_file, {**flags, "jobs": jobs})
    find_all(settings)  # first: a job may take an option one of them declares
    _load_jobs(settings.jobs)
    serve(settings, held())
    exit_now(0)


@main.command("jobs")
@click.option("--jobs", "modules", multiple=True, help="Module that registers jobs.")
@click.option("--middleware", multiple=True, help="Middleware whose job options they take.")
def list_jobs(modules: tuple[str, ...], middleware: tuple[str, ...]) -> None:
    """List the registered jobs."""
    find_all(Settings(middleware=middleware))
    _load_jobs(modules)
    for spec in registry.specs():
        payload = spec.payload.__name__ if spec.payload else "dict"
        click.echo(
            f"{spec.name:<28} timeout={spec.timeout:g}s max_attempts={spec.max_attempts} "
            f"payload={payload}  ({spec.handler.__module__}.{spec.handler.__name__})"
        )


@main.command()
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
    options["filter"] = options.pop("filter_")
    clients = connect()
    try:
        for resource, created in provision_resources(
            clients.publisher, clients.subscriber, ProvisionRequest(**options)
        ):
            click.echo(f"{'created' if created else 'exists '}  {resource}")
    finally:
        clients.close()


@main.command()
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


@main.command()
@click.option(
    "--jobs",
    "count",
    type=click.IntRange(1, 10_000),
    default=24,
    show_default=True,
    help="How many sleep jobs to publish.",
)
@click.option("--max-outstanding", type=click.IntRange(1, 256), default=4, show_default=True)
@_LOG_FORMAT
def demo(count: int, max_outstanding: int) -> None:
    """Run the whole thing on the local emulator: provision, publish, run, drain, summarise."""
    from workerpool.ops.demo import run_demo

    run_demo(count=count, max_outstanding=max_outstanding, echo=click.echo)


@main.group()
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


@main.group()
def batch() -> None:
    """Batches and how far each has got."""


_STORE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file."),
    click.option("--idempotency-store", help="The store the workers share."),
]


def _store_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_STORE_OPTIONS):
        func = option(func)
    return func


def _open_batches(config_file: str | None, idempotency_store: str | None) -> Any:
    from workerpool.batches import batch_opener

    settings = load_settings(config_file, {"idempotency_store": idempotency_store})
    opener = batch_opener(settings.idempotency_store)
    if opener is None:
        raise ConfigError(f"idempotency_store {settings.idempotency_store}: keeps no batches")
    return opener()


def _batch_line(b: Any) -> str:
    deadline = datetime.fromtimestamp(b.deadline, UTC).isoformat(timespec="seconds")
    if b.finalized_by:
        state = f"finalized by {b.finalized_by}"
    else:
        state = "open" if b.committed else "publishing (not open yet)"
    return (
        f"{b.batch_id}  total {b.total}  done {b.done}  failed {b.failed}  pending {b.pending}"
        f"  deadline {deadline}  {state}"
    )


@batch.command("status")
@click.argument("batch_id")
@_store_options
def batch_status(batch_id: str, config_file: str | None, idempotency_store: str | None) -> None:
    """Show one batch: totals, done, failed, pending, its deadline and state."""
    store = _open_batches(config_file, idempotency_store)
    try:
        found = store.get(batch_id)
    finally:
        store.close()
    if found is None:
        raise ConfigError(f"no batch {batch_id}")
    click.echo(_batch_line(found))


@batch.command("list")
@_store_options
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
def batch_list(config_file: str | None, idempotency_store: str | None, limit: int) -> None:
    """Show the batches, soonest deadline first."""
    store = _open_batches(config_file, idempotency_store)
    try:
        found = store.batches(limit)
    finally:
        store.close()
    for each in found:
        click.echo(_batch_line(each))
    click.echo(f"{len(found)} batch(es)")


@main.group()
def schedule() -> None:
    """Delayed jobs waiting in the workers' schedule, and the periodic schedules."""


@schedule.command("list")
@_store_options
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
        click.echo(f"{due}  in {_span(entry.due - now):>9}  {job}  {entry.job_id}  {entry.topic}")
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
    _load_jobs(settings.jobs)
    return operating(settings, registry)


def _on_schedule(command: str, help_text: str, act: Callable[[Any, str], str]) -> None:
    """A ``schedule`` command on one periodic schedule NAME: ``act(control, NAME)`` says
    what it did."""

    @schedule.command(command, help=help_text)
    @click.argument("name")
    @_store_options
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
@_store_options
def schedule_backfill(
    name: str, start: str, end: str, config_file: str | None, idempotency_store: str | None
) -> None:
    """Fire each tick of a periodic schedule in a past range once (fired ones: not again)."""
    with _periodic(config_file, idempotency_store) as control:
        fired, before = control.backfill(name, start, end)
    click.echo(f"{name}: {fired} tick(s) to fire, {before} fired already")


def _span(seconds: float) -> str:
    if seconds <= 0:
        return "due"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


@main.command()
@click.option("--project", required=True)
@click.option("--subscription", required=True)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--idempotency-store", help="The store the workers share (for their slots).")
@click.option("--concurrency", multiple=True, help="A limit KEY=LIMIT to show (repeatable).")
def status(
    project: str,
    subscription: str,
    config_file: str | None,
    idempotency_store: str | None,
    concurrency: tuple[str, ...],
) -> None:
    """Show a subscription's settings, its backlog where Cloud Monitoring is reachable, and
    each declared concurrency key's limit, holders and waiters."""
    from workerpool.ops.status import slot_lines, status_lines
    from workerpool.slots import open_slot_store

    flags = {"idempotency_store": idempotency_store, "concurrency": concurrency}
    settings = load_settings(config_file, flags)
    slots: list[tuple[str, str]] = []
    if settings.concurrency:
        store = open_slot_store(settings.idempotency_store)
        try:
            slots = slot_lines(store, settings.concurrency)
        finally:
            store.close()
    clients = connect()
    try:
        lines = status_lines(clients.subscriber, subscription_path(project, subscription), slots)
    finally:
        clients.close()
    for line in lines:
        click.echo(line)


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file.")
@click.option("--project", help="Google Cloud project.")
@click.option("--subscription", help="The subscription the workers pull.")
@click.option(
    "--idempotency-store", help="The store the workers share: their heartbeats are read there."
)
@click.option(
    "--actuator",
    type=click.Choice(["process", "cloud-run", "kubernetes", "keda"]),
    default="process",
    show_default=True,
    help="What changes the fleet's size: process starts `workerpool run` processes here; "
    "cloud-run sets a worker pool's instance count; kubernetes scales a Deployment; keda "
    "serves KEDA's external scaler with the count.",
)
@click.option(
    "--cloud-run-worker-pool", help="projects/P/locations/REGION/workerPools/NAME (cloud-run)."
)
@click.option("--kubernetes-deployment", help="The worker Deployment's name (kubernetes).")
@click.option("--kubernetes-namespace", help="Its namespace (kubernetes; default: the pod's own).")
@click.option(
    "--keda-address", default="[::]:9090", show_default=True,
    help="Where the external scaler listens (keda).",
)  # fmt: skip
@click.option("--min", "min_replicas", type=click.IntRange(0), default=0, show_default=True)
@click.option("--max", "max_replicas", type=click.IntRange(0), default=30, show_default=True)
@click.option(
    "--target-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.8,
    show_default=True, help="Share of the fleet's slots to keep busy.",
)  # fmt: skip
@click.option(
    "--scale-down-delay", type=click.FloatRange(0), default=90.0, show_default=True,
    help="Seconds of lower demand before replicas are removed.",
)  # fmt: skip
@click.option(
    "--interval", type=click.FloatRange(0.1), default=1.0, show_default=True,
    help="Seconds between decisions.",
)  # fmt: skip
@click.option(
    "--slots-per-replica", type=click.IntRange(1),
    help="Each replica's max-outstanding, until its heartbeat says (default: the setting's).",
)  # fmt: skip
@click.option(
    "--lease-ttl", type=click.FloatRange(1), default=15.0, show_default=True,
    help="Seconds a standby autoscaler of the subscription waits for a silent leader.",
)  # fmt: skip
@click.option("--metrics-port", type=int, help="Serve /metrics on this port.")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def autoscale(
    config_file: str | None,
    actuator: str,
    min_replicas: int,
    max_replicas: int,
    target_utilization: float,
    scale_down_delay: float,
    interval: float,
    slots_per_replica: int | None,
    cloud_run_worker_pool: str | None,
    kubernetes_deployment: str | None,
    kubernetes_namespace: str | None,
    keda_address: str,
    lease_ttl: float,
    worker_args: tuple[str, ...],
    **flags: Any,
) -> None:
    """Size the worker fleet from its heartbeats, a probe pull while it is at zero, and Cloud
    Monitoring where it answers. Arguments after -- go to each `workerpool run` the process
    actuator starts (e.g. -- --jobs myjobs --max-outstanding 2)."""
    from workerpool.autoscale.policy import Policy
    from workerpool.autoscale.service import AutoscaleOptions, run_autoscaler

    settings = load_settings(config_file, flags)
    try:
        policy = Policy(target_utilization, scale_down_delay, min_replicas, max_replicas)
    except ValueError as exc:
        raise ConfigError(f"autoscale: {exc}") from None
    options = AutoscaleOptions(
        settings=settings,
        policy=policy,
        actuator=actuator,
        slots_per_replica=slots_per_replica or _max_outstanding(worker_args, settings),
        interval=interval,
        worker_args=worker_args,
        config_file=config_file,
        cloud_run_worker_pool=cloud_run_worker_pool or "",
        kubernetes_deployment=kubernetes_deployment or "",
        kubernetes_namespace=kubernetes_namespace,
        keda_address=keda_address,
        lease_ttl=lease_ttl,
    )
    if worker_args and actuator != "process":
        raise ConfigError(f"--actuator {actuator}: arguments after -- go to the process actuator")
    run_autoscaler(options, held())
    exit_now(0)


def _max_outstanding(worker_args: tuple[str, ...], settings: Any) -> int:
    """The slots each replica will have: the workers' own --max-outstanding when the process
    actuator is given one (the last, as click takes it), else the setting's."""
    found = int(settings.max_outstanding)
    for i, arg in enumerate(worker_args):
        value = arg.partition("=")[2] if arg.startswith("--max-outstanding=") else None
        if arg == "--max-outstanding" and i + 1 < len(worker_args):
            value = worker_args[i + 1]
        if value is not None and value.isdigit() and int(value) > 0:
            found = int(value)
    return found
