"""The autoscaler, live on the Pub/Sub emulator with the process actuator: a real
``workerpool autoscale`` process starting and draining real ``workerpool run`` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.support import ledger_events, read_ledger, wait_for
from workerpool.testing.pubsub import PubSubResources

MAX, SLOTS, JOBS, SECONDS, WINDOW = 4, 4, 200, 1.0, 10.0


def _children(pid: int) -> set[int]:
    """The pids of ``pid``'s live child processes (zombies left out)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(parent) == pid and state != "Z":
            found.add(int(entry))
    return found


def test_the_fleet_wakes_from_zero_grows_to_its_max_drains_and_returns_to_zero(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an autoscaler (process actuator, 0..4 replicas of 4 slots, a 10 s window) and no
    # worker
    pubsub_resources.provision(retry_policy=False)
    ledger, log = tmp_path / "ledger.jsonl", tmp_path / "autoscale.log"
    env = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": pubsub_resources.host,
        "WORKERPOOL_DEMO_LEDGER": str(ledger),
        "WORKERPOOL_DEMO_LEDGER_STARTS": "1",
    }
    command = [
        sys.executable, "-m", "workerpool", "autoscale",
        "--project", pubsub_resources.project, "--subscription", pubsub_resources.subscription,
        "--idempotency-store", f"sqlite:///{tmp_path / 'fleet.db'}",
        "--max", str(MAX), "--scale-down-delay", str(WINDOW), "--interval", "0.5",
        "--", "--jobs", "workerpool_jobs.demo", "--max-outstanding", str(SLOTS),
        "--heartbeat-interval", "0.5", "--min-backoff", "1",
    ]  # fmt: skip
    with open(log, "wb") as out:
        scaler = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    fleet: list[tuple[float, int]] = []  # (time, replicas)

    def sample_until(done: object, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fleet.append((time.time(), len(_children(scaler.pid))))
            if callable(done) and done():
                return True
            time.sleep(0.2)
        return False

    try:
        # When the subscription stays idle for 60 s
        assert wait_for(lambda: "autoscaling" in log.read_text(), timeout=30)
        idle_from = time.time()
        sample_until(None, 60)
        idle = [n for at, n in fleet if at >= idle_from]
        idle_log = log.read_text()
        # ... then 200 jobs of 1 s are published
        published = time.time()
        pubsub_resources.publish_many(
            "demo.sleep", [(f"job-{i}", {"seconds": SECONDS}) for i in range(JOBS)]
        )
        finished = sample_until(lambda: len(ledger_events(ledger, "done")) >= JOBS, 120)
        last_end = time.time()
        # ... and left idle again
        back_to_zero = sample_until(lambda: not _children(scaler.pid), WINDOW + 30)
        zero_at = time.time()
        scaler.send_signal(signal.SIGTERM)
        code = scaler.wait(60)
    finally:
        if scaler.poll() is None:
            scaler.kill()
    output = log.read_text()
    starts = ledger_events(ledger, "start")
    ends = [r for r in read_ledger(ledger) if r["outcome"] != "start"]
    busy = [n for at, n in fleet if published <= at <= last_end]
    first_start = min(r["start"] for r in starts) - published
    print(
        f"\nidle {len(idle)} samples, most replicas {max(idle)}; first start "
        f"{first_start:.2f}s after the publish; most replicas {max(busy)}; all done "
        f"{last_end - published:.1f}s after the publish; back to 0 {zero_at - last_end:.1f}s "
        f"after the last end; decisions logged {output.count('autoscale: ')}"
    )
    # Then nothing ran while idle, the first job started within 5 s of the publish, the fleet
    # grew to its max and ran every job once, start to end (a scale-in interrupted none),
    # then went back to 0 after its window; the autoscaler exits 0
    assert max(idle) == 0 and "started" not in idle_log, idle_log
    assert finished, output[-3000:]
    assert first_start <= 5.0
    assert max(busy) == MAX
    assert Counter(r["job_id"] for r in starts) == Counter(f"job-{i}" for i in range(JOBS))
    assert Counter((r["job_id"], r["outcome"]) for r in ends) == Counter(
        (f"job-{i}", "done") for i in range(JOBS)
    )
    assert back_to_zero, output[-3000:]
    assert zero_at - last_end >= WINDOW
    assert code == 0, output[-3000:]
