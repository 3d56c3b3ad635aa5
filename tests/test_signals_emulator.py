"""SIGTERM and SIGINT while ``workerpool run`` starts (importing, connecting, starting its
pools): real worker processes on the emulator exit 0, never by the signal, and no message
they held is acked without running."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.faults import FaultProxy
from tests.support import (
    WorkerProcess,
    catches_signal,
    ledger_events,
    runs_workerpool,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.testing.pubsub import PubSubResources

# (signal, what the delay counts from, seconds). "python": the interpreter is up (it has
# installed its own SIGINT handler), the moment before which no Python code can act, with or
# without workerpool's; "held": the package has taken SIGTERM over, its first line;
# "connecting": its first call to Pub/Sub is held up (by a stalled proxy, let go 0.5 s after
# the signal); "pulling": its pool has started.
CASES = [
    (signal.SIGTERM, "held", 0.0),
    (signal.SIGTERM, "held", 0.05),
    (signal.SIGTERM, "python", 0.2),
    (signal.SIGTERM, "python", 0.5),
    (signal.SIGTERM, "python", 1.0),
    (signal.SIGTERM, "python", 2.0),
    (signal.SIGTERM, "python", 4.0),
    (signal.SIGINT, "held", 0.05),
    (signal.SIGINT, "python", 0.5),
    (signal.SIGINT, "python", 2.0),
    (signal.SIGTERM, "connecting", 0.0),
    (signal.SIGINT, "connecting", 0.0),
    (signal.SIGTERM, "pulling", 0.0),
]
JOBS = 30


def _anchor(worker: WorkerProcess, proxy: FaultProxy, anchor: str) -> Callable[[], bool]:
    """Whether ``worker`` has reached ``anchor`` (see CASES)."""
    if anchor == "connecting":
        return lambda: proxy.stats.accepted > 0
    if anchor == "pulling":
        return worker.ready
    watched = signal.SIGINT if anchor == "python" else signal.SIGTERM
    return lambda: runs_workerpool(worker.pid) and catches_signal(worker.pid, watched)


def test_a_signal_at_any_point_of_start_exits_0_and_loses_no_message(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 30 jobs waiting on the subscription
    pubsub_resources.provision(retry_policy=False, ack_deadline=10)
    ids = {f"j-{i}" for i in range(JOBS)}
    pubsub_resources.publish_many("demo.sleep", [(job_id, {"seconds": 0}) for job_id in ids])
    ledger = tmp_path / "ledger.jsonl"
    ended = []
    with worker_processes() as workers:
        # When workers start one after another, each signalled at another point of its start
        for signum, anchor, delay in CASES:
            with FaultProxy(pubsub_resources.host) as proxy:
                if anchor == "connecting":
                    proxy.stall()
                worker = spawn_worker(
                    pubsub_resources, ledger,
                    extra_env={"PUBSUB_EMULATOR_HOST": proxy.address},
                )  # fmt: skip
                workers.append(worker)
                assert wait_for(_anchor(worker, proxy, anchor), 60, interval=0.001)
                time.sleep(delay)
                sent = time.time() - worker.launched
                worker.signal(signum)
                if anchor == "connecting":
                    time.sleep(0.5)
                    proxy.forward()
                code = worker.wait(60)
            started = worker.ready()
            ended.append((signum.name, anchor, delay, round(sent, 3), started, code))
        print("signal, from, delay, sent after spawn (s), pool started, exit code")
        for row in ended:
            print(*row)
        # Then each exits 0: never killed by the signal, no traceback
        assert [row[-1] for row in ended] == [0] * len(CASES), [w.output() for w in workers]
        # And a last worker runs every job: none that a signalled worker held was acked unrun
        workers.append(spawn_worker(pubsub_resources, ledger))
        assert wait_for(lambda: {r["job_id"] for r in ledger_events(ledger, "done")} >= ids, 120)
