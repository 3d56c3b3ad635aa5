"""``workerpool demo``: the whole path on a local emulator, end to end, in one command."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from workerpool.assembly.launcher import Launcher
from workerpool.config import Settings
from workerpool.constants import Label
from workerpool.ops.admin import ProvisionRequest, provision
from workerpool.publishing import JobMessage, publish_many
from workerpool.pubsub import Clients, topic_path
from workerpool.registry import load_entry_points
from workerpool.telemetry.textlog import live_console
from workerpool.testing.emulator import LocalEmulator

PROJECT = "workerpool-demo"
TOPIC, SUBSCRIPTION, DEAD_LETTER_TOPIC = "demo-jobs", "demo-jobs-sub", "demo-dead-letter"
_TERMINAL = ("done", "dead_lettered", "duplicate")


@contextlib.contextmanager
def _emulator(echo: Callable[[str], None]) -> Iterator[None]:
    if os.environ.get("PUBSUB_EMULATOR_HOST"):
        echo(f"using the emulator at {os.environ['PUBSUB_EMULATOR_HOST']}")
        yield
        return
    echo("starting a local Pub/Sub emulator ...")
    with LocalEmulator("pubsub", project=PROJECT) as emulator:
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
        try:
            yield
        finally:
            del os.environ["PUBSUB_EMULATOR_HOST"]


_Show = Callable[[int, int, int, Mapping[str, int]], None]  # settled, running, held, stats


@contextlib.contextmanager
def _progress(published: int, slots: int, echo: Callable[[str], None]) -> Iterator[_Show]:
    """How the demo shows its progress: a live display where the log lines go to a terminal,
    else a line each time."""
    console = live_console()
    if console is None:

        def line(settled: int, running: int, held: int, stats: Mapping[str, int]) -> None:
            counts = " ".join(f"{k}={v}" for k, v in sorted(stats.items()))
            echo(f"running={running}/{slots} held={held} {counts}")

        yield line
        return
    columns = (
        TextColumn("settled"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
    )
    # Lines printed to stdout while the display is drawn go above it, unless stdout is not
    # the terminal: then they go where stdout goes.
    with Progress(*columns, console=console, redirect_stdout=sys.stdout.isatty()) as progress:
        task = progress.add_task("settled", total=published, counts="")

        def live(settled: int, running: int, held: int, stats: Mapping[str, int]) -> None:
            counts = (
                f"running {running}/{slots}  held {held}  [green]done {stats[Label.DONE]}[/]  "
                f"[yellow]retried {stats[Label.RETRIED]}[/]  "
                f"[red]dead-lettered {stats[Label.DEAD_LETTERED]}[/]"
            )
            progress.update(task, completed=settled, counts=counts)

        yield live


def _sample_jobs(count: int) -> list[JobMessage]:
    rng = random.Random(7)
    messages = [
        JobMessage("demo.sleep", {"seconds": round(rng.uniform(0.2, 1.0), 2)}, f"sleep-{i}")
        for i in range(count)
    ]
    messages += [
        JobMessage("demo.sleep", {"fail": "retryable", "fail_until": 3}, "flaky-1"),
        JobMessage("demo.sleep", {"fail": "retryable", "fail_until": 2}, "flaky-2"),
        JobMessage("demo.sleep", {"fail": "permanent"}, "broken-1"),
        JobMessage("demo.sleep", {"seconds": "soon"}, "bad-payload-1"),
        JobMessage("no.such.job", {}, "unknown-1"),
    ]
    return messages


def run_demo(*, count: int, max_outstanding: int, echo: Callable[[str], None]) -> None:
    load_entry_points()
    with _emulator(echo):
        clients = Clients()
        request = ProvisionRequest(
            PROJECT,
            TOPIC,
            SUBSCRIPTION,
            DEAD_LETTER_TOPIC,
            ack_deadline=10,
            min_backoff=1,
            max_backoff=10,
        )
        for resource, created in provision(clients.publisher, clients.subscriber, request):
            echo(f"{'created' if created else 'exists '}  {resource}")
        messages = _sample_jobs(count)
        list(publish_many(clients.publisher, topic_path(PROJECT, TOPIC), messages))
        clients.close()
        echo(f"published {len(messages)} jobs (2 flaky, 3 that can never succeed)")
        settings = Settings(
            project=PROJECT,
            subscription=SUBSCRIPTION,
            max_outstanding=max_outstanding,
            min_backoff=1.0,
            max_backoff=4.0,
            drain_timeout=10.0,
            idempotency_store="memory://",  # a fresh emulator each run: start from nothing
        )
        launcher = Launcher(settings).start()
        stats = launcher.processor.stats
        deadline = time.monotonic() + 120
        with _progress(len(messages), max_outstanding, echo) as show:
            settled = 0
            while settled < len(messages) and time.monotonic() < deadline:
                time.sleep(0.5)
                settled = sum(stats[k] for k in _TERMINAL)
                show(settled, launcher.pool.running, launcher.pool.held, stats)
        report = launcher.stop(time.monotonic() + settings.drain_timeout)
        echo(f"drained in {report.seconds:.1f}s")
        echo("summary: " + json.dumps(dict(sorted(stats.items()))))
