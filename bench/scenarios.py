"""The scenarios: each runs every implementation in turn (the order rotates from run to run, so
no implementation always goes first on a warmer emulator) and turns the consumers' reports
into rows of figures, one value per run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from bench.consumer import ASYNC_IMPLS
from bench.harness import Bench, Collector, Consumer
from bench.ratelimit_accuracy import busiest, measure


@dataclass(frozen=True)
class Plan:
    runs: int
    throughput_counts: dict[int, int]  # N -> backlog of no-op jobs
    impls_and_bare: tuple[str, ...]  # throughput and utilisation: where middleware costs show
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
    # The default middleware part by part: (N, backlog, job seconds) runs.
    parts_runs: tuple[tuple[int, int, float], ...] = ((64, 2_000, 0.05), (100, 10_000, 0.0))
    impls: tuple[str, ...] = ("workerpool", "plain", "aio")
    cost_count: int = 20_000  # the backlog of each kind of job in the cost scenario, N = 100
    deviations: tuple[str, ...] = ()  # sizes that differ from the scenario's own, and why


FULL = Plan(
    runs=3,
    throughput_counts={1: 2_000, 10: 20_000, 100: 20_000},
    impls_and_bare=("workerpool", "workerpool-bare", "plain", "aio"),
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
    deviations=(
        "throughput at N = 1 drains 2,000 jobs, not 20,000: the plain client runs about 80 "
        "no-op jobs/s at N = 1, so 20,000 would take over 4 minutes per run",
        "utilisation at N = 1 uses a backlog of 200, not 2,000: 2,000 x 50 ms is 100 s per run",
        "the soak runs once per implementation, not 3 times (about 3 minutes each)",
    ),
)

# BENCHMARKS.md's run (``python -m bench.summary``): every scenario, 3 runs, backlogs a quarter
# of the full run's or less, so the whole takes about 12 minutes on 2 cores.
SHORT = replace(
    FULL,
    throughput_counts={1: 500, 10: 5_000, 100: 5_000},
    util_backlogs={8: 400, 64: 1_280},
    drain_backlog=80,
    drain_cap=5.0,
    soak_count=20_000,
    rate_seconds=2.0,
    parts_runs=((64, 1_280, 0.05), (100, 5_000, 0.0)),
    # The cost scenario keeps its full backlog: at 5,000 no-op jobs (under a second each) its
    # ratio of CPU per job to the plain client's moved by more than 0.1 between runs of one
    # build, measured.
    deviations=(
        "--short: backlogs a quarter of the full run's or less (throughput 500 jobs at N = 1, "
        "5,000 at N = 10 and 100; utilisation 400 jobs at N = 8, 1,280 at N = 64; the cost "
        "scenario's backlogs are the full run's), a soak of 20,000 jobs, rate limits held 2 s, "
        "a drain backlog of 80 with redelivery waited up to 5 s",
    ),
)

QUICK = Plan(
    runs=1,
    throughput_counts={1: 200, 100: 2_000},
    impls_and_bare=("workerpool", "workerpool-bare", "plain", "aio"),
    util_backlogs={8: 80, 64: 320},
    util_seconds=0.05,
    drain_n=8,
    drain_backlog=40,
    drain_seconds=2.0,
    drain_signal_after=3.0,
    drain_cap=3.0,
    soak_count=5_000,
    soak_n=100,
    rates=(10.0, 100.0),
    rate_seconds=1.5,
    parts_runs=((64, 320, 0.05), (100, 2_000, 0.0)),
    cost_count=2_000,
    deviations=("--quick: fewer sizes, every size small, each figure one run",),
)


@dataclass
class Row:
    """One figure measured for several implementations, several runs each."""

    label: str
    unit: str
    better: str  # "higher", "lower" or "" (neither: a description)
    compare: bool = True  # False: a ratio of these values means nothing (near or below 0)
    values: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)  # per implementation

    def add(self, impl: str, value: float) -> None:
        self.values.setdefault(impl, []).append(value)

    def note(self, impl: str, text: str) -> None:
        self.notes.setdefault(impl, []).append(text)

    def median(self, impl: str) -> float | None:
        values = self.values.get(impl)
        return statistics.median(values) if values else None


@dataclass
class Table:
    scenario: str
    description: str
    rows: list[Row] = field(default_factory=list)

    def row(self, label: str, unit: str, better: str, *, compare: bool = True) -> Row:
        row = Row(label, unit, better, compare)
        self.rows.append(row)
        return row


@dataclass
class Context:
    bench: Bench
    plan: Plan
    log: Callable[[str], None]
    tables: list[Table] = field(default_factory=list)
    # For the plot: running jobs over time per implementation, N = 8, from its last run.
    running_n8: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    # A git revision whose workerpool runs beside this one's (``IMPL@REF``): before and after.
    baseline: str = ""

    def with_baseline(self, impls: Iterable[str]) -> tuple[str, ...]:
        """``impls``, and the baseline's run of each workerpool one, side by side."""
        impls = tuple(impls)
        if not self.baseline:
            return impls
        old = (
            f"{impl}@{self.baseline}"
            for impl in impls
            if impl.startswith("workerpool") and impl not in ASYNC_IMPLS
        )
        return (*impls, *old)

    def table(self, scenario: str, description: str) -> Table:
        table = Table(scenario, description)
        self.tables.append(table)
        return table

    def complete(self, report: dict[str, Any], what: str, rows: Iterable[Row]) -> bool:
        """False, said in the anomalies and on the rows, for a run that lost or repeated jobs:
        its figures would look normal and be wrong, so the caller leaves them out."""
        finished, expect, twice = report["finished"], report["expect"], report["duplicates"]
        if finished == expect and not twice:
            return True
        self.anomalies.append(f"{what}: {finished}/{expect} jobs finished, {twice} ran twice")
        for row in rows:
            row.note(report["impl"], "a run left out: see below")
        return False


