"""One benchmark consumer as a process of its own: ``python -m bench.consumer IMPL ...``.

Each implementation runs the same job (record the start, sleep ``--seconds``, record the end)
until ``--expect`` distinct jobs have finished or SIGTERM arrives, then stops the way its
library recommends and writes a JSON report. A worker is a process of its own in production
too, so CPU time and RSS are the process's own.

Implementations:

* ``workerpool``: what ``workerpool run`` runs, with its default middleware (the SQLite
  idempotency store, metrics with a Prometheus reader, job log lines, tracing sampled off).
* ``workerpool-bare``: the same with everything off (no store, OpenTelemetry disabled, log
  level warning); ``workerpool-store``, ``-telemetry`` and ``-logs``: one of those parts on.
* ``workerpool-async`` and ``workerpool-async-bare``: the same two, with the job an
  ``async def`` (``await asyncio.sleep``) on the pool's event loop.
* ``IMPL@REF`` (a workerpool one): the same, run by the workerpool of git revision REF
  (``bench.harness`` puts that tree first on the path): the "before" of a change, measured in
  the same run as its "after".
* ``plain``: google-cloud-pubsub's ``subscribe()`` with ``FlowControl(max_messages=N)`` and a
  ``ThreadScheduler`` of N threads; the callback runs the job, then ``ack()``.
* ``aio``: gcloud-aio-pubsub's ``subscribe()``: one producer pulling up to N messages at a
  time, one consumer with N tasks, acks batched for 50 ms; stopped by cancelling its task.

Times are ``time.monotonic()``, which on Linux is one clock for every process, so the parent
can compare them with its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB = "bench.job"
RATE_LIMIT = "bench"
ACK_DEADLINE = 60  # seconds; bench.harness makes every subscription with it
CHECKPOINTS = (10, 50, 100)  # percent of --expect at which RSS is read


def job_index(job_id: str) -> int:
    """Job ids are ``RUN-INDEX`` (bench.harness publishes them so)."""
    return int(job_id.rsplit("-", 1)[1])


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_times() -> dict[int, tuple[str, float, int]]:
    """Each live thread's name (trailing digits cut: the slots of a pool are one group; a
    thread Python did not start is "native"), CPU seconds and scheduler slices (times it was
    put on a CPU) so far, by thread id, from the kernel's schedstat; empty where there is
    none. A thread that ends before the second look is not counted."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    times = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                on_cpu_ns, _, slices = stat.read().split()[:3]
        except (OSError, ValueError):
            continue  # ended meanwhile, or no schedstat
        name = names.get(tid, "native").rstrip("0123456789").rstrip("-_ ") or "native"
        times[tid] = (name, int(on_cpu_ns) / 1e9, int(slices))
    return times


def rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kib() -> int:
    """VmHWM: getrusage's ru_maxrss survives exec on Linux, so in a child it reported the
    parent's peak (the same 81.6 MiB for two different libraries)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


@dataclass
class Report:
    impl: str
    n: int
    expect: int
    finished: int = 0  # distinct jobs
    duplicates: int = 0  # runs of a job id that had already started
    peak: int = 0
    first_start: float | None = None
    cpu_first: float | None = None  # CPU seconds when the first job started (imports done)
    last_start: float | None = None
    last_end: float | None = None
    cpu_done: float | None = None  # CPU seconds when the last expected job ended
    # Between those two: CPU seconds and scheduler slices by thread name (``thread_times``).
    thread_cpu: dict[str, float] = field(default_factory=dict)
    thread_slices: dict[str, int] = field(default_factory=dict)
    rss_kib_at: dict[int, int] = field(default_factory=dict)  # percent done -> RSS
    max_rss_kib: int = 0
    starts: list[tuple[str, float]] = field(default_factory=list)  # with --intervals
    intervals: list[tuple[str, float, float]] = field(default_factory=list)  # finished runs
    samples: list[tuple[float, int]] = field(default_factory=list)


def ledger_lines(path: Path) -> Callable[[str, str], None]:
    """The GIL-holding job's own work: a JSON line appended through ``open()`` at each of its
    events, as a job that keeps its own record does (most real jobs do some Python work of
    their own, and every microsecond a framework spends per job then comes out of theirs)."""

    def write(job_id: str, event: str) -> None:
        line = json.dumps({"job_id": job_id, "event": event, "at": time.time()})
        with open(path, "a") as ledger:
            ledger.write(line + "\n")

    return write


class Recorder:
    """What the jobs did: counted under one lock, so ``running`` is exact at every instant.
    ``work``, if any, is the job's own work at its start and end (outside the lock)."""

    def __init__(
        self,
        report: Report,
        keep_intervals: bool,
        on_done: Callable[[], None],
        work: Callable[[str, str], None] | None = None,
    ):
        self.report = report
        self._work = work
        self._keep = keep_intervals
        self._on_done = on_done
        self._lock = threading.Lock()
        self._threads_first: dict[int, tuple[str, float, int]] = {}
        # One byte per job, allocated up front: sets of ids grew by tens of MiB over the soak
        # and would have been measured as the implementation's growth.
        self._started = bytearray(report.expect)
        self._finished = bytearray(report.expect)
        self.running = 0
        # jobs finished -> percent; with tiny counts two percents share a mark, the last wins
        self._checkpoints = {max(1, report.expect * p // 100): p for p in CHECKPOINTS}

    def begin(self, job_id: str) -> float:
        now = time.monotonic()
        r = self.report
        first = False
        with self._lock:
            self.running += 1
            r.peak = max(r.peak, self.running)
            if self._keep:
                r.starts.append((job_id, now))
            index = job_index(job_id)
            if self._started[index]:
                r.duplicates += 1
            self._started[index] = 1
            if r.first_start is None:
                r.first_start, r.cpu_first = now, cpu_seconds()
                first = True
                print(f"first-start {now}", flush=True)
            r.last_start = now
        if first:
            # Outside the lock: it reads a file a thread, and under the lock it held every
            # slot's next job up at once, at the start of every run.
            self._threads_first = thread_times()
        return now

    def end(self, job_id: str, started: float) -> None:
        now = time.monotonic()
        r = self.report
        with self._lock:
            self.running -= 1
            index = job_index(job_id)
            first_time = not self._finished[index]
            self._finished[index] = 1
            r.finished += first_time
            r.last_end = now
            if self._keep:
                r.intervals.append((job_id, started, now))
            percent = self._checkpoints.pop(r.finished, None)
            if percent is not None:
                r.rss_kib_at[percent] = rss_kib()
            done = first_time and r.finished == r.expect  # once: a repeat run must not stop twice
            if done:
                r.cpu_done = cpu_seconds()
                self._count_threads()
        if done:
            self._on_done()

    def _count_threads(self) -> None:
        """Each thread group's CPU and slices since the first job started."""
        r = self.report
        for tid, (name, cpu, slices) in thread_times().items():
            _, cpu_first, slices_first = self._threads_first.get(tid, (name, 0.0, 0))
            r.thread_cpu[name] = r.thread_cpu.get(name, 0.0) + cpu - cpu_first
            r.thread_slices[name] = r.thread_slices.get(name, 0) + slices - slices_first

    def run(self, job_id: str, seconds: float) -> None:
        started = self.begin(job_id)
        self._event(job_id, "start")
        if seconds > 0:
            time.sleep(seconds)
        self._event(job_id, "end")
        self.end(job_id, started)

    async def run_async(self, job_id: str, seconds: float) -> None:
        started = self.begin(job_id)
        self._event(job_id, "start")
        if seconds > 0:
            await asyncio.sleep(seconds)
        self._event(job_id, "end")
        self.end(job_id, started)

    def _event(self, job_id: str, event: str) -> None:
        if self._work is not None:
            self._work(job_id, event)

    def sample_every(self, interval: float, stop: threading.Event) -> None:
        samples = self.report.samples
        while not stop.wait(interval):
            samples.append((time.monotonic(), self.running))


class Stop:
    """SIGTERM, or the last expected job, asks the implementation to stop; ``how`` is the
    implementation's own way to be asked."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.how: Callable[[], None] = self.event.set

    def request(self) -> None:
        self.how()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.event.set()


# ---------------------------------------------------------------------------------------------
# The implementations: each runs until asked to stop, then stops the way its library says.
# ---------------------------------------------------------------------------------------------


# The default middleware, by the part of it each implementation switches on.
PARTS = ("store", "telemetry", "logs")
WORKERPOOL_PARTS = {
    "workerpool": frozenset(PARTS),
    "workerpool-bare": frozenset(),
    **{f"workerpool-{part}": frozenset({part}) for part in PARTS},
    "workerpool-async": frozenset(PARTS),
    "workerpool-async-bare": frozenset(),
}
# The ones whose job is an ``async def`` (a baseline from before async jobs cannot run them).
ASYNC_IMPLS = frozenset({"workerpool-async", "workerpool-async-bare"})


def run_workerpool(args: argparse.Namespace, recorder: Recorder, stop: Stop) -> None:
    from workerpool.registry import registry

    options: dict[str, Any] = {"rate_limit": RATE_LIMIT} if args.rate_limit else {}

    name = args.impl.partition("@")[0]
    if name in ASYNC_IMPLS:

        @registry.job(JOB, **options)
        async def bench_async_job(ctx: Any, payload: Any) -> None:
            await recorder.run_async(ctx.job_id, args.seconds)

    else:

        @registry.job(JOB, **options)
        def bench_job(ctx: Any, payload: Any) -> None:
            recorder.run(ctx.job_id, args.seconds)

    parts = WORKERPOOL_PARTS[name]
    work = Path(tempfile.mkdtemp(prefix="bench-wp-"))
    flags: dict[str, Any] = {
        "project": args.project,
        "subscription": args.subscription,
        "max_outstanding": args.n,
        "prefetch": args.prefetch,
        "drain_timeout": args.drain_timeout,
        "idempotency_store": f"sqlite:///{work / 'idempotency.db'}" if "store" in parts else "none",
    }
    if "telemetry" in parts:
        os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
        flags["metrics_port"] = args.metrics_port
    else:
        os.environ["OTEL_SDK_DISABLED"] = "true"
    if args.rate_limit:
        flags["rate_limit"] = (f"{RATE_LIMIT}={args.rate_limit}",)
    # ``workerpool run`` drains on SIGTERM: the last job sends one, as a deployment would.
    stop.how = lambda: os.kill(os.getpid(), signal.SIGTERM)
    serve_until_drained(flags, logging.INFO if "logs" in parts else logging.WARNING)


def _serve_function() -> Any:
    """``serve`` where the revision under test keeps it (a baseline may be older)."""
    for module in ("workerpool.assembly.service", "workerpool.worker.service"):
        try:
            return importlib.import_module(module).serve
        except ImportError:
            continue
    raise ImportError("no service module")


def serve_until_drained(flags: dict[str, Any], log_level: int) -> None:
    """What ``workerpool run`` does, short of ending the process (the report comes after)."""
    try:
        from workerpool.config import load_settings
        from workerpool.telemetry.logs import setup_logging

        serve = _serve_function()
    except ImportError:  # a baseline from before the service module: its CLI returns
        from workerpool.cli import main

        level = "info" if log_level == logging.INFO else "warning"
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if k != "rate_limit"]
        argv += [f"--rate-limit={v}" for v in flags.get("rate_limit", ())]
        main(["--log-level", level, "run", *argv], standalone_mode=False)
        return
    setup_logging(level=log_level)
    serve(load_settings(None, flags))


def run_plain(args: argparse.Namespace, recorder: Recorder, stop: Stop) -> None:
    from google.cloud import pubsub_v1
    from google.cloud.pubsub_v1.subscriber.scheduler import ThreadScheduler
    from google.cloud.pubsub_v1.types import FlowControl

    signal.signal(signal.SIGTERM, stop.on_signal)
    client = pubsub_v1.SubscriberClient()

    def callback(message: Any) -> None:
        recorder.run(message.attributes["job_id"], args.seconds)
        message.ack()

    future = client.subscribe(
        client.subscription_path(args.project, args.subscription),
        callback,
        flow_control=FlowControl(max_messages=args.n),
        scheduler=ThreadScheduler(ThreadPoolExecutor(max_workers=args.n)),
        await_callbacks_on_shutdown=True,
    )
    stop.event.wait()
    future.cancel()  # the documented way to stop: waits for running callbacks, nacks the rest
    future.result(timeout=60)
    client.close()


def run_aio(args: argparse.Namespace, recorder: Recorder, stop: Stop) -> None:
    asyncio.run(_aio(args, recorder, stop))


async def _aio(args: argparse.Namespace, recorder: Recorder, stop: Stop) -> None:
    import aiohttp
    from gcloud.aio.pubsub import SubscriberClient, SubscriberMessage, subscribe

    loop = asyncio.get_running_loop()
    asked = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, asked.set)

    def ask() -> None:
        loop.call_soon_threadsafe(asked.set)

    stop.how = ask

    async def handler(message: SubscriberMessage) -> None:
        await recorder.run_async((message.attributes or {})["job_id"], args.seconds)

    async with aiohttp.ClientSession() as session:
        # Typed as its own Session wrapper; it takes an aiohttp session as its docs show.
        client = SubscriberClient(session=session)  # type: ignore[arg-type]
        task = asyncio.create_task(
            subscribe(
                f"projects/{args.project}/subscriptions/{args.subscription}",
                handler,
                client,
                num_producers=1,
                max_messages_per_producer=args.n,
                num_tasks_per_consumer=args.n,
                # The default 0.3 s let an ack batch pass the library's 2,500-id limit at these
                # rates: it then drops the acks and its shutdown waits for them forever.
                ack_window=0.05,
                ack_deadline=ACK_DEADLINE,  # the subscription's; saves a get_subscription call
            )
        )
        await asked.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


RUNNERS: dict[str, Callable[[argparse.Namespace, Recorder, Stop], None]] = {
    **dict.fromkeys(WORKERPOOL_PARTS, run_workerpool),
    "plain": run_plain,
    "aio": run_aio,
}
IMPLS = tuple(RUNNERS)


def runner(impl: str) -> Callable[[argparse.Namespace, Recorder, Stop], None]:
    name, at, ref = impl.partition("@")
    if name not in RUNNERS or (at and not (ref and name in WORKERPOOL_PARTS)):
        raise SystemExit(f"unknown implementation {impl!r}: one of {', '.join(IMPLS)}[@REF]")
    return RUNNERS[name]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.consumer", description=__doc__)
    parser.add_argument("impl", help=f"one of {', '.join(IMPLS)}; a workerpool one may add @REF")
    parser.add_argument("--project", required=True)
    parser.add_argument("--subscription", required=True)
    parser.add_argument("--n", type=int, required=True, help="jobs running at once, at most")
    parser.add_argument("--expect", type=int, required=True, help="stop after this many jobs")
    parser.add_argument("--seconds", type=float, default=0.0, help="each job sleeps this long")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--sample-ms", type=float, default=0.0, help="sample running jobs")
    parser.add_argument("--intervals", action="store_true", help="report every job's run")
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--prefetch", type=int, required=True, help="workerpool's")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--rate-limit", default="", help="RATE/s[:BURST] on the job")
    parser.add_argument("--ledger", type=Path, help="the job appends a JSON line here per event")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    report = Report(args.impl, args.n, args.expect)
    stop = Stop()
    work = ledger_lines(args.ledger) if args.ledger else None
    recorder = Recorder(report, args.intervals, stop.request, work)
    sampling = threading.Event()
    if args.sample_ms > 0:
        sampler = threading.Thread(
            target=recorder.sample_every, args=(args.sample_ms / 1000, sampling), daemon=True
        )
        sampler.start()
    try:
        runner(args.impl)(args, recorder, stop)
    finally:
        sampling.set()
        report.max_rss_kib = peak_rss_kib()
        args.report.write_text(json.dumps(asdict(report)))


if __name__ == "__main__":
    main(sys.argv[1:])
