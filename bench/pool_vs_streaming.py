"""google-cloud-pubsub StreamingPull ``subscribe()`` vs workerpool's pull loop, side by side.

One local Pub/Sub emulator, a fresh topic + subscription (ack deadline 60 s, no retry policy,
a dead-letter policy) for every measurement, and the same jobs run by both implementations:

* streaming:  ``SubscriberClient().subscribe(sub, callback, FlowControl(max_messages=N),
  ThreadScheduler(ThreadPoolExecutor(N)), await_callbacks_on_shutdown=True)``; the callback runs
  the job, then ``message.ack()``.
* workerpool: ``Launcher(Settings(max_outstanding=N, prefetch=2), jobs=Registry()).start()``.

Scenarios (sizes are flags; the defaults take about 2 minutes on 2 cores):

1. held: how many messages the worker leases after ~3 s on a backlog of 2 s jobs, measured
   from outside by a second client's unary pull loop that gives back at once all it gets.
2. utilisation: busy slot-seconds / (N x makespan) on a backlog of 40 x N jobs of 50 ms.
3. throughput: no-op jobs per second, first start to last completion.
4. release on shutdown: stop the worker after 2 s and time how long the messages it held but
   had not started take to become pullable again by a fresh client.

Run: ``python -m bench.pool_vs_streaming`` (prints the table, writes bench/results.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import logging
import math
import os
import platform
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.api_core import exceptions as gexc
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber.scheduler import ThreadScheduler
from google.cloud.pubsub_v1.types import FlowControl
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from workerpool.admin import ProvisionRequest, provision, subscription_path, topic_path
from workerpool.config import Settings
from workerpool.context import JobContext
from workerpool.emulator import LocalEmulator
from workerpool.launcher import Clients, Launcher
from workerpool.registry import Registry

log = logging.getLogger("bench")

JOB = "bench.job"
IMPLS = ("streaming", "workerpool")
RESULTS = Path(__file__).with_name("results.md")


# --------------------------------------------------------------------------------------------
# What the jobs record
# --------------------------------------------------------------------------------------------


class Recorder:
    """Per-run start/end timestamps, the number running now and at most, per job id."""

    def __init__(self, expected: int) -> None:
        self._lock = threading.Lock()
        self.expected = expected
        self.running = 0
        self.peak = 0
        self.runs = 0
        self.started: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.intervals: list[tuple[float, float]] = []
        self.all_done = threading.Event()

    def run(self, job_id: str, seconds: float) -> None:
        start = time.monotonic()
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.runs += 1
            self.started.setdefault(job_id, start)
        if seconds > 0:
            time.sleep(seconds)
        end = time.monotonic()
        with self._lock:
            self.running -= 1
            self.intervals.append((start, end))
            self.finished.setdefault(job_id, end)
            if len(self.finished) >= self.expected:
                self.all_done.set()

    def snapshot(self) -> tuple[set[str], set[str], int]:
        """(started ids, finished ids, running now)."""
        with self._lock:
            return set(self.started), set(self.finished), self.running

    @property
    def duplicates(self) -> int:
        with self._lock:
            return self.runs - len(self.started)


# --------------------------------------------------------------------------------------------
# The two workers
# --------------------------------------------------------------------------------------------


class Worker(Protocol):
    def stop(self) -> None: ...


def subscriber_client(own_connection: bool) -> Any:
    """A SubscriberClient; with ``own_connection``, on a TCP connection no other client shares.

    With the emulator every ``SubscriberClient()`` in a process gets a plain insecure channel,
    and gRPC shares one connection between them, so a worker's connection would outlive its
    stop while the bench's observer clients use it. A real worker is a process of its own.
    """
    if not own_connection:
        return pubsub_v1.SubscriberClient()
    channel = grpc.insecure_channel(
        os.environ["PUBSUB_EMULATOR_HOST"], options=[("grpc.use_local_subchannel_pool", 1)]
    )
    return pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel))


class StreamingWorker:
    def __init__(
        self, subscription: str, n: int, recorder: Recorder, seconds: float, own_connection: bool
    ) -> None:
        self._client = subscriber_client(own_connection)

        def callback(message: Any) -> None:
            recorder.run(message.attributes.get("job_id") or message.message_id, seconds)
            message.ack()

        self._future = self._client.subscribe(
            subscription,
            callback,
            flow_control=FlowControl(max_messages=n),
            scheduler=ThreadScheduler(ThreadPoolExecutor(max_workers=n)),
            await_callbacks_on_shutdown=True,
        )

    def stop(self) -> None:
        self._future.cancel()
        try:
            self._future.result(timeout=60)
        except Exception as exc:
            log.warning("streaming future ended with %s: %s", type(exc).__name__, exc)
        self._client.close()


class PoolWorker:
    def __init__(
        self,
        project: str,
        subscription: str,
        n: int,
        recorder: Recorder,
        seconds: float,
        idempotency_store: str,
        own_connection: bool,
    ) -> None:
        jobs = Registry()

        @jobs.job(JOB)
        def handler(ctx: JobContext, payload: dict[str, Any]) -> None:
            recorder.run(ctx.job_id, seconds)

        values: dict[str, Any] = {
            "project": project,
            "subscription": subscription,
            "max_outstanding": n,
            "prefetch": 2,
            "drain_timeout": 10.0,
            "min_backoff": 1.0,
            "max_backoff": 10.0,
        }
        if "idempotency_store" in {f.name for f in dataclasses.fields(Settings)}:
            # The streaming baseline has no such step; "none" also keeps the default sqlite
            # file out of the working directory.
            values["idempotency_store"] = idempotency_store
        settings = Settings(**values).validate()
        clients = Clients(subscriber=subscriber_client(own_connection))
        self._launcher = Launcher(settings, jobs=jobs, clients=clients).start()

    def stop(self) -> None:
        self._launcher.stop(time.monotonic() + 10)


# --------------------------------------------------------------------------------------------
# Emulator resources, publishing, probing from outside
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    project: str
    topic: str
    subscription: str
    dead_letter_topic: str
    run: str  # unique per run: job ids start with it, so no two runs share one

    @property
    def topic_path(self) -> str:
        return topic_path(self.project, self.topic)

    @property
    def subscription_path(self) -> str:
        return subscription_path(self.project, self.subscription)


class Bench:
    def __init__(self, project: str) -> None:
        self.project = project
        self.publisher = pubsub_v1.PublisherClient(
            batch_settings=pubsub_v1.types.BatchSettings(max_messages=1000, max_latency=0.01)
        )
        self.admin = pubsub_v1.SubscriberClient()
        # The observer: a plain unary-pull client of its own, never the worker's.
        self.observer = pubsub_v1.SubscriberClient()

    def close(self) -> None:
        self.observer.close()
        self.admin.close()
        self.publisher.stop()

    @contextlib.contextmanager
    def resources(self, label: str) -> Iterator[Resources]:
        suffix = uuid.uuid4().hex[:6]
        res = Resources(
            self.project, f"t-{label}-{suffix}", f"s-{label}-{suffix}", f"d-{suffix}", suffix
        )
        provision(
            self.publisher,
            self.admin,
            ProvisionRequest(
                project=self.project,
                topic=res.topic,
                subscription=res.subscription,
                dead_letter_topic=res.dead_letter_topic,
                ack_deadline=60,
                # The probes re-pull available messages several times; stay far from the limit.
                max_delivery_attempts=100,
                retry_policy=False,
            ),
        )
        try:
            yield res
        finally:
            self._delete(res)

    def _delete(self, res: Resources) -> None:
        subs = [
            res.subscription_path,
            subscription_path(self.project, f"{res.dead_letter_topic}-sub"),
        ]
        for sub in subs:
            with contextlib.suppress(gexc.GoogleAPICallError):
                self.admin.delete_subscription(request={"subscription": sub}, timeout=30)
        for topic in (res.topic_path, topic_path(self.project, res.dead_letter_topic)):
            with contextlib.suppress(gexc.GoogleAPICallError):
                self.publisher.delete_topic(request={"topic": topic}, timeout=30)

    def publish(self, res: Resources, count: int) -> list[str]:
        ids = [f"{res.run}-{i:06d}" for i in range(count)]
        futures = [self.publisher.publish(res.topic_path, b"{}", job=JOB, job_id=i) for i in ids]
        for future in futures:
            future.result(timeout=60)
        return ids

    def probe_available(self, res: Resources, seconds: float) -> set[str]:
        """Job ids a plain pull can get within ``seconds``; each is given back at once."""
        seen: set[str] = set()
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            received = self._pull(res, timeout=max(0.2, min(1.0, remaining)))
            if received:
                self.observer.modify_ack_deadline(
                    request={
                        "subscription": res.subscription_path,
                        "ack_ids": [r.ack_id for r in received],
                        "ack_deadline_seconds": 0,
                    }
                )
            ids = {_job_id(r) for r in received}
            fresh = ids - seen
            seen |= ids
            if not fresh:
                # Given-back messages come round again: the backlog has been walked once.
                time.sleep(0.1)
        return seen

    def _pull(self, res: Resources, timeout: float, client: Any = None) -> list[Any]:
        client = client or self.observer
        try:
            response = client.pull(
                request={"subscription": res.subscription_path, "max_messages": 1000},
                timeout=timeout,
            )
        except gexc.DeadlineExceeded:
            return []
        return list(response.received_messages)

    def drain(self, res: Resources, expected: int, timeout: float = 30.0) -> int:
        """Pull and ack until ``expected`` messages came or ``timeout`` passed (warm-up)."""
        got = 0
        deadline = time.monotonic() + timeout
        while got < expected and time.monotonic() < deadline:
            received = self._pull(res, timeout=1.0)
            if received:
                self.observer.acknowledge(
                    request={
                        "subscription": res.subscription_path,
                        "ack_ids": [r.ack_id for r in received],
                    }
                )
            got += len(received)
        return got


def _job_id(received: Any) -> str:
    message = received.message
    return str(message.attributes.get("job_id") or message.message_id)


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


# --------------------------------------------------------------------------------------------
# Figures and the table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A measured value; ``bound`` '>' means the true value is at least ``value`` (capped)."""

    value: float | None
    text: str
    bound: str = ""