def rotations(impls: tuple[str, ...], runs: int) -> Iterable[tuple[int, str]]:
    """(run, implementation) with the order rotating each run: A B C, B C A, C A B."""
    for run in range(runs):
        shift = run % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            yield run, impl


def _timeout(count: int, seconds: float, n: int) -> float:
    """Generous: three times the ideal, and no-op jobs at 200/s at least."""
    return 120.0 + count * max(seconds / n * 3, 1 / 200)


def rate(report: dict[str, Any]) -> float:
    """Jobs per second from the first start to the last end."""
    return float(report["finished"]) / float(report["last_end"] - report["first_start"])


def cpu_per_job_ms(report: dict[str, Any], jobs: int) -> float:
    """The consumer's CPU from its first job to its last, in ms a job (s per 1,000 jobs)."""
    return float(report["cpu_done"] - report["cpu_first"]) / jobs * 1000


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
            "per 1,000 jobs. RSS: the process's peak (VmHWM).",
        )
        rows = (
            table.row("throughput", "msg/s", "higher"),
            table.row("CPU per 1,000 messages", "s", "lower"),
            table.row("peak RSS", "MiB", "lower"),
        )
        for run, impl in rotations(ctx.with_baseline(plan.impls_and_bare), plan.runs):
            with ctx.bench.resources(f"tp{n}") as res:
                ctx.bench.publish(res, count)
                report = Consumer(ctx.bench, impl, res, n=n, expect=count).wait(
                    _timeout(count, 0.0, n)
                )
            if not ctx.complete(report, f"throughput N={n} {impl} run {run + 1}", rows):
                continue
            cpu = cpu_per_job_ms(report, count)
            values = (rate(report), cpu, report["max_rss_kib"] / 1024)
            for row, value in zip(rows, values, strict=True):
                row.add(impl, value)
            ctx.log(f"throughput N={n} {impl}: {rate(report):,.0f} msg/s")


# ---------------------------------------------------------------------------------------------
# 2. Slot utilisation
# ---------------------------------------------------------------------------------------------


def utilisation(ctx: Context) -> None:
    plan = ctx.plan
    ms = plan.util_seconds * 1000
    for n, backlog in plan.util_backlogs.items():
        waves = math.ceil(backlog / n)
        table = ctx.table(
            f"2. Slot utilisation, N = {n}",
            f"A backlog of {backlog:,} jobs of {ms:g} ms. Running jobs are counted under one lock "
            "and sampled every 10 ms; 'while the backlog lasts' is from the first start to the "
            f"last start. Ideal: {waves} waves of N jobs, {waves * ms / 1000:g} s from the first "
            "start to the last end.",
        )
        peak = table.row("highest simultaneous running jobs", "jobs", "")
        mean = table.row("mean running / N while the backlog lasts", "", "higher")
        ideal = table.row("throughput / ideal", "", "higher")
        for run, impl in rotations(ctx.with_baseline(plan.impls_and_bare), plan.runs):
            with ctx.bench.resources(f"ut{n}") as res:
                ctx.bench.publish(res, backlog)
                consumer = Consumer(
                    ctx.bench, impl, res, n=n, expect=backlog, seconds=plan.util_seconds,
                    sample_ms=10,
                )  # fmt: skip
                report = consumer.wait(_timeout(backlog, plan.util_seconds, n))
            what = f"utilisation N={n} {impl} run {run + 1}"
            if not ctx.complete(report, what, (peak, mean, ideal)):
                continue
            first, last_end = report["first_start"], report["last_end"]
            peak.add(impl, report["peak"])
            mean.add(impl, busy(report, n))
            ideal.add(impl, waves * plan.util_seconds / (last_end - first))
            if n == 8:
                ctx.running_n8[impl] = [
                    (at - first, running)
                    for at, running in report["samples"]
                    if first <= at <= last_end
                ]
            ctx.log(f"utilisation N={n} {impl}: peak {report['peak']}")


