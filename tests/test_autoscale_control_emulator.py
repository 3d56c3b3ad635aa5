"""The autoscaler under a bad deploy and its own crash, live on the Pub/Sub emulator: real
``workerpool autoscale`` processes (process actuator, SQLite store) starting real
``workerpool run`` processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import child_pids, http_get, ledger_events, read_ledger, spawn_worker, wait_for
from workerpool.heartbeats import SqliteHeartbeats
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

TTL = 5.0  # the autoscalers' lease TTL here (15 s by default)
WORKERS = ("--jobs", "workerpool_jobs.demo", "--max-outstanding", "2")  # their replicas


def _autoscaler(
    env: PubSubResources, tmp_path: Path, name: str, max_replicas: int, *worker_args: str,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], Path]:  # fmt: skip
    """A ``workerpool autoscale`` process on ``env``'s subscription and the test's SQLite store,
    its output in ``<name>.log``; its replicas write the ledger beside it."""
    log = tmp_path / f"{name}.log"
    environment = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": env.host,
        "WORKERPOOL_DEMO_LEDGER": str(tmp_path / "ledger.jsonl"),
        "WORKERPOOL_DEMO_LEDGER_STARTS": "1",
    }
    command = [
        sys.executable, "-m", "workerpool", "autoscale",
        "--project", env.project, "--subscription", env.subscription,
        "--idempotency-store", f"sqlite:///{tmp_path / 'fleet.db'}",
        "--max", str(max_replicas), "--interval", "0.5", "--lease-ttl", str(TTL), *extra,
        "--", *worker_args, "--heartbeat-interval", "0.5", "--min-backoff", "1",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=environment, stdout=out, stderr=subprocess.STDOUT)
    return process, log


@contextmanager
def _reaped(*processes: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _backlog(env: PubSubResources, jobs: int) -> None:
    """``jobs`` jobs of 0.5 s waiting on a subscription without a retry policy."""
    env.provision(retry_policy=False)
    env.publish_many("demo.sleep", [(f"job-{i}", {"seconds": 0.5}) for i in range(jobs)])


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _most_at_once(runs: list[dict[str, Any]]) -> int:
    """The most replicas (pids) that had a job running at one instant, from the ledger's runs."""
    most = 0
    for run in runs:
        at = run["start"]
        most = max(most, len({r["pid"] for r in runs if r["start"] <= at < r["end"]}))
    return most


def test_a_bad_deploy_crash_loops_with_backoff_and_dead_letters_nothing(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 50 jobs on a subscription that dead-letters after 5 delivery attempts
    pubsub_resources.provision(max_delivery_attempts=5)
    pubsub_resources.publish_many("demo.sleep", [(f"job-{i}", {}) for i in range(50)])
    port = free_port()
    # When an autoscaler runs, for 45 s, replicas of 25 slots that exit at start (a module
    # that is not there): each probe touches all 50 (2 replicas x 25 slots). Probing at every
    # round at zero, restarting at once, 60 s of the same dead-lettered all 50 in 47 starts
    scaler, log = _autoscaler(
        pubsub_resources, tmp_path, "bad", 2, "--jobs", "no_such_module",
        "--max-outstanding", "25", extra=("--metrics-port", str(port)),
    )  # fmt: skip
    with _reaped(scaler):
        assert wait_for(lambda: "autoscaling" in log.read_text(), timeout=30), log.read_text()
        time.sleep(45)
        _, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
        scaler.send_signal(signal.SIGTERM)
        assert scaler.wait(60) == 0, log.read_text()[-3000:]
    output = log.read_text()
    exits = re.findall(r"^workerpool_autoscale_exits_at_start_total\S* (\S+)$", metrics, re.M)
    started = sum(len(m.split(", ")) for m in re.findall(r"started \d+ \(pids ([^)]*)\)", output))
    delays = [
        float(d) for d in re.findall(r"crash loop: .*? in a row: restarting in (\S+) s", output)
    ]
    # ... then a good worker runs
    ledger = tmp_path / "ledger.jsonl"
    worker = spawn_worker(pubsub_resources, ledger, "--max-outstanding", "8")
    try:
        assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 50, timeout=60)
        dead = pubsub_resources.dead_letters(1, timeout=3)
    finally:
        worker.kill()
    runs = ledger_events(ledger, "done")
    print(
        f"\nreplicas started {started} in 45 s, exits at start {exits}, backoffs {delays}; "
        f"good worker ran {len(runs)}, delivery attempts "
        f"{dict(Counter(r['attempt'] for r in runs))}, dead-lettered {len(dead)}"
    )
    # Then the decision log shows the crash loop backing off (1, 2, 4, ... s), the metric
    # counts the exits, a handful of starts; every job runs once and none is dead-lettered:
    # one probe delivery at most each, then the good worker's
    assert delays[:4] == [1, 2, 4, 8], output[-3000:]
    assert exits and float(exits[0]) >= 6, output[-3000:]
    assert started <= 20, output[-3000:]
    assert Counter(r["job_id"] for r in ledger_events(ledger, "start")) == Counter(
        f"job-{i}" for i in range(50)
    )
    assert Counter(r["job_id"] for r in runs) == Counter(f"job-{i}" for i in range(50))
    assert {r["attempt"] for r in runs} == {2}
    assert dead == []


