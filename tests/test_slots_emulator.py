"""Fleet-wide concurrency limits, shown with real worker processes on the Pub/Sub emulator,
sharing an SQLite store on one host or the Firestore emulator's store."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    WorkerProcess,
    held_messages,
    ledger_events,
    overlap,
    read_ledger,
    shared_store,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool import AsyncJobContext, JobContext
from workerpool.registry import Registry
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources, wait_settled

# The jobs that take slots, with limits for their keys (a test declares its own after these).
# Share of the key's slots kept busy while the backlog lasts: 0.90 on both stores, the target.
# Measured on a warm Firestore emulator (``warm_firestore``): 0.928-0.955 in six runs, with a
# release handing its slot to the first in line and deferrals not waiting for their bookings'
# writes (on a cold emulator the JVM answers writes in 0.1-1 s for its first seconds).
BUSY = {"sqlite": 0.90, "firestore": 0.90}
EXPORTS = 100  # jobs of 0.5 s on 3 slots: about 17 s of backlog
SLOT_JOBS = (
    "--jobs", "workerpool_jobs.demo_slots", "--concurrency", "tenant:*=1",
    "--concurrency", "demo-slots=1",
)  # fmt: skip


def _short_stretches(
    intervals: list[tuple[float, float]], limit: int, until: float
) -> list[tuple[float, float]]:
    """The three longest stretches before ``until`` with fewer than ``limit`` open, as
    (seconds from the first start, length): where a busy share below the mark went."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    first, open_now, since = events[0][0], 0, None
    stretches = []
    for when, change in events:
        if when > until:
            break
        open_now += change
        if open_now < limit and since is None:
            since = when
        elif open_now >= limit and since is not None:
            stretches.append((round(since - first, 2), round(when - since, 2)))
            since = None
    return sorted(stretches, key=lambda s: -s[1])[:3]


def _stalled(ledger: Path, workers: list[WorkerProcess]) -> str:
    """What a run that did not finish in time left to read: how far it got, each worker's
    last warnings, and what the ledger and the workers' logs say of the jobs not done."""
    done = {r["job_id"] for r in ledger_events(ledger, "done")}
    started = {r["job_id"] for r in ledger_events(ledger, "start")}
    missing = sorted({f"export-{i}" for i in range(EXPORTS)} - done)
    began = sorted(started & set(missing))
    lines = [f"{len(done)} of {EXPORTS} done; not done: {missing[:5]}, of them started: {began}"]
    named = re.compile("|".join(rf"\b{re.escape(job_id)}\b" for job_id in missing[:5]) or "$^")
    for worker in workers:
        output = worker.output().splitlines()
        warnings = [line for line in output if "INFO" not in line[:40]]
        about = [line for line in output if named.search(line)]
        lines += [f"worker {worker.pid}:", *warnings[-5:], *about[-10:]]
    return "\n".join(lines)


def _deferrals(workers: list[WorkerProcess]) -> Counter[str]:
    """How many times each job was deferred, from the workers' job log lines."""
    deferred: Counter[str] = Counter()
    for worker in workers:
        for line in worker.output().splitlines():
            if line.startswith("{") and '"outcome": "deferred"' in line:
                deferred[json.loads(line)["job_id"]] += 1
    return deferred