# ---------------------------------------------------------------------------------------------
# 3. Drain (and what a worker holds)
# ---------------------------------------------------------------------------------------------


def held(backlog: int, starts: list[tuple[str, float]], ends: list[float], pullable: set[str],
         probe: float) -> int:  # fmt: skip
    """Messages a worker held when the probe began: neither finished before it nor pullable by
    it. A job that started after the probe (a later wave) was pullable then, so only starts
    before the probe come off what the probe saw."""
    done_before = sum(1 for end in ends if end <= probe)
    started_before = {job for job, begin in starts if begin <= probe}
    return backlog - done_before - len(pullable - started_before)


def drain(ctx: Context) -> None:
    plan = ctx.plan
    n, cap, seconds = plan.drain_n, plan.drain_cap, plan.drain_seconds
    table = ctx.table(
        f"3. Drain, N = {n}",
        f"A backlog of {plan.drain_backlog} jobs of {seconds:g} s. From 0.5 s to 1.5 s after the "
        "first job started, a second consumer pulls and gives back at once all it can: what it "
        f"cannot get, the worker holds. At {plan.drain_signal_after:g} s the worker gets SIGTERM "
        "(workerpool drains; the plain client calls `future.cancel()` then `result()`, as its "
        "docs say; gcloud-aio's `subscribe()` task is cancelled) and another replica starts "
        f"pulling and acking. Redelivery waits up to {cap:g} s.",
    )
    held_row = table.row("messages held (pulled, not finished) at 0.5-1.5 s", "messages", "lower")
    exit_row = table.row("exit after the signal", "s", "")
    overshoot = table.row(
        "exit after the signal minus the longest remaining job", "s", "lower", compare=False
    )
    after = table.row("jobs started after the signal", "jobs", "lower", compare=False)
    unfinished = table.row("jobs started but not finished at exit", "jobs", "lower", compare=False)
    every = table.row("every unstarted message at the other replica", "s", "lower")
    lost = table.row(
        f"unstarted messages not redelivered within {cap:g} s", "messages", "lower", compare=False
    )
    for run, impl in rotations(plan.impls, plan.runs):
        with ctx.bench.resources("dr") as res:
            ids = set(ctx.bench.publish(res, plan.drain_backlog))
            consumer = Consumer(
                ctx.bench, impl, res, n=n, expect=plan.drain_backlog, seconds=seconds,
                intervals=True,
            )  # fmt: skip
            if not consumer.first_start.wait(60):
                consumer.terminate()
                raise RuntimeError(f"{impl} started no job within 60 s; see {consumer.log_path}")
            t0 = consumer.first_start_at
            _sleep_until(t0 + 0.5)
            pullable = ctx.bench.probe_available(res, 1.0)
            _sleep_until(t0 + plan.drain_signal_after)
            signalled = consumer.terminate()
            collector = Collector(ctx.bench, res)
            report = consumer.wait(seconds + 60)
            started = {job for job, _ in report["starts"]}
            unstarted = ids - started
            collector.wait_for(unstarted, signalled + cap)
            collector.stop()
        ends = [end for _, _, end in report["intervals"]]
        held_row.add(impl, held(plan.drain_backlog, report["starts"], ends, pullable, t0 + 0.5))
        # Remaining: each job running at the signal, by its nominal end (its own sleep).
        remaining = max(
            (begin + seconds - signalled for _, begin in report["starts"] if begin < signalled),
            default=0.0,
        )
        took = consumer.exited_at - signalled
        exit_row.add(impl, took)
        overshoot.add(impl, took - remaining)
        after.add(impl, sum(1 for _, begin in report["starts"] if begin >= signalled))
        unfinished.add(impl, len(started) - len(report["intervals"]))
        arrived = {i: collector.seen[i] - signalled for i in unstarted if i in collector.seen}
        missing = len(unstarted) - len(arrived)
        lost.add(impl, missing)
        if missing:
            every.note(impl, f"run {run + 1}: capped at {cap:g} s")
        every.add(impl, cap if missing else max(arrived.values(), default=0.0))
        twice = started & collector.seen.keys()
        if twice:
            ctx.anomalies.append(f"drain {impl} run {run + 1}: {len(twice)} ran and came back")
        ctx.log(f"drain {impl}: exit {took:.2f} s after the signal, {len(unstarted)} unstarted")


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
        f"{count:,} no-op jobs through one process, one run per implementation. RSS read from "
        "/proc/self/statm when 10 %, 50 % and 100 % of the jobs had finished; growth is "
        "RSS(100 %) / RSS(50 %) - 1.",
    )
    rss_rows = {p: table.row(f"RSS at {p} %", "MiB", "lower") for p in (10, 50, 100)}
    growth = table.row("growth from 50 % to 100 %", "%", "lower")
    speed = table.row("throughput", "msg/s", "higher")
    for _, impl in rotations(plan.impls, 1):
        with ctx.bench.resources("soak") as res:
            ctx.bench.publish(res, count)
            report = Consumer(ctx.bench, impl, res, n=n, expect=count).wait(_timeout(count, 0.0, n))
        if not ctx.complete(report, f"soak {impl}", (*rss_rows.values(), growth, speed)):
            continue
        rss = {p: report["rss_kib_at"][str(p)] / 1024 for p in (10, 50, 100)}
        for p, row in rss_rows.items():
            row.add(impl, rss[p])
        growth.add(impl, (rss[100] / rss[50] - 1) * 100)
        speed.add(impl, rate(report))
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
        "backlog. The limiter alone: 16 threads take tokens as fast as it allows "
        "(bench/ratelimit_accuracy.py, which also reports its busiest window). Achieved = "
        "(events - 1) / (last - first); busiest 100 ms window of starts against its share "
        "R / 10. CPU: the consumer process's user + system seconds from its first job to its "
        "last, per job."
        + (f" `@{ctx.baseline}`: through the pool of that revision." if ctx.baseline else ""),
    )
    for declared in plan.rates:
        achieved = table.row(f"{declared:g}/s through the pool: achieved / declared", "", "")
        burst = table.row(
            f"{declared:g}/s through the pool: busiest 100 ms (share {declared / 10:g})",
            "starts",
            "",
        )
        cpu = table.row(f"{declared:g}/s through the pool: CPU per job", "ms", "lower")
        alone = table.row(f"{declared:g}/s limiter alone: achieved / declared", "", "")
        count = int(declared * plan.rate_seconds) + 1
        for run, impl in rotations(ctx.with_baseline(("workerpool",)), plan.runs):
            with ctx.bench.resources("rl") as res:
                ctx.bench.publish(res, count)
                report = Consumer(
                    ctx.bench, impl, res, n=50, expect=count, intervals=True,
                    rate_limit=f"{declared:g}/s:1",
                ).wait(plan.rate_seconds * 3 + 60)  # fmt: skip
            if ctx.complete(
                report, f"rate {declared:g}/s {impl} run {run + 1}", (achieved, burst, cpu)
            ):
                starts = sorted(begin for _, begin in report["starts"])
                achieved.add(impl, (len(starts) - 1) / (starts[-1] - starts[0]) / declared)
                burst.add(impl, busiest(starts, 0.1))
                cpu.add(impl, cpu_per_job_ms(report, count))
            if impl == "workerpool":  # the limiter of this revision, in this process
                measured = measure(declared, plan.rate_seconds, 16)
                alone.add(impl, measured["achieved_ratio"])
        ctx.log(f"rate {declared:g}/s: {achieved.median('workerpool')}")