@dataclass
class Row:
    scenario: str
    better: str  # "lower" or "higher"
    figures: dict[str, Figure] = field(default_factory=dict)

    def ratio(self) -> str:
        st, wp = self.figures.get("streaming"), self.figures.get("workerpool")
        if st is None or wp is None or st.value is None or wp.value is None:
            return "n/a"
        if st.bound and wp.bound:
            return "n/a (both capped)"
        if st.value == 0:
            return "n/a (streaming is 0)"
        r = wp.value / st.value
        prefix = "< " if st.bound else "> " if wp.bound else ""
        return f"{prefix}{_fmt_ratio(r)}"


def _fmt_ratio(r: float) -> str:
    if r == 0:
        return "0"
    if r < 0.01:
        return f"{r:.4f}"
    return f"{r:.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| scenario | streaming | workerpool | ratio (workerpool/streaming) |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        cells = [row.figures[i].text if i in row.figures else "-" for i in IMPLS]
        name = f"{row.scenario} ({row.better} is better)"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {row.ratio()} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


@dataclass
class Context:
    bench: Bench
    args: argparse.Namespace
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def note(self, text: str) -> None:
        print(f"  - {text}", flush=True)
        self.notes.append(text)

    def start(
        self, impl: str, res: Resources, n: int, recorder: Recorder, seconds: float
    ) -> Worker:
        own = not self.args.shared_connection
        if impl == "streaming":
            return StreamingWorker(res.subscription_path, n, recorder, seconds, own)
        store = self.args.idempotency_store
        return PoolWorker(res.project, res.subscription, n, recorder, seconds, store, own)

    def row(self, scenario: str, better: str) -> Row:
        row = Row(scenario, better)
        self.rows.append(row)
        return row