@pytest.mark.alone
@pytest.mark.parametrize("kind", ["sqlite", "firestore"])
def test_a_key_limit_is_exact_across_four_worker_processes(
    kind: str, pubsub_resources: PubSubResources, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Given 4 worker processes with 8 slots each sharing one store, and a key of limit 3
    pubsub_resources.provision(retry_policy=False)  # deferrals keep their own delays
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store(kind, request, tmp_path, warm=True)
    extra_env["WORKERPOOL_DEMO_LEDGER_STARTS"] = "1"  # if it stalls: did a job not done start?
    jobs = [(f"export-{i}", {"seconds": 0.5}) for i in range(EXPORTS)]
    with worker_processes() as workers:
        for _ in range(4):
            workers.append(
                spawn_worker(
                    pubsub_resources, ledger, *SLOT_JOBS, "--max-outstanding", "8",
                    "--concurrency", "demo-slots=3", store=store, extra_env=extra_env,
                )
            )  # fmt: skip
        assert wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        # When 100 jobs of 0.5 s that take a slot of the key are published
        pubsub_resources.publish_many("demo.slot_sleep", jobs)
        finished = wait_for(lambda: len(ledger_events(ledger, "done")) >= EXPORTS, timeout=180)
        assert finished, _stalled(ledger, workers)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    done = ledger_events(ledger, "done")
    runs = [(r["start"], r["end"]) for r in done]
    # The backlog lasts until the last job starts: from then on nothing waits for a slot
    backlog_until = max(start for start, _ in runs)
    peak, busy = overlap(runs, until=backlog_until)
    per_worker = Counter(r["pid"] for r in done)
    attempts = sorted(r["attempt"] for r in done)
    waits = sorted(_deferrals(workers).get(job_id, 0) for job_id, _ in jobs)
    print(
        f"{kind}: peak {peak} running, {busy / 3:.3f} of 3 slots busy while the backlog "
        f"lasted ({overlap(runs)[1] / 3:.3f} to the last end), per worker "
        f"{sorted(per_worker.values())}, delivery attempts median {attempts[EXPORTS // 2]} max "
        f"{attempts[-1]}, deferrals a job median {waits[EXPORTS // 2]} 90th "
        f"{waits[EXPORTS * 9 // 10]} max "
        f"{waits[-1]}; longest stretches below 3 (from the first start, length): "
        f"{_short_stretches(runs, 3, backlog_until)}"
    )
    # Then never more than 3 ran at once across the fleet (the jobs' own ledger), the 3 slots
    # were kept busy while the backlog lasted, every job ran once, none was dead-lettered
    assert peak == 3
    assert busy / 3 >= BUSY[kind]
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert len(per_worker) == 4
    assert pubsub_resources.dead_letters(expected=1, timeout=2) == []
    assert codes == [0, 0, 0, 0]


@pytest.mark.parametrize("mode", ["per_run", "bulk"])
def test_slots_of_a_killed_worker_free_within_their_ttl(
    mode: str, pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a key of limit 2 with a 6 s slot TTL (leased per run, or in bulk: then A holds a
    # share of 2), and worker A running 2 jobs of 15 s of it
    pubsub_resources.provision(retry_policy=False)  # deferrals keep their own delays
    ledger = tmp_path / "ledger.jsonl"
    flags: list[Any] = [
        *SLOT_JOBS, "--concurrency", f"demo-slots=2/{mode}", "--slot-ttl", "6",
        "--claim-ttl", "6", "--lease-extension", "10",
    ]  # fmt: skip
    jobs = {f"long-{i}" for i in range(2)} | {f"short-{i}" for i in range(4)}
    with worker_processes() as workers:
        a = _spawn(workers, pubsub_resources, ledger, [*flags, "--max-outstanding", "2"])
        pubsub_resources.publish_many(
            "demo.slot_sleep", [(f"long-{i}", {"seconds": 15}) for i in range(2)]
        )
        assert wait_for(lambda: len(ledger_events(ledger, "start", a.pid)) == 2, timeout=30)
        # ... and worker B waiting for the key with 4 short jobs
        b = _spawn(workers, pubsub_resources, ledger, [*flags, "--max-outstanding", "4"])
        pubsub_resources.publish_many(
            "demo.slot_sleep", [(f"short-{i}", {"seconds": 0.5}) for i in range(4)]
        )
        time.sleep(3)
        assert ledger_events(ledger, "start", b.pid) == []  # A holds both slots
        # When A is killed outright (no release of anything)
        a.process.kill()
        killed = time.time()
        a.wait(10)
        # Then B gets the slots once A's leases lapse, within the TTL, and nothing is lost:
        # every job ends done on B, A's two cut short included
        assert wait_for(lambda: len(ledger_events(ledger, "start", b.pid)) >= 1, timeout=20)
        freed_after = min(r["start"] for r in ledger_events(ledger, "start", b.pid)) - killed
        assert wait_for(lambda: _done_on(ledger, b) >= jobs, timeout=90)
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 0
    starts = ledger_events(ledger, "start")
    runs = [(r["start"], killed if r["pid"] == a.pid else _end(ledger, r)) for r in starts]
    peak, _ = overlap(runs)
    done = Counter(r["job_id"] for r in ledger_events(ledger, "done"))
    print(f"{mode}: slots free {freed_after:.2f}s after the kill; peak {peak} running")
    assert 0 < freed_after <= 6 + 1.5
    assert peak <= 2
    assert set(done.values()) == {1}  # nothing ran to its end twice


def test_one_tenants_flood_does_not_delay_the_others(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker with 8 slots, a limit of 1 per tenant, and a flood of 100 jobs of tenant A
    pubsub_resources.provision(retry_policy=False)  # deferrals keep their own delays
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        worker = _spawn(workers, pubsub_resources, ledger, [*SLOT_JOBS, "--max-outstanding", "8"])
        flood = [(f"a-{i}", {"seconds": 0.5, "tenant": "a"}) for i in range(100)]
        pubsub_resources.publish_many("demo.tenant_sleep", flood)
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 2, timeout=30)
        # When tenants B and C each publish a job behind the flood
        published = {}
        for tenant in ("b", "c"):
            pubsub_resources.publish(
                "demo.tenant_sleep", {"seconds": 0.5, "tenant": tenant}, job_id=f"{tenant}-0"
            )
            published[f"{tenant}-0"] = time.time()
        assert wait_for(lambda: published.keys() <= _done_on(ledger, worker), timeout=30)
        a_done = sum(1 for r in ledger_events(ledger, "done") if r["job_id"].startswith("a-"))
        worker.signal(signal.SIGTERM)
        assert worker.wait(40) == 0
    starts = {r["job_id"]: r["start"] for r in ledger_events(ledger, "start")}
    waited = {job_id: starts[job_id] - at for job_id, at in published.items()}
    print(f"B and C started {waited} s after publishing; A had {a_done} of 100 done")
    # Then B and C started within a second, while A's backlog still waited, and A never ran
    # more than one at a time
    assert all(0 < seconds <= 1.0 for seconds in waited.values())
    assert a_done < 90
    a_intervals = [
        (r["start"], r["end"])
        for r in ledger_events(ledger, "done")
        if r["job_id"].startswith("a-")
    ]
    assert overlap(a_intervals)[0] == 1


def test_deferrals_do_not_use_up_a_jobs_attempts(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a job with max_attempts = 3 that is deferred on its first 10 deliveries (Defer,
    # the outcome a full key gives too), then fails on the next 2
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    with worker_processes() as workers:
        worker = _spawn(workers, pubsub_resources, ledger, [*SLOT_JOBS])
        pubsub_resources.publish(
            "demo.flaky_slot_sleep",
            {"seconds": 0.1, "defer_until": 10, "fail": "retryable", "fail_until": 13},
            job_id="flaky",
        )
        # When it runs, Then it is retried after each failure and done on its third try, at
        # delivery 13, never dead-lettered
        assert wait_for(lambda: "flaky" in _done_on(ledger, worker), timeout=60)
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    runs = read_ledger(ledger)
    failed = [r["attempt"] for r in runs if r["outcome"] == "retryable"]
    done = [r["attempt"] for r in runs if r["outcome"] == "done"]
    print(f"failed on deliveries {failed}, done on delivery {done}")
    assert (failed, done) == ([11, 12], [13])
    assert pubsub_resources.dead_letters(expected=1, timeout=2) == []


def test_a_pool_with_a_key_pulls_only_for_slots_it_holds(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given two worker processes whose pool declares key k (limit 2) for all its jobs, with
    # 8 slots and a prefetch of 2 each
    pubsub_resources.provision(retry_policy=False)
    ledger = tmp_path / "ledger.jsonl"
    config = tmp_path / "workerpool.toml"
    config.write_text(
        f'[concurrency]\nk = 2\n\n[[pools]]\nsubscription = "{pubsub_resources.subscription}"'
        '\nconcurrency = "k"\nmax_outstanding = 8\nprefetch = 2\n'
    )
    ports = [free_port(), free_port()]
    jobs = [(f"job-{i}", {"seconds": 0.3}) for i in range(40)]
    held: list[int] = []
    with worker_processes() as workers:
        for port in ports:
            workers.append(
                spawn_worker(
                    pubsub_resources, ledger, "--config", str(config), "--metrics-port",
                    str(port), store=f"sqlite:///{tmp_path / 'fleet.db'}",
                )
            )  # fmt: skip
        assert wait_for(lambda: all(w.ready() for w in workers), timeout=60)
        # When 40 jobs of 0.3 s are published (and each process's held messages are sampled)
        pubsub_resources.publish_many("demo.sleep", jobs)
        deadline = time.monotonic() + 120
        while len(ledger_events(ledger, "done")) < 40 and time.monotonic() < deadline:
            held.extend(held_messages(port, pubsub_resources.subscription) for port in ports)
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
    done = ledger_events(ledger, "done")
    peak, busy = overlap([(r["start"], r["end"]) for r in done])
    attempts = sorted(r["attempt"] for r in done)
    print(
        f"peak {peak} running, {busy / 2:.3f} of 2 slots busy, most held by one process "
        f"{max(held)} ({len(held)} samples), delivery attempts median {attempts[20]} max "
        f"{attempts[-1]}, per worker {sorted(Counter(r['pid'] for r in done).values())}"
    )
    # Then the fleet ran at most 2 at once, no process held more than 2 + prefetch messages
    # of the pool, the jobs ran on their first delivery (median), each once, none
    # dead-lettered
    assert peak == 2
    assert 1 <= max(held) <= 2 + 2
    assert attempts[20] == 1
    assert sorted(r["job_id"] for r in done) == sorted(job_id for job_id, _ in jobs)
    assert pubsub_resources.dead_letters(expected=1, timeout=2) == []
    assert codes == [0, 0]


def _done_on(ledger: Path, worker: WorkerProcess) -> set[str]:
    return {r["job_id"] for r in ledger_events(ledger, "done", worker.pid)}


def _spawn(
    workers: list[WorkerProcess], env: PubSubResources, ledger: Path, flags: list[Any]
) -> WorkerProcess:
    worker = spawn_worker(env, ledger, *flags, store=f"sqlite:///{ledger.parent / 'fleet.db'}")
    workers.append(worker)
    assert wait_for(worker.ready, timeout=30)
    return worker


def _end(ledger: Path, start: dict[str, Any]) -> float:
    """When the run that logged ``start`` ended (now, if it still runs)."""
    for entry in ledger_events(ledger, "done") + ledger_events(ledger, "cancelled"):
        if (entry["message_id"], entry["start"]) == (start["message_id"], start["start"]):
            return float(entry["end"])
    return time.time()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_slot_for_part_of_a_run_bounds_only_that_part(
    kind: str, pubsub_resources: PubSubResources
) -> None:
    # Given a job that takes a slot of "calls" (limit 1) for part of its run only
    jobs, lock = Registry(), threading.Lock()
    counts = {"running": 0, "inside": 0, "peak_running": 0, "peak_inside": 0}
    tokens: list[int] = []

    def enter(name: str) -> None:
        with lock:
            counts[name] += 1
            counts[f"peak_{name}"] = max(counts[f"peak_{name}"], counts[name])

    def leave(name: str) -> None:
        with lock:
            counts[name] -= 1

    if kind == "sync":

        @jobs.job("t.partial")
        def partial(ctx: JobContext, payload: dict[str, Any]) -> None:
            enter("running")
            time.sleep(0.2)
            with ctx.slot("calls") as lease:
                enter("inside")
                tokens.append(lease.token)
                time.sleep(0.05)
                leave("inside")
            leave("running")

    else:

        @jobs.job("t.partial")
        async def partial_async(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
            enter("running")
            await asyncio.sleep(0.2)
            async with ctx.slot("calls") as lease:
                enter("inside")
                tokens.append(lease.token)
                await asyncio.sleep(0.05)
                leave("inside")
            leave("running")

    # When 12 of them run on 4 slots
    with pubsub_resources.worker(jobs, max_outstanding=4, concurrency={"calls": 1}) as worker:
        pubsub_resources.publish_many("t.partial", [(f"p-{i}", {}) for i in range(12)])
        stats = wait_settled(worker, 12, timeout=60)
    # Then the part inside the slot ran one at a time, each under a token of its own, while
    # the rest of the runs overlapped
    print(f"{kind}: {counts}, tokens {tokens}")
    assert stats == {"done": 12}
    assert counts["peak_inside"] == 1 and counts["peak_running"] >= 2
    assert sorted(tokens) == list(range(1, 13))