# ---------------------------------------------------------------------------------------------
# 6. The default middleware, part by part
# ---------------------------------------------------------------------------------------------

PART_IMPLS = (
    "workerpool-bare", "workerpool-store", "workerpool-telemetry", "workerpool-logs", "workerpool",
)  # fmt: skip


# Where a no-op job's CPU goes in a workerpool process: the threads that carry a job, and the
# watch of the slot threads' queue, which wakes them, by the name the consumer reports them
# under (``consumer.thread_times``). The rest (the log writer, acks, gRPC's, the timers, the
# main thread) is a few microseconds a job each.
THREAD_GROUPS = {
    "slot threads": "-slot",
    "puller": "workerpool-puller",
    "completions": "workerpool-completions",
    "queue's watch": "-handoff",
}


def per_thread(report: dict[str, Any], field: str, jobs: int) -> dict[str, float]:
    """``report[field]`` (CPU seconds or slices by thread name) summed over each of
    ``THREAD_GROUPS``' threads, per job."""
    grouped: dict[str, float] = {}
    for name, value in report[field].items():
        for group, suffix in THREAD_GROUPS.items():
            if name.endswith(suffix):
                grouped[group] = grouped.get(group, 0.0) + value / jobs
    return grouped


def parts(ctx: Context) -> None:
    for n, backlog, seconds in ctx.plan.parts_runs:
        kind = f"{seconds * 1000:g} ms jobs" if seconds else "no-op jobs"
        table = ctx.table(
            f"6. Parts, N = {n}, {kind}",
            f"A backlog of {backlog:,} {kind}, with nothing on (bare), one part of the default "
            "middleware on (the SQLite store; tracing sampled off and metrics; the job log "
            "lines), or all of them (workerpool). CPU: user + system seconds of the consumer "
            "process from its first job to its last, per job. By thread: the kernel's count of "
            "the CPU of the threads that carry a job over the same span (each row a median of "
            "its own; the other threads take a few microseconds a job each), and how many times "
            "slot threads and the watch that wakes them were put on a CPU, per job."
            + ("" if seconds else " Throughput: the cost table's.")
            + (
                f" `@{ctx.baseline}`: the same, by the workerpool of that revision."
                if ctx.baseline
                else ""
            ),
        )
        cpu = table.row("CPU per job", "ms", "lower")
        # Slots of no-op jobs are busy for microseconds: a sampled mean means nothing there.
        mean = (
            table.row("mean running / N while the backlog lasts", "", "higher") if seconds else None
        )
        # The CPU by thread, and how often the slot threads were put on a CPU: a no-op run
        # whose slot threads wake for every few jobs costs two to three times one whose threads
        # take job after job, and a job that waits is woken at least twice.
        threads = {
            group: table.row(f"CPU per job, {group}", "us", "lower") for group in THREAD_GROUPS
        }
        slices = table.row("slot threads put on a CPU, per job", "", "lower")
        watch_slices = table.row("the queue's watch put on a CPU, per job", "", "lower")
        for run, impl in rotations(ctx.with_baseline(PART_IMPLS), ctx.plan.runs):
            with ctx.bench.resources(f"pt{n}") as res:
                ctx.bench.publish(res, backlog)
                report = Consumer(
                    ctx.bench, impl, res, n=n, expect=backlog, seconds=seconds, sample_ms=10
                ).wait(_timeout(backlog, seconds, n))
            rows = (cpu, *threads.values(), slices, watch_slices)
            if not ctx.complete(report, f"parts N={n} {impl} run {run + 1}", rows):
                continue
            cpu.add(impl, cpu_per_job_ms(report, backlog))
            if mean is not None:
                mean.add(impl, busy(report, n))
            if report["thread_cpu"]:
                for group, seconds_per_job in per_thread(report, "thread_cpu", backlog).items():
                    threads[group].add(impl, seconds_per_job * 1e6)
            if report["thread_slices"]:
                slices_by_group = per_thread(report, "thread_slices", backlog)
                slices.add(impl, slices_by_group.get("slot threads", 0.0))
                if "queue's watch" in slices_by_group:  # (a revision before it has none)
                    watch_slices.add(impl, slices_by_group["queue's watch"])
            ctx.log(f"parts N={n} {impl}: {cpu.values[impl][-1]:.3f} ms CPU per job")


