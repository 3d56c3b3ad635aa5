"""``python -m bench.dashboard``: the dashboard at scale, each page's render time over HTTP.

On the Pub/Sub emulator started here: ``--letters`` failure records (10,000) on the dead-letter
topic, as workers write them, and ``--running`` jobs (200) that sleep, run by ``--workers`` real
``workerpool run`` processes (2) sharing an SQLite store. Then ``workerpool dashboard`` in a
process of its own, and each page fetched ``--views`` times over HTTP from this process, one
request at a time: the time from sending the request to the last byte of the answer (median,
max). The Dead letters page is timed at its first page, its last, and filtered; its first view
(which waits a bounded time for the read of the subscription behind the index, else says it is
being read), the time until the page shows the records, and the views while the index is read
again in the background are timed apart. Also timed, in this process, beside the running
fleet: opening and closing each SQLite store the pages open per request (the idempotency store
purges expired rows when it opens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urljoin

from bench.periodic import stop
from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool import constants as c
from workerpool.dashboard.letter_index import FIRST_WAIT, FRESH
from workerpool.dashboard.letters import SCAN
from workerpool.dashboard.stores import Openers
from workerpool.ops.dlq import peek
from workerpool.testing.emulator import LocalEmulator, free_port
from workerpool.testing.pubsub import PubSubResources

ABOUT = [
    "The dashboard (`workerpool dashboard`, a process of its own) over 10,000 dead letters "
    "(failure records as workers write them: 5 jobs, 4 error types, a 300-byte JSON payload) "
    "and 200 running jobs (`demo.sleep` on 2 real `workerpool run` processes sharing an SQLite "
    "store), on the Pub/Sub emulator. Each cell: milliseconds from sending a GET on localhost to "
    "the last byte of the answer, one request at a time, median and max of 10 views or more. "
    "Running shows its first 100 runs; its live table is what the page fetches every 2 s. Dead "
    "letters (100 a page): page 1, the last page (reached through every Next link), a filter by "
    "job and error type; the first view, as soon as the dashboard answers, waits at most "
    f"{FIRST_WAIT} s for the read that builds the page's index (begun as the dashboard started; "
    "index read: that read alone, timed in the bench process), else says the subscription is "
    "being read; records shown after start: from that first view until the page, asked again "
    "every 0.1 s, shows the records; once the index is older than "
    f"{FRESH:.0f} s, views are served from it while it is read again behind them (during a "
    "read: every view until the page shows the newer read). Store open: opening and closing "
    "the SQLite store a page opens per request (50 times, in the bench process, beside the "
    "running fleet); the idempotency store's open also purges its expired rows (a write).",
]
PAGES = {
    "Overview": "/",
    "Running": "/running",
    "Running live table": "/running?fragment=1",
    "Keys": "/keys",
    "Batches": "/batches",
    "Schedules": "/schedules",
    "Autoscaler": "/autoscaler",
    "chart": "/chart/jobs.svg",
}
JOBS = [f"bench.job_{i}" for i in range(5)]
ERRORS = ["permanent_error", "timeout", "invalid_payload", "unknown_job"]
SLEEP = 590.0  # demo.sleep's timeout is 600 s: the jobs outlast the bench


def fail(env: PubSubResources, count: int) -> None:
    """``count`` failure records on the dead-letter topic, with the attributes a worker adds."""
    topic = f"projects/{env.project}/topics/{env.dead_letter_topic}"
    start = datetime.now(UTC) - timedelta(hours=1)
    futures = []
    for i in range(count):
        payload = json.dumps({"order": i, "lines": [{"sku": f"sku-{i % 97}", "qty": 1}] * 6})
        futures.append(env.publisher.publish(topic, payload.encode(), **{
            c.ATTR_JOB: JOBS[i % len(JOBS)], c.ATTR_JOB_ID: f"letter-{i:05d}",
            c.ATTR_ERROR_TYPE: ERRORS[i % len(ERRORS)],
            c.ATTR_ERROR_MESSAGE: f"ValueError: order {i} has no customer",
            c.ATTR_DELIVERY_ATTEMPT: "5", c.ATTR_SOURCE_TOPIC: env.topic_path,
            c.ATTR_SOURCE_SUBSCRIPTION: env.subscription_path, c.ATTR_WORKER: "bench",
            c.ATTR_FAILED_AT: (start + timedelta(milliseconds=100 * i)).isoformat(
                timespec="milliseconds"),
        }))  # fmt: skip
    for future in futures:
        future.result(60)


class Fleet:
    """The worker processes and the dashboard process, their output in ``directory``."""

    def __init__(self, env: PubSubResources, directory: Path) -> None:
        self.env = env
        self.directory = directory
        self.store = f"sqlite:///{directory / 'fleet.db'}"
        self.config = directory / "workerpool.toml"
        self.config.write_text(
            f'[worker]\nproject = "{env.project}"\nsubscription = "{env.subscription}"\n'
            f'dead_letter_topic = "{env.dead_letter_topic}"\nidempotency_store = "{self.store}"\n'
            'jobs = ["workerpool_jobs.demo"]\n\n[concurrency]\n"bench-key" = 10\n'
        )
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, *args: str) -> None:
        environment = {**os.environ, "PUBSUB_EMULATOR_HOST": self.env.host}
        with open(self.directory / f"{name}.log", "wb") as out:
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "workerpool", *args, "--config", str(self.config)],
                env=environment, stdout=out, stderr=subprocess.STDOUT,
            ))  # fmt: skip

    def stop(self) -> None:
        stop(self.processes, 60)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.5)


def running(openers: Openers) -> int:
    assert openers.progress is not None
    store = openers.progress()
    try:
        return len(store.running(time.time()))
    finally:
        store.close()


def get(url: str) -> tuple[float, str]:
    """The seconds a GET took to its last byte, and its body."""
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read().decode()
    return time.perf_counter() - began, body


def views(url: str, count: int) -> list[float]:
    return [get(url)[0] for _ in range(count)]


def letters(base: str, count: int) -> dict[str, list[float]]:
    """The Dead letters page's timings: its first view, page 1, the last page (and how many
    pages there were), a filter, and the views while the index is read again."""
    began = time.perf_counter()
    first, page = get(base + "/dead-letters")
    # Until the first read ends the page says it is being read (and reloads itself each second):
    # asked again here every 0.1 s, the time from the first view to the records shown.
    while "Records 1 to 100 of" not in page:
        assert 'id="reading"' in page, page[:2000]
        time.sleep(0.1)
        page = get(base + "/dead-letters")[1]
    shown = time.perf_counter() - began
    cursors = []
    while found := re.search(r'id="next" href="([^"]+)"', page):
        cursors.append(urljoin(base, found.group(1).replace("&amp;", "&")))
        page = get(cursors[-1])[1]
    timed = {
        "first view after start": [first],
        "records shown after start": [shown],
        "page 1": views(base + "/dead-letters", count),
        f"page {len(cursors) + 1}": views(cursors[-1], count),
        "filtered": views(base + f"/dead-letters?job={JOBS[1]}&error_type={ERRORS[1]}", count),
    }
    # Once the index is stale, views until the page shows a newer read: those during it.
    time.sleep(FRESH + 1)
    during: list[float] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        took, page = get(base + "/dead-letters")
        during.append(took)
        if _read_ago(page) < FRESH:
            break
    timed["during a read"] = during
    return timed


def _read_ago(page: str) -> float:
    found = re.search(r"as read from the subscription (\d+) s ago", page)
    assert found is not None, page[:2000]
    return float(found.group(1))


def index_read(env: PubSubResources, count: int) -> list[float]:
    """Seconds the read behind the index takes (the same call, made here)."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        peek(env.subscriber, env.dead_letter_subscription_path, limit=SCAN)
        times.append(time.perf_counter() - began)
    return times