def test_a_killed_autoscalers_replicas_die_with_it_and_its_successor_keeps_the_max(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given an autoscaler running 4 replicas of 2 slots on a backlog of 0.5 s jobs
    _backlog(pubsub_resources, 240)
    first, first_log = _autoscaler(pubsub_resources, tmp_path, "first", 4, *WORKERS)
    beats = SqliteHeartbeats(tmp_path / "fleet.db")
    path = pubsub_resources.subscription_path
    serving: list[int] = []  # replicas beating and not draining, sampled

    def sample() -> None:
        serving.append(sum(not b.draining for b in beats.live(path, time.time())))

    with _reaped(first):
        assert wait_for(lambda: len(child_pids(first.pid)) == 4, timeout=60), first_log.read_text()
        assert wait_for(lambda: (sample() or serving[-1]) == 4, timeout=30)
        orphans = child_pids(first.pid)
        # When it is killed with SIGKILL, and a new autoscaler starts at once
        first.kill()
        killed = time.monotonic()
        second, second_log = _autoscaler(pubsub_resources, tmp_path, "second", 4, *WORKERS)
        with _reaped(second):
            gone = None
            while time.monotonic() - killed < 40:
                sample()
                if gone is None and not any(_alive(pid) for pid in orphans):
                    gone = time.monotonic() - killed
                time.sleep(0.2)
            took_over = re.search(r"leads", second_log.read_text()) is not None
            successors = child_pids(second.pid)
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0, second_log.read_text()[-3000:]
    beats.close()
    runs = ledger_events(tmp_path / "ledger.jsonl", "done")
    print(
        f"\nthe killed autoscaler's 4 replicas gone {gone}s after the kill; the successor "
        f"runs {len(successors)}; most serving beats {max(serving)}; most replicas running "
        f"jobs at once {_most_at_once(runs)} ({len(runs)} runs)"
    )
    # Then the killed autoscaler's replicas drained and exited (none left pulling), the new
    # one took over within its TTL and ran 4, and never more than 4 ran jobs at once
    assert gone is not None and gone < TTL + 10, second_log.read_text()[-3000:]
    assert took_over and len(successors) == 4, second_log.read_text()[-3000:]
    assert max(serving) <= 4
    assert _most_at_once(runs) <= 4
    assert {r["pid"] for r in runs} & successors


def test_two_autoscalers_of_one_subscription_one_leads_one_stands_by(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a backlog of 0.5 s jobs
    _backlog(pubsub_resources, 120)
    # When two autoscalers with --max 2 start together
    a, a_log = _autoscaler(pubsub_resources, tmp_path, "a", 2, *WORKERS)
    b, b_log = _autoscaler(pubsub_resources, tmp_path, "b", 2, *WORKERS)
    fleet: list[int] = []
    with _reaped(a, b):
        ledger = tmp_path / "ledger.jsonl"
        deadline = time.monotonic() + 60
        while len(ledger_events(ledger, "done")) < 120 and time.monotonic() < deadline:
            fleet.append(len(child_pids(a.pid)) + len(child_pids(b.pid)))
            time.sleep(0.2)
        for process in (a, b):
            process.send_signal(signal.SIGTERM)
        codes = [a.wait(60), b.wait(60)]
    logs = a_log.read_text() + b_log.read_text()
    runs = [r for r in read_ledger(ledger) if r["outcome"] == "done"]
    print(
        f"\nmost replicas of both {max(fleet)}; most running jobs at once "
        f"{_most_at_once(runs)}; {len(runs)} runs; stand-by lines {logs.count('standing by')}"
    )
    # Then one leads, the other says it stands by, and never more than 2 replicas run
    assert logs.count("standing by: autoscaler") == 1, logs[-3000:]
    assert max(fleet) <= 2 and _most_at_once(runs) <= 2
    assert len(runs) == 120 and codes == [0, 0]