# ---------------------------------------------------------------------------------------------
# 7. What a job costs, the defaults as a user runs them
# ---------------------------------------------------------------------------------------------

COST_N = 100
ASYNC_N = 64


class JobKind(NamedTuple):
    ledger: bool  # appends a JSON line through ``open()`` as it starts and ends (holds the GIL)
    seconds: float  # sleeps this long, as a job waiting on I/O does


# The jobs of the cost scenario: no-op, one that does Python work of its own (holds the GIL),
# and one that waits 50 ms, as most real jobs wait on I/O (its slot thread sleeps and wakes).
NO_OP = "no-op jobs"  # the kind whose peak RSS is reported
COST_KINDS = {
    NO_OP: JobKind(ledger=False, seconds=0.0),
    "GIL-holding jobs": JobKind(ledger=True, seconds=0.0),
    "50 ms jobs": JobKind(ledger=False, seconds=0.05),
}


def cost(ctx: Context) -> None:
    plan = ctx.plan
    table = ctx.table(
        f"7. Cost per job, N = {COST_N}",
        f"A backlog of {plan.cost_count:,} jobs of each kind: no-op jobs, GIL-holding jobs "
        "that append a JSON line to a file of their own through `open()` as they start and as "
        "they end (Python work of their own, as a real job does), and jobs that sleep 50 ms "
        "(as one waiting on I/O does). workerpool as a user runs "
        "it: its SQLite store on disk, metrics on, a JSON log line per job written to a file. "
        "CPU: the consumer process's user + system seconds from its first job to its last, "
        "per 1,000 jobs. RSS: the process's peak (VmHWM), no-op jobs.",
    )
    rows = {
        kind: (
            table.row(f"{kind}: CPU per 1,000 jobs", "s", "lower"),
            table.row(f"{kind}: throughput", "msg/s", "higher"),
        )
        for kind in COST_KINDS
    }
    rss = table.row(f"peak RSS, {NO_OP}", "MiB", "lower")
    impls = ctx.with_baseline(("workerpool", "plain", "aio"))
    for kind, job in COST_KINDS.items():
        cpu, rate_row = rows[kind]
        for run, impl in rotations(impls, plan.runs):
            with ctx.bench.resources("cost") as res:
                ctx.bench.publish(res, plan.cost_count)
                report = Consumer(
                    ctx.bench, impl, res, n=COST_N, expect=plan.cost_count, seconds=job.seconds,
                    ledger=job.ledger,
                ).wait(_timeout(plan.cost_count, job.seconds, COST_N))  # fmt: skip
            if not ctx.complete(report, f"cost {kind} {impl} run {run + 1}", (rate_row, cpu)):
                continue
            rate_row.add(impl, rate(report))
            cpu.add(impl, cpu_per_job_ms(report, plan.cost_count))
            if kind == NO_OP:
                rss.add(impl, report["max_rss_kib"] / 1024)
            ctx.log(f"cost {kind} {impl}: {cpu.values[impl][-1]:.3f} s CPU per 1,000")
    busy_async(ctx)