def held(ctx: Context) -> None:
    a = ctx.args
    for n in a.held_n:
        held_row = ctx.row(
            f"1. messages held after ~{a.held_after:g} s, N={n} "
            f"(backlog {a.held_backlog} x {a.held_seconds:g} s jobs)",
            "lower",
        )
        waiting_row = ctx.row(f"1. of those, waiting for a slot (held - running), N={n}", "lower")
        for impl in IMPLS:
            with ctx.bench.resources(f"held{n}{impl[0]}") as res:
                backlog = len(ctx.bench.publish(res, a.held_backlog))
                recorder = Recorder(backlog)
                t0 = time.monotonic()
                worker = ctx.start(impl, res, n, recorder, a.held_seconds)
                sleep_until(t0 + a.held_after)
                # Done and running are read as the probe starts; what the probe gets within its
                # window was available then (a job cannot finish what the probe is holding).
                _, finished, running = recorder.snapshot()
                available = ctx.bench.probe_available(res, a.probe_seconds) - finished
                worker.stop()
            count = backlog - len(finished) - len(available)
            held_row.figures[impl] = Figure(count, str(count))
            waiting = count - running
            waiting_row.figures[impl] = Figure(waiting, f"{waiting} ({running} running)")
            ctx.note(
                f"held N={n} {impl}: {count} held = {backlog} backlog - {len(finished)} done "
                f"- {len(available)} pullable by the probe; {running} running; "
                f"peak running {recorder.peak}; duplicate runs {recorder.duplicates}"
            )


