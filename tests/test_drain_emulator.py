"""Draining real worker processes on SIGTERM: finish what runs, give back the rest at once."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from google.api_core import exceptions as gexc

from tests.support import WorkerProcess, ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources

# A drained worker must also flush its acks and close its clients before it exits.
EXIT_MARGIN = 3.0
# --lease-extension where a test needs a lapsed lease to come back soon (10 s is the minimum).
LEASE = 10.0
# The same sleep job as a plain def and as an async def: both must drain alike.
SLEEP_JOBS = pytest.mark.parametrize("sleep_job", ["demo.sleep", "demo.async_sleep"])


def _exit_after(worker: WorkerProcess, sent: float, timeout: float) -> tuple[int, float]:
    """Wait for ``worker`` to exit; its exit code and the seconds since ``sent``."""
    code = worker.wait(timeout)
    return code, time.monotonic() - sent


def _pull_job_ids(
    pubsub_resources: PubSubResources, expected: int, timeout: float
) -> tuple[set[str], float]:
    """Pull (without acking) until ``expected`` distinct job ids came; return them and when."""
    started = time.monotonic()
    seen: set[str] = set()
    while len(seen) < expected and time.monotonic() - started < timeout:
        try:
            response = pubsub_resources.subscriber.pull(
                request={"subscription": pubsub_resources.subscription_path, "max_messages": 10},
                timeout=3,
            )
        except gexc.DeadlineExceeded:  # an idle pull
            continue
        seen.update(m.message.attributes["job_id"] for m in response.received_messages)
    return seen, time.monotonic() - started


@SLEEP_JOBS
def test_sigterm_finishes_running_jobs_and_hands_the_rest_over_at_once(
    pubsub_resources: PubSubResources, tmp_path: Path, sleep_job: str
) -> None:
    # Given 40 three-second jobs, an ack deadline of 60 s, and one worker running 4 at a time.
    # Its leases are 10 s, so a lost ack or release would come back within this test; and the
    # second worker gets its own idempotency store, so such a message would visibly run again.
    pubsub_resources.provision(ack_deadline=60)
    ledger = tmp_path / "ledger.jsonl"
    job_ids = [f"job-{i}" for i in range(40)]
    with worker_processes() as workers:
        first = spawn_worker(
            pubsub_resources,
            ledger,
            "--max-outstanding",
            "4",
            "--drain-timeout",
            "10",
            "--lease-extension",
            str(LEASE),
        )
        workers.append(first)
        pubsub_resources.publish_many(sleep_job, [(job_id, {"seconds": 3}) for job_id in job_ids])
        assert wait_for(lambda: ledger_events(ledger, "start"), timeout=30), first.output()
        first_start = min(r["start"] for r in ledger_events(ledger, "start"))

        # When it gets SIGTERM one second after its first job started, and a second worker
        # (with 40 slots) is started at that moment
        time.sleep(max(0.0, first_start + 1.0 - time.time()))
        signalled_at = time.time()
        sent = first.signal(signal.SIGTERM)
        second = spawn_worker(
            pubsub_resources,
            ledger,
            "--max-outstanding",
            "40",
            "--drain-timeout",
            "10",
            store=f"sqlite:///{tmp_path / 'second-claims.db'}",
        )
        workers.append(second)
        code, exit_after = _exit_after(first, sent, timeout=30)
        exited_at = time.time()
        print(f"\nfirst worker exited {exit_after:.2f}s after SIGTERM (code {code})")

        # Then it exits 0 within about one job length, having finished its 4 running jobs
        assert code == 0, first.output()
        assert exit_after < 3.0 + EXIT_MARGIN, first.output()
        started_by_first = {r["job_id"] for r in ledger_events(ledger, "start", first.pid)}
        done_by_first = {r["job_id"] for r in ledger_events(ledger, "done", first.pid)}
        assert len(started_by_first) == 4, started_by_first
        assert done_by_first == started_by_first
        assert not ledger_events(ledger, "cancelled")
        # and its last line says how many it released: the 2 it held beyond its 4 slots
        [drained] = [line for line in first.output().splitlines() if "drained in" in line]
        assert ": 2 released, 4 finished, 0 interrupted" in drained, drained

        # When the second worker runs the rest, and keeps pulling until a lost ack or release
        # of the first worker would have come back
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 40, timeout=90)
        time.sleep(max(0.0, exited_at + LEASE + 2.0 - time.time()))
        sent = second.signal(signal.SIGTERM)
        second_code, second_exit = _exit_after(second, sent, timeout=30)
        print(f"second worker exited {second_exit:.2f}s after SIGTERM (code {second_code})")

    second_starts = ledger_events(ledger, "start", second.pid)
    first_job_after = min(r["start"] for r in second_starts) - second.launched
    # The messages the first worker held but had not started were delivered to it before.
    released = [r for r in second_starts if r["attempt"] > 1]
    released_after = max((r["start"] for r in released), default=signalled_at) - signalled_at
    print(
        f"second worker started its first job {first_job_after:.2f}s after it was launched; "
        f"the {len(released)} messages the first worker gave back started "
        f"{released_after:.2f}s after the SIGTERM (leases {LEASE:g}s, ack deadline 60s)"
    )
    # Then every job ran to completion exactly once: the first worker's 4 were acked, so they
    # never ran again
    starts = Counter(r["job_id"] for r in ledger_events(ledger, "start"))
    done = Counter(r["job_id"] for r in ledger_events(ledger, "done"))
    assert not started_by_first & {r["job_id"] for r in second_starts}, "acked jobs ran again"
    assert sorted(done) == sorted(job_ids)
    assert set(done.values()) == {1}, {k: v for k, v in done.items() if v > 1}
    assert set(starts.values()) == {1}, {k: v for k, v in starts.items() if v > 1}
    # And the second worker got the remaining jobs at once, not after the 60 s ack deadline,
    assert first_job_after < 20.0
    # including the 2 the first worker held unstarted: released, not left to their 10 s lease
    assert len(released) == 2, released
    assert released_after < LEASE - LEASE / 3
    assert second_code == 0, second.output()


LONG_JOBS = ("long-0", "long-1")


def _running_two_long_jobs(
    pubsub_resources: PubSubResources,
    ledger: Path,
    workers: list[WorkerProcess],
    *,
    drain_timeout: float,
    sleep_job: str = "demo.sleep",
) -> WorkerProcess:
    """A worker (ack deadline 60 s) that has started two 60-second jobs."""
    pubsub_resources.provision(ack_deadline=60)
    worker = spawn_worker(
        pubsub_resources, ledger, "--max-outstanding", "2", "--drain-timeout", str(drain_timeout)
    )
    workers.append(worker)
    pubsub_resources.publish_many(sleep_job, [(job_id, {"seconds": 60}) for job_id in LONG_JOBS])
    assert wait_for(lambda: len(ledger_events(ledger, "start")) == 2, timeout=30)
    return worker


@SLEEP_JOBS
def test_drain_deadline_cancels_running_jobs_and_gives_them_back_at_once(
    pubsub_resources: PubSubResources, tmp_path: Path, sleep_job: str
) -> None:
    # Given two 60-second jobs running on a worker with a 3 s drain timeout (ack deadline 60 s),
    # and a second, idle worker on the same subscription
    ledger = tmp_path / "ledger.jsonl"
    job_ids = set(LONG_JOBS)
    with worker_processes() as workers:
        first = _running_two_long_jobs(
            pubsub_resources, ledger, workers, drain_timeout=3, sleep_job=sleep_job
        )
        second = spawn_worker(
            pubsub_resources, ledger, "--max-outstanding", "2", "--drain-timeout", "1"
        )
        workers.append(second)
        assert wait_for(second.ready, timeout=30), second.output()

        # When the first worker gets SIGTERM
        deadline_at = time.time() + 3.0
        sent = first.signal(signal.SIGTERM)
        code, exit_after = _exit_after(first, sent, timeout=30)
        print(f"\nfirst worker exited {exit_after:.2f}s after SIGTERM (code {code})")

        # Then it waits out the drain timeout, cancels both jobs and exits 0
        assert code == 0, first.output()
        assert 3.0 <= exit_after < 3.0 + EXIT_MARGIN, first.output()
        cancelled = ledger_events(ledger, "cancelled", first.pid)
        assert {r["job_id"] for r in cancelled} == job_ids, first.output()
        assert not ledger_events(ledger, "done")

        # And the second worker starts both promptly, long before a lease could lapse
        assert wait_for(lambda: len(ledger_events(ledger, "start", second.pid)) == 2, timeout=60)
        restarts = ledger_events(ledger, "start", second.pid)
        delay = max(r["start"] for r in restarts) - deadline_at
        print(
            f"second worker started the interrupted jobs {delay:.2f}s after the drain "
            "deadline (lease extension 30s, ack deadline 60s)"
        )
        assert {r["job_id"] for r in restarts} == job_ids
        assert delay < 15.0

        sent = second.signal(signal.SIGTERM)
        second_code, second_exit = _exit_after(second, sent, timeout=30)
        print(f"second worker exited {second_exit:.2f}s after SIGTERM (code {second_code})")
        assert second_code == 0, second.output()


def test_a_second_signal_skips_the_drain_wait(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given two 60-second jobs running on a worker with a 30 s drain timeout
    ledger = tmp_path / "ledger.jsonl"
    job_ids = set(LONG_JOBS)
    with worker_processes() as workers:
        worker = _running_two_long_jobs(pubsub_resources, ledger, workers, drain_timeout=30)

        # When it gets SIGTERM, and SIGTERM again one second later
        worker.signal(signal.SIGTERM)
        time.sleep(1.0)
        assert worker.alive(), worker.output()
        sent = worker.signal(signal.SIGTERM)
        code, exit_after = _exit_after(worker, sent, timeout=40)
        print(f"\nworker exited {exit_after:.2f}s after the second SIGTERM (code {code})")

    # Then it exits 0 within a few seconds, not after the 30 s drain timeout
    assert code == 0, worker.output()
    assert exit_after < EXIT_MARGIN + 3.0, worker.output()
    # And the cancelled jobs were given back: they are on the subscription again at once
    assert {r["job_id"] for r in ledger_events(ledger, "cancelled")} == job_ids
    back, after = _pull_job_ids(pubsub_resources, len(job_ids), timeout=20)
    print(f"both jobs were back on the subscription {after:.2f}s after the exit")
    assert back == job_ids