def busy_async(ctx: Context) -> None:
    """The slots of ``async def`` jobs, the defaults beside everything off."""
    backlog, seconds = ctx.plan.util_backlogs[ASYNC_N], ctx.plan.util_seconds
    table = ctx.table(
        f"7. Async slots, N = {ASYNC_N}",
        f"A backlog of {backlog:,} `async def` jobs of {seconds * 1000:g} ms (`asyncio.sleep`), "
        "with the defaults (workerpool-async) and with everything off (workerpool-async-bare). "
        "Running jobs sampled every 10 ms, from the first start to the last start.",
    )
    mean = table.row("mean running / N while the backlog lasts", "", "higher")
    # The defaults' run by the baseline revision too: the before of the async slots' figure.
    before = (f"workerpool-async@{ctx.baseline}",) if ctx.baseline else ()
    impls = ("workerpool-async", "workerpool-async-bare", "aio", *before)
    for run, impl in rotations(impls, ctx.plan.runs):
        with ctx.bench.resources("busy") as res:
            ctx.bench.publish(res, backlog)
            report = Consumer(
                ctx.bench, impl, res, n=ASYNC_N, expect=backlog, seconds=seconds, sample_ms=10
            ).wait(_timeout(backlog, seconds, ASYNC_N))
        if ctx.complete(report, f"async slots {impl} run {run + 1}", (mean,)):
            mean.add(impl, busy(report, ASYNC_N))


def busy(report: dict[str, Any], n: int) -> float:
    """Mean running / N from the first start to the last (while the backlog lasts)."""
    first, last = report["first_start"], report["last_start"]
    window = [running for at, running in report["samples"] if first <= at <= last]
    return statistics.fmean(window) / n if window else math.nan


SCENARIOS: dict[str, Callable[[Context], None]] = {
    "throughput": throughput,
    "utilisation": utilisation,
    "drain": drain,
    "soak": soak,
    "rate": rate_limits,
    "parts": parts,
    "cost": cost,
}
