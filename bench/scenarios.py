"""The scenarios: each runs every implementation in turn (the order rotates from run to run, so
no implementation always goes first on a warmer emulator) and turns the consumers' reports
into rows of figures, one value per run.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.harness import Bench, Consumer, job_id
from bench.ratelimit_accuracy import busiest, measure

PREFETCH = 2  # workerpool's default; what a worker may hold beyond N


@dataclass(frozen=True)
class Plan:
    runs: int
    throughput_counts: dict[int, int]  # N -> backlog of no-op jobs
    throughput_impls: tuple[str, ...]
    util_backlogs: dict[int, int]  # N -> backlog of 50 ms jobs
    util_seconds: float
    drain_n: int
    drain_backlog: int
    drain_seconds: float
    drain_signal_after: float  # seconds after the first job started
    drain_cap: float  # wait at most this long for the unstarted messages
    soak_count: int
    soak_n: int
    rates: tuple[float, ...]
    rate_seconds: float
    impls: tuple[str, ...] = ("workerpool", "plain", "aio")


FULL = Plan(
    runs=3,
    throughput_counts={1: 2_000, 10: 20_000, 100: 20_000},
    throughput_impls=("workerpool", "workerpool-bare", "plain", "aio"),
    util_backlogs={1: 200, 8: 2_000, 64: 2_000},
    util_seconds=0.05,
    drain_n=8,
    drain_backlog=200,
    drain_seconds=2.0,
    drain_signal_after=3.0,
    drain_cap=15.0,
    soak_count=200_000,
    soak_n=100,
    rates=(10.0, 100.0, 1_000.0),
    rate_seconds=5.0,
)

QUICK = Plan(
    runs=1,
    throughput_counts={1: 500, 10: 2_000, 100: 3_000},
    throughput_impls=("workerpool", "workerpool-bare", "plain", "aio"),
    util_backlogs={1: 40, 8: 320, 64: 640},
    util_seconds=0.05,
    drain_n=8,
    drain_backlog=100,
    drain_seconds=2.0,
    drain_signal_after=3.0,
    drain_cap=5.0,
    soak_count=20_000,
    soak_n=100,
    rates=(10.0, 100.0),
    rate_seconds=2.0,
)


@dataclass
class Row:
    """One figure measured for several implementations, several runs each."""

    label: str
    unit: str
    better: str  # "higher", "lower" or "" (neither: a description)
    values: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # per implementation, e.g. "2/3 capped"

    def add(self, impl: str, value: float) -> None:
        self.values.setdefault(impl, []).append(value)

    def median(self, impl: str) -> float | None:
        values = self.values.get(impl)
        return statistics.median(values) if values else None


@dataclass
class Table:
    scenario: str
    description: str
    rows: list[Row] = field(default_factory=list)

    def row(self, label: str, unit: str, better: str) -> Row:
        row = Row(label, unit, better)
        self.rows.append(row)
        return row


@dataclass
class Context:
    bench: Bench
    plan: Plan
    log: Callable[[str], None]
    tables: list[Table] = field(default_factory=list)
    # Kept for the plots: running jobs over time per implementation, N = 8.
    running_n8: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)

    def table(self, scenario: str, description: str) -> Table:
        table = Table(scenario, description)
        self.tables.append(table)
        return table

    def check(self, report: dict[str, Any], what: str) -> None:
        """Record (never hide) a run that lost or repeated jobs."""
        if report["finished"] < report["expect"] or report["duplicates"]:
            self.anomalies.append(
                f"{what}: {report['finished']}/{report['expect']} jobs finished, "
                f"{report['duplicates']} ran twice"
            )


def rotations(impls: tuple[str, ...], runs: int) -> Iterable[tuple[int, str]]:
    """(run, implementation) with the order rotating each run: A B C, B C A, C A B."""
    for run in range(runs):
        shift = run % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            yield run, impl


def _timeout(count: int, seconds: float, n: int) -> float:
    return 120.0 + count * max(seconds, 0.001) / n * 3


# ---------------------------------------------------------------------------------------------
# 1. Throughput
# ---------------------------------------------------------------------------------------------


def throughput(ctx: Context) -> None:
    plan = ctx.plan
    for n, count in plan.throughput_counts.items():
        table = ctx.table(
            f"1. Throughput, N = {n}",
            f"Drain a backlog of {count:,} no-op jobs. Rate: jobs / (last end - first start). "
            "CPU: the consumer process's user + system seconds from its first job to its last, "
            "per 1,000 jobs. RSS: the process's peak.",
        )
        rate = table.row("throughput", "msg/s", "higher")
        cpu = table.row("CPU per 1,000 messages", "s", "lower")
        rss = table.row("peak RSS", "MiB", "lower")
        for run, impl in rotations(plan.throughput_impls, plan.runs):
            with ctx.bench.resources(f"tp{n}") as res:
                ctx.bench.publish(res, count)
                consumer = Consumer(ctx.bench, impl, res, n=n, expect=count)
                report = consumer.wait(_timeout(count, 0.0, n))
            ctx.check(report, f"throughput N={n} {impl} run {run + 1}")
            span = report["last_end"] - report["first_start"]
            rate.add(impl, report["finished"] / span)
            cpu_end = report["cpu_done"] or report["cpu_exit"]  # short of its count: at exit
            cpu.add(impl, (cpu_end - report["cpu_first"]) / report["finished"] * 1000)
            rss.add(impl, report["max_rss_kib"] / 1024)
            ctx.log(f"throughput N={n} {impl}: {report['finished'] / span:,.0f} msg/s")


# ---------------------------------------------------------------------------------------------
# 2. Slot utilisation
# ---------------------------------------------------------------------------------------------


def utilisation(ctx: Context) -> None:
    plan = ctx.plan
    ms = plan.util_seconds * 1000
    for n, backlog in plan.util_backlogs.items():
        table = ctx.table(
            f"2. Slot utilisation, N = {n}",
            f"A backlog of {backlog:,} jobs of {ms:g} ms. Running jobs are counted under one lock "
            "and sampled every 10 ms; 'while the backlog lasts' is from the first start to the "
            f"last start. Ideal throughput is N / {ms:g} ms = {n / plan.util_seconds:,.0f}/s.",
        )
        peak = table.row("highest simultaneous running jobs", "jobs", "")
        mean = table.row("mean running / N while the backlog lasts", "", "higher")
        ideal = table.row("throughput / ideal", "", "higher")
        for run, impl in rotations(plan.impls, plan.runs):
            with ctx.bench.resources(f"ut{n}") as res:
                ctx.bench.publish(res, backlog)
                consumer = Consumer(
                    ctx.bench, impl, res, n=n, expect=backlog, seconds=plan.util_seconds,
                    sample_ms=10,
                )  # fmt: skip
                report = consumer.wait(_timeout(backlog, plan.util_seconds, n))
            ctx.check(report, f"utilisation N={n} {impl} run {run + 1}")
            window = [
                running
                for at, running in report["samples"]
                if report["first_start"] <= at <= report["last_start"]
            ]
            peak.add(impl, report["peak"])
            mean.add(impl, statistics.fmean(window) / n if window else float("nan"))
            span = report["last_end"] - report["first_start"]
            ideal.add(impl, report["finished"] / span / (n / plan.util_seconds))
            if n == 8:
                start = report["first_start"]
                ctx.running_n8[impl] = [(at - start, running) for at, running in report["samples"]]
            ctx.log(f"utilisation N={n} {impl}: peak {report['peak']}")


# ---------------------------------------------------------------------------------------------
# 3. Drain (and what a worker holds)
# ---------------------------------------------------------------------------------------------


class Collector:
    """Another replica: pulls and acks everything, noting when each job id first arrived."""

    def __init__(self, bench: Bench, res: Any) -> None:
        self.seen: dict[str, float] = {}
        self._bench, self._res = bench, res
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            received = self._bench.pull(self._res, timeout=0.5)
            now = time.monotonic()
            for message in received:
                self.seen.setdefault(job_id(message), now)
            if received:
                self._bench.observer.acknowledge(
                    request={
                        "subscription": self._res.subscription_path,
                        "ack_ids": [m.ack_id for m in received],
                    }
                )

    def wait_for(self, ids: set[str], deadline: float) -> None:
        while ids - self.seen.keys() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def drain(ctx: Context) -> None:
    plan = ctx.plan
    n, cap = plan.drain_n, plan.drain_cap
    table = ctx.table(
        f"3. Drain, N = {n}",
        f"A backlog of {plan.drain_backlog} jobs of {plan.drain_seconds:g} s. From 0.5 s to 1.5 s "
        "after the first job started, a second consumer pulls and gives back at once all it can: "
        "what it cannot get, the worker holds. At "
        f"{plan.drain_signal_after:g} s the worker gets SIGTERM (workerpool drains; the plain "
        "client calls `future.cancel()` then `result()`, as its docs say; gcloud-aio's "
        "`subscribe()` task is cancelled) and another replica starts pulling and acking. "
        f"Redelivery waits up to {cap:g} s.",
    )
    held = table.row("messages held (pulled, not finished) at 0.5-1.5 s", "messages", "lower")
    overshoot = table.row("exit after the signal minus the longest remaining job", "s", "lower")
    exit_row = table.row("exit after the signal", "s", "")
    first = table.row(
        "first unstarted message at the other replica, after the signal", "s", "lower"
    )
    every = table.row(
        "every unstarted message at the other replica, after the signal", "s", "lower"
    )
    lost = table.row(f"unstarted messages not redelivered within {cap:g} s", "messages", "lower")
    for run, impl in rotations(plan.impls, plan.runs):
        with ctx.bench.resources("dr") as res:
            ids = set(ctx.bench.publish(res, plan.drain_backlog))
            consumer = Consumer(
                ctx.bench, impl, res, n=n, expect=plan.drain_backlog,
                seconds=plan.drain_seconds, intervals=True,
            )  # fmt: skip
            if not consumer.first_start.wait(60):
                raise RuntimeError(f"{impl} started no job within 60 s; see {consumer.log_path}")
            t0 = time.monotonic()
            _sleep_until(t0 + 0.5)
            pullable = ctx.bench.probe_available(res, 1.0)
            _sleep_until(t0 + plan.drain_signal_after)
            signalled = consumer.terminate()
            collector = Collector(ctx.bench, res)
            report = consumer.wait(plan.drain_seconds + 60)
            started = {job for job, _, _ in report["intervals"]}
            unstarted = ids - started
            collector.wait_for(unstarted, signalled + cap)
            collector.stop()
        ctx.log(f"drain {impl}: {len(started)} started, {len(unstarted)} not")
        # Held at the probe: neither finished before it, nor pullable by it. A job that started
        # after the probe (a later wave) was pullable then, so only earlier starts come off.
        probe = t0 + 0.5
        done_before = sum(1 for _, _, end in report["intervals"] if end <= probe)
        started_before = {job for job, begin, _ in report["intervals"] if begin <= probe}
        held.add(impl, plan.drain_backlog - done_before - len(pullable - started_before))
        remaining = max(
            (end - signalled for _, begin, end in report["intervals"] if begin < signalled),
            default=0.0,
        )
        took = consumer.exited_at - signalled
        exit_row.add(impl, took)
        overshoot.add(impl, took - remaining)
        arrivals = sorted(collector.seen[i] - signalled for i in unstarted if i in collector.seen)
        missing = len(unstarted) - len(arrivals)
        lost.add(impl, missing)
        first.add(impl, arrivals[0] if arrivals else cap)
        every.add(impl, cap if missing else (arrivals[-1] if arrivals else 0.0))
        if missing:
            every.notes[impl] = f"capped at {cap:g} s in some runs"
        twice = started & collector.seen.keys()
        if twice:
            ctx.anomalies.append(
                f"drain {impl} run {run + 1}: {len(twice)} jobs came back after running"
            )


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


# ---------------------------------------------------------------------------------------------
# 4. Soak
# ---------------------------------------------------------------------------------------------


def soak(ctx: Context) -> None:
    plan = ctx.plan
    count, n = plan.soak_count, plan.soak_n
    table = ctx.table(
        f"4. Soak, N = {n}",
        f"{count:,} no-op jobs through one process, once per implementation. RSS read from "
        "/proc/self/statm when 10 %, 50 % and 100 % of the jobs had finished; growth is "
        "RSS(100 %) / RSS(50 %) - 1.",
    )
    rows = {p: table.row(f"RSS at {p} %", "MiB", "lower") for p in (10, 50, 100)}
    growth = table.row("growth from 50 % to 100 %", "%", "lower")
    rate = table.row("throughput", "msg/s", "higher")
    for _, impl in rotations(plan.impls, 1):
        with ctx.bench.resources("soak") as res:
            ctx.bench.publish(res, count)
            report = Consumer(ctx.bench, impl, res, n=n, expect=count).wait(_timeout(count, 0.0, n))
        ctx.check(report, f"soak {impl}")
        rss = {p: report["rss_kib_at"].get(str(p), math.nan) / 1024 for p in (10, 50, 100)}
        for p, row in rows.items():
            row.add(impl, rss[p])
        growth.add(impl, (rss[100] / rss[50] - 1) * 100)
        rate.add(impl, report["finished"] / (report["last_end"] - report["first_start"]))
        ctx.log(f"soak {impl}: RSS {rss[10]:.0f} / {rss[50]:.0f} / {rss[100]:.0f} MiB")


# ---------------------------------------------------------------------------------------------
# 5. Rate limiter accuracy
# ---------------------------------------------------------------------------------------------


def rate_limits(ctx: Context) -> None:
    plan = ctx.plan
    table = ctx.table(
        "5. Rate limiter accuracy",
        f"workerpool only (the others have no rate limiter). Through the pool: a worker with "
        f"N = 50 runs no-op jobs limited to R/s (burst 1) for about {plan.rate_seconds:g} s of "
        "backlog; achieved = (jobs - 1) / (last start - first start). The limiter alone: 16 "
        "threads take tokens as fast as it allows (bench/ratelimit_accuracy.py). Busiest "
        "100 ms window of starts (grants), against its share R / 10.",
    )
    for rate in plan.rates:
        achieved = table.row(f"{rate:g}/s through the pool: achieved / declared", "", "")
        burst = table.row(
            f"{rate:g}/s through the pool: busiest 100 ms (share {rate / 10:g})", "starts", ""
        )
        alone = table.row(f"{rate:g}/s limiter alone: achieved / declared", "", "")
        alone_busiest = table.row(f"{rate:g}/s limiter alone: busiest 100 ms", "grants", "")
        count = int(rate * plan.rate_seconds) + 1
        for _ in range(plan.runs):
            with ctx.bench.resources("rl") as res:
                ctx.bench.publish(res, count)
                report = Consumer(
                    ctx.bench, "workerpool", res, n=50, expect=count, intervals=True,
                    rate_limit=f"{rate:g}/s:1",
                ).wait(plan.rate_seconds * 3 + 60)  # fmt: skip
            ctx.check(report, f"rate {rate:g}/s")
            starts = sorted(begin for _, begin, _ in report["intervals"])
            achieved.add("workerpool", (len(starts) - 1) / (starts[-1] - starts[0]) / rate)
            burst.add("workerpool", busiest(starts, 0.1))
            measured = measure(rate, plan.rate_seconds, 16)
            alone.add("workerpool", measured["achieved_ratio"])
            alone_busiest.add("workerpool", measured["busiest_100ms"])
        ctx.log(f"rate {rate:g}/s: {achieved.median('workerpool'):.4f}")


SCENARIOS: dict[str, Callable[[Context], None]] = {
    "throughput": throughput,
    "utilisation": utilisation,
    "drain": drain,
    "soak": soak,
    "rate": rate_limits,
}
