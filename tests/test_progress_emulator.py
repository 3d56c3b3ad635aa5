"""``workerpool status --running`` on a real worker process: a running job's progress is shown
within 2 s of its report, with its job, job id, replica and start, and is gone once it ends."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.progress import SqliteJobState
from workerpool.testing.pubsub import PubSubResources

STEPS = 30
STEP_SECONDS = 0.4
SHOWN_WITHIN = 2.0


def _status(store: str) -> tuple[float, float, list[str]]:
    """When a ``workerpool status --running`` started and returned, and the rows it printed."""
    started = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "workerpool", "status", "--running", "--idempotency-store", store],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return started, time.time(), out.splitlines()[1:-1]


def _watch(path: Path, seen: dict[int, float], stop: threading.Event) -> None:
    """Read the store every 50 ms: when each progress was first there."""
    store = SqliteJobState(path)
    try:
        while not stop.wait(0.05):
            read = time.time()
            for report in store.running(read):
                seen.setdefault(int(report.done or 0), read)
    finally:
        store.close()


def test_status_running_shows_a_job_s_progress_within_2_s_of_its_report(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker running a job that reports its progress after each of its 30 steps
    pubsub_resources.provision(ack_deadline=10)
    ledger = tmp_path / "ledger.jsonl"
    store = f"sqlite:///{tmp_path / 'claims.db'}"
    seen: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(tmp_path / "claims.db", seen, stop))
    with worker_processes() as workers:
        worker = spawn_worker(pubsub_resources, ledger, store=store)
        workers.append(worker)
        payload = {"steps": STEPS, "step_seconds": STEP_SECONDS}
        pubsub_resources.publish("demo.steps", payload, job_id="report-1")
        assert wait_for(lambda: ledger_events(ledger, "resume"), timeout=60), worker.output()
        watcher.start()
        # When `workerpool status --running` is asked again and again until the job ends
        polls: list[tuple[float, float, list[str]]] = []
        try:
            while not ledger_events(ledger, "done"):
                polls.append(_status(store))
        finally:
            stop.set()
            watcher.join()
        # Then each answer shows the job with the progress of its last report, unless that
        # report is less than 2 s older than the question
        reported = {e["step"] + 1: e["end"] for e in ledger_events(ledger, "step")}
        [done] = ledger_events(ledger, "done")
        unshown_for = []
        for asked, answered, rows in polls:
            if not rows:  # not yet written, or it ended while the command started
                assert asked < reported[1] + SHOWN_WITHIN or done["end"] < answered, polls
                continue
            [row] = rows
            job, job_id, replica, _, _, progress, percent, *note = row.split()
            assert (job, job_id) == ("demo.steps", "report-1")
            assert f"-{worker.pid}-" in replica
            shown = int(progress.split("/")[0])
            assert progress == f"{shown}/{STEPS}" and percent == f"({100 * shown / STEPS:.0f}%)"
            assert note == ["step", str(shown)]
            unshown = [at for step, at in reported.items() if step > shown and at < asked]
            unshown_for.append(asked - min(unshown) if unshown else 0.0)
        assert len(unshown_for) >= 3, polls
        assert max(unshown_for) < SHOWN_WITHIN, unshown_for
        # (read every 50 ms, the store showed each report, or a later one, within 2 s; the
        # last ones may end with the run before they are written)
        lags = sorted(
            min(t for shown, t in seen.items() if shown >= step) - at
            for step, at in reported.items()
            if step <= max(seen)
        )
        assert len(lags) >= STEPS - 3 and lags[-1] < SHOWN_WITHIN, lags
        # and once the job has ended it is listed no more
        assert wait_for(lambda: _status(store)[2] == [], timeout=10)
    print(
        f"\n{len(unshown_for)} answers, a report unshown at a question for at most "
        f"{max(unshown_for):.2f} s; in the store after a report: median "
        f"{lags[len(lags) // 2]:.2f} s, max {lags[-1]:.2f} s ({len(lags)} reports)"
    )