def utilisation(ctx: Context) -> None:
    a = ctx.args
    for n in a.util_n:
        total = a.util_factor * n
        row = ctx.row(
            f"2. slot utilisation, N={n} ({total} x {a.util_seconds * 1000:g} ms jobs)", "higher"
        )
        for impl in IMPLS:
            with ctx.bench.resources(f"util{n}{impl[0]}") as res:
                ctx.bench.publish(res, total)
                recorder = Recorder(total)
                worker = ctx.start(impl, res, n, recorder, a.util_seconds)
                done = recorder.all_done.wait(a.run_timeout)
                worker.stop()
            intervals = list(recorder.intervals)
            makespan = max(e for _, e in intervals) - min(s for s, _ in intervals)
            busy = sum(e - s for s, e in intervals)
            value = busy / (n * makespan)
            ideal = total * a.util_seconds / n
            text = f"{value:.2f} (makespan {makespan:.2f} s, ideal {ideal:.2f} s)"
            if not done:
                text += f" INCOMPLETE {len(recorder.finished)}/{total}"
            row.figures[impl] = Figure(value, text)
            ctx.note(
                f"utilisation N={n} {impl}: {value:.3f}; makespan {makespan:.2f} s; "
                f"peak running {recorder.peak}; duplicate runs {recorder.duplicates}"
            )


def throughput(ctx: Context) -> None:
    a = ctx.args
    n, total = a.noop_n, a.noop_count
    row = ctx.row(f"3. no-op throughput, N={n} ({total} jobs), msg/s", "higher")
    for impl in IMPLS:
        with ctx.bench.resources(f"noop{impl[0]}") as res:
            ctx.bench.publish(res, total)
            recorder = Recorder(total)
            worker = ctx.start(impl, res, n, recorder, 0.0)
            done = recorder.all_done.wait(a.run_timeout)
            worker.stop()  # returns once every ack has been sent
            stopped = time.monotonic()
        first = min(recorder.started.values())
        last = max(recorder.finished.values())
        rate = len(recorder.finished) / (last - first)
        text = f"{rate:,.0f} ({last - first:.2f} s)"
        if not done:
            text += f" INCOMPLETE {len(recorder.finished)}/{total}"
        row.figures[impl] = Figure(rate, text)
        ctx.note(
            f"throughput {impl}: {rate:.0f} msg/s over {last - first:.2f} s; stop() (acks "
            f"flushed) returned {stopped - last:.2f} s after the last job; "
            f"peak running {recorder.peak}; duplicate runs {recorder.duplicates}"
        )


@dataclass
class Release:
    held_unstarted: int
    first: Figure
    held_p90: Figure
    all_p90: Figure
    stop_seconds: float


def _quantile_time(ids: set[str], seen: dict[str, float], cap: float, q: float) -> Figure:
    """Seconds until a fraction ``q`` of ``ids`` had been pulled (``>cap`` if never)."""
    if not ids:
        return Figure(None, "n/a (none)")
    need = max(1, math.ceil(q * len(ids)))
    times = sorted(seen[i] for i in ids if i in seen)
    if len(times) < need:
        return Figure(cap, f">{cap:g} s ({len(times)}/{len(ids)} by then)", ">")
    return Figure(times[need - 1], f"{times[need - 1]:.2f} s")


def _watch_release(
    ctx: Context,
    res: Resources,
    all_ids: set[str],
    recorder: Recorder,
    stopped: threading.Event,
) -> dict[str, float]:
    """From the stop on: a fresh client pulls (and acks) until every unstarted message came."""
    cap = ctx.args.release_cap
    client = pubsub_v1.SubscriberClient()
    seen: dict[str, float] = {}
    origin = time.monotonic()
    try:
        while (elapsed := time.monotonic() - origin) < cap:
            started, _, _ = recorder.snapshot()
            if stopped.is_set() and not (all_ids - started - set(seen)):
                break
            received = ctx.bench._pull(res, timeout=min(1.0, cap - elapsed), client=client)
            now = time.monotonic() - origin
            for r in received:
                seen.setdefault(_job_id(r), now)
            if received:
                client.acknowledge(
                    request={
                        "subscription": res.subscription_path,
                        "ack_ids": [r.ack_id for r in received],
                    }
                )
            else:
                time.sleep(0.05)
    finally:
        client.close()
    return seen