def store_opens(openers: Openers, count: int) -> dict[str, list[float]]:
    """Seconds to open and close each store the Running page and the chart open."""
    timed: dict[str, list[float]] = {}
    for name, opener in (("progress", openers.progress), ("idempotency", openers.completions)):
        assert opener is not None
        times = []
        for _ in range(count):
            began = time.perf_counter()
            opener().close()
            times.append(time.perf_counter() - began)
        timed[f"store open: {name}"] = times
    return timed


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    with LocalEmulator(kind="pubsub", project="workerpool-bench") as emulator:
        os.environ[emulator.env_var] = emulator.host
        env = PubSubResources(emulator.project, emulator.host)
        env.provision(retry_policy=False, ack_deadline=60)
        fail(env, args.letters)
        with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as name:
            fleet = Fleet(env, Path(name))
            openers = Openers.of(fleet.store)
            try:
                # Each with room for every job: a worker leases more than it runs, and
                # with no slot to spare some jobs would wait on it while the other has room.
                for i in range(args.workers):
                    fleet.spawn(f"worker-{i}", "run", "--max-outstanding", str(args.running))
                env.publish_many("demo.sleep", [
                    (f"run-{i:04d}", {"seconds": SLEEP}) for i in range(args.running)
                ])  # fmt: skip
                wait_until(lambda: running(openers) >= args.running, 180, "the running jobs")
                port = free_port()
                fleet.spawn("dashboard", "dashboard", "--bind", f"127.0.0.1:{port}")
                base = f"http://127.0.0.1:{port}"
                wait_until(lambda: _answers(base), 60, "the dashboard")
                # The Dead letters page first: its first view as soon as the dashboard answers.
                dead = letters(base, args.views)
                timed = {name: views(base + path, args.views) for name, path in PAGES.items()}
                timed.update(dead)
                timed.update(store_opens(openers, 50))
                timed["index read"] = index_read(env, 3)
                timed["running jobs"] = [float(running(openers))]
            finally:
                fleet.stop()
    return timed


def _answers(base: str) -> bool:
    try:
        get(base + "/keys")
    except OSError:
        return False
    return True


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.01 else f"{1000 * seconds:.1f}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--letters", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--views", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    timed = measure(args)
    alive = int(timed.pop("running jobs")[0])
    names = list(timed)
    grid = Grid("", "", [f"ms ({args.letters:,} dead letters, {alive} running)", *names])
    for label, pick in (("median", statistics.median), ("max", max)):
        grid.rows.append([label, *(_ms(pick(timed[n])) for n in names)])
    print(json.dumps({n: [round(1000 * t, 1) for t in timed[n][:20]] for n in names}), flush=True)
    command = command_line("python -m bench.dashboard", argv)
    title = "The dashboard with 10,000 dead letters and 200 running jobs"
    emit(Section("dashboard", title, command, ABOUT, [grid]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