def _release_one(ctx: Context, impl: str) -> Release:
    a = ctx.args
    with ctx.bench.resources(f"rel{impl[0]}") as res:
        all_ids = set(ctx.bench.publish(res, a.release_backlog))
        recorder = Recorder(len(all_ids))
        t0 = time.monotonic()
        worker = ctx.start(impl, res, a.release_n, recorder, a.release_seconds)
        # Who holds what just before the stop: whatever a plain pull cannot get is held.
        sleep_until(t0 + max(0.0, a.release_after - a.probe_seconds))
        available = ctx.bench.probe_available(res, a.probe_seconds)
        sleep_until(t0 + a.release_after)
        stopped = threading.Event()
        stop_started = time.monotonic()
        stop_took: list[float] = []

        def stop() -> None:
            worker.stop()
            stop_took.append(time.monotonic() - stop_started)
            stopped.set()

        stopper = threading.Thread(target=stop, name="bench-stop", daemon=True)
        stopper.start()
        seen = _watch_release(ctx, res, all_ids, recorder, stopped)
        stopper.join(60)
    started, _, _ = recorder.snapshot()
    unstarted = all_ids - started
    held_unstarted = unstarted - available
    cap = a.release_cap
    first = _quantile_time(held_unstarted, seen, cap, 0.0)
    result = Release(
        held_unstarted=len(held_unstarted),
        first=first,
        held_p90=_quantile_time(held_unstarted, seen, cap, 0.9),
        all_p90=_quantile_time(unstarted, seen, cap, 0.9),
        stop_seconds=stop_took[0] if stop_took else float("nan"),
    )
    ctx.note(
        f"release {impl}: {len(started)} started, {len(available)} pullable just before the "
        f"stop, {len(held_unstarted)} held but not started; stop() took "
        f"{result.stop_seconds:.2f} s; {len(seen)} pulled afterwards; "
        f"duplicate runs {recorder.duplicates}"
    )
    return result


def release(ctx: Context) -> None:
    a = ctx.args
    label = f"N={a.release_n}, {a.release_backlog} x {a.release_seconds:g} s jobs"
    rows = {
        "count": ctx.row(f"4. held but not started at the stop ({label})", "lower"),
        "first": ctx.row("4. first of those pullable again, s after the stop", "lower"),
        "p90": ctx.row("4. 90% of those pullable again, s after the stop", "lower"),
        "all": ctx.row("4. 90% of all unstarted messages pullable, s after the stop", "lower"),
        "stop": ctx.row("4. stop call returned, s (both wait for running jobs)", "lower"),
    }
    for impl in IMPLS:
        r = _release_one(ctx, impl)
        rows["count"].figures[impl] = Figure(r.held_unstarted, str(r.held_unstarted))
        rows["first"].figures[impl] = r.first
        rows["p90"].figures[impl] = r.held_p90
        rows["all"].figures[impl] = r.all_p90
        rows["stop"].figures[impl] = Figure(r.stop_seconds, f"{r.stop_seconds:.2f} s")


SCENARIOS: dict[str, Callable[[Context], None]] = {
    "held": held,
    "utilisation": utilisation,
    "throughput": throughput,
    "release": release,
}


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    add("--project", default="workerpool-bench")
    add("--held-backlog", type=int, default=500)
    add("--held-seconds", type=float, default=2.0)
    add("--held-n", type=int, nargs="+", default=[1, 50])
    add("--held-after", type=float, default=3.0, help="probe after the worker ran this long")
    add("--probe-seconds", type=float, default=1.0, help="length of the outside pull probe")
    add("--util-n", type=int, nargs="+", default=[10, 50])
    add("--util-factor", type=int, default=40, help="backlog = factor x N")
    add("--util-seconds", type=float, default=0.05)
    add("--noop-count", type=int, default=5000)
    add("--noop-n", type=int, default=100)
    add("--release-backlog", type=int, default=200)
    add("--release-seconds", type=float, default=5.0)
    add("--release-n", type=int, default=4)
    add("--release-after", type=float, default=2.0)
    add("--release-cap", type=float, default=70.0)
    add("--run-timeout", type=float, default=60.0, help="give up on a backlog after this")
    add("--warmup", type=int, default=1000, help="messages through the emulator first (JIT)")
    add(
        "--idempotency-store",
        default="none",
        help="workerpool's idempotency_store (the streaming baseline has none)",
    )
    add(
        "--shared-connection",
        action="store_true",
        help="workers use plain SubscriberClient() (one gRPC connection with the observers)",
    )
    add("--results", type=Path, default=RESULTS)
    return p.parse_args(argv)


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"nproc {cpus}, {platform.machine()}, {platform.system()} {platform.release()}"


def versions() -> str:
    names = ("google-cloud-pubsub", "grpcio", "google-api-core")
    found = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)
    return f"{found}, Python {platform.python_version()}"


def report(ctx: Context, started: dt.datetime, seconds: float) -> str:
    argv = " ".join(sys.argv[1:])
    header = [
        "# workerpool vs google-cloud-pubsub StreamingPull (local Pub/Sub emulator)",
        "",
        f"- date: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- libraries: {versions()}",
        f"- machine: {machine()}",
        f"- command: `python -m bench.pool_vs_streaming{' ' + argv if argv else ''}` "
        f"({seconds:.0f} s in all)",
        "- streaming: `subscribe(FlowControl(max_messages=N), ThreadScheduler(N threads), "
        "await_callbacks_on_shutdown=True)`; workerpool: `Launcher(max_outstanding=N, prefetch=2, "
        f"idempotency_store={ctx.args.idempotency_store!r})`",
        f"- load average (1 min) at the start / end: {ctx.load[0]:.2f} / {os.getloadavg()[0]:.2f} "
        "(the machine may be shared)",
        "- ratio is always workerpool / streaming; the scenario says whether lower or higher is "
        "better",
        "",
    ]
    notes = ["", "## Notes (raw figures behind each cell)", "", *(f"- {n}" for n in ctx.notes)]
    return "\n".join([*header, table(ctx.rows), *notes, "", CAVEATS])


CAVEATS = """## Read with care

- The emulator ignores StreamingPull's server-side flow control (`max_outstanding_messages`,
  which the client sends from `FlowControl.max_messages`) and pushes the whole backlog onto the
  stream. Production Pub/Sub stops sending once that many messages are outstanding, so the
  streaming "held" figures (scenarios 1 and 4) are what the emulator does, not what production
  would do.
- The emulator throws while handling each cancelled StreamingPull (see the onRstStreamRead
  note), and what follows varies: the messages the streaming client nacked at its stop were
  pullable about 3 s after it in some runs, only after about 60 s or not within the cap in
  others. The streaming rows of scenario 4 vary from run to run; see bench/README.md.
- Independent of the emulator (google-cloud-pubsub's shutdown code): the streaming client nacks
  the messages it holds only after the running callbacks finish (`await_callbacks_on_shutdown`),
  and never nacks those still in flight on the stream; workerpool gives back its waiting
  messages first, then waits for the running jobs.
- Scenarios 2 and 3 time job starts and ends; both implementations send the ack afterwards.
- workerpool runs with the idempotency store given by `--idempotency-store` (default `none`:
  the streaming baseline has no such step). Each worker has a gRPC connection of its own
  (`--shared-connection` gives both plain `SubscriberClient()`s instead).
"""


def emulator_errors(ctx: Context, log_path: Path | None) -> None:
    """Note the emulator's failures to handle a cancelled call (it then keeps the call alive)."""
    if log_path is None or not log_path.exists():
        return
    text = log_path.read_text(errors="replace")
    rst = text.count("Exception in onRstStreamRead()")
    if rst:
        ctx.note(
            f"emulator log {log_path}: {rst} x 'Exception in onRstStreamRead()' "
            "(java.lang.NoSuchMethodError): the emulator failed to process that many cancelled "
            "calls, such as a StreamingPull stream cancelled at a streaming worker's stop"
        )


def warm_up(bench: Bench, count: int) -> None:
    if count <= 0:
        return
    with bench.resources("warm") as res:
        bench.publish(res, count)
        bench.drain(res, count)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    with LocalEmulator("pubsub", project=args.project) as emulator:
        os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
        print(f"Pub/Sub emulator at {emulator.host}", flush=True)
        bench = Bench(args.project)
        try:
            warm_up(bench, args.warmup)
            ctx = Context(bench, args)
            for name in args.scenarios:
                print(f"{name} ... ({time.monotonic() - t0:.0f} s)", flush=True)
                SCENARIOS[name](ctx)
        finally:
            bench.close()
        emulator_errors(ctx, emulator.log_path)
    text = report(ctx, started, time.monotonic() - t0)
    print()
    print(table(ctx.rows))
    args.results.write_text(text)
    print(f"\nwritten to {args.results} ({time.monotonic() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
