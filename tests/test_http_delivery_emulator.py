"""Rate limits are not concurrency limits: 50 slots against an upstream allowing 20 req/s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import WorkerProcess, spawn_worker, wait_for, worker_processes
from workerpool.testing.pubsub import PubSubResources


@dataclass
class Upstream:
    port: int

    def stats(self) -> tuple[list[float], int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as r:
            body = json.load(r)
        return body["ok"], body["refused"]


# partner = 20/s (burst 1), the upstream's own rate
DECLARED = 'limiters = {"127.0.0.1" = "partner"}\n[rate_limits]\npartner = "20/s:1"\n'


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.limited_upstream"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield Upstream(int(process.stdout.readline()))
    finally:
        process.kill()
        process.wait()


def _run_worker(
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    upstream: Upstream,
    config: str,
    during: Callable[[WorkerProcess], None] | None = None,
) -> tuple[int, int]:
    """300 deliveries through a real `workerpool run` process with 50 slots, in a process of
    its own as in production (this test process has run many others), ``during`` done to it
    once it is started; returns how many were dead-lettered and the worker's exit code."""
    pubsub_resources.provision(retry_policy=False)
    url = f"http://127.0.0.1:{upstream.port}/menus"
    pubsub_resources.publish_many(
        "http.delivery", [(f"menu-{i}", {"url": url}) for i in range(300)]
    )
    config_file = tmp_path / "workerpool.toml"
    config_file.write_text(
        "[worker]\nmax_outstanding = 50\nmax_backoff = 2\n"
        '[jobs."http.delivery"]\nallowed_hosts = ["127.0.0.1"]\nallow_loopback = true\n'
        "timeout = 5\n" + config
    )
    dead_lettered = 0
    with worker_processes() as workers:
        worker = spawn_worker(
            pubsub_resources,
            tmp_path / "ledger.jsonl",
            "--config",
            str(config_file),
            store="memory://",
        )
        workers.append(worker)
        if during is not None:
            during(worker)
        deadline = time.monotonic() + 120
        while len(upstream.stats()[0]) + dead_lettered < 300 and time.monotonic() < deadline:
            if not wait_for(lambda: len(upstream.stats()[0]) == 300, timeout=2, interval=0.5):
                dead_lettered += len(pubsub_resources.dead_letters(expected=1, timeout=1))
        worker.signal(signal.SIGTERM)
        code = worker.process.wait(30)
    assert len(upstream.stats()[0]) + dead_lettered == 300, worker.output()[-2000:]
    return dead_lettered, code


def test_fifty_slots_without_a_limiter_hit_the_upstream_limit(
    pubsub_resources: PubSubResources, upstream: Upstream, tmp_path: Path
) -> None:
    # Given 300 deliveries and 50 slots, no rate limit declared
    dead_lettered, code = _run_worker(pubsub_resources, tmp_path, upstream, "")
    # Then the upstream refused many requests; retried jobs got through or ran out of attempts
    _, refused = upstream.stats()
    print(f"no limiter: {refused} responses 429, {dead_lettered} out of attempts")
    assert refused > 100
    assert code == 0


@pytest.mark.alone
def test_declared_rate_gets_zero_429s_and_takes_rate_time(
    pubsub_resources: PubSubResources, upstream: Upstream, tmp_path: Path
) -> None:
    # Given the same 300 deliveries and 50 slots, with partner = 20/s (burst 1) declared
    dead_lettered, code = _run_worker(pubsub_resources, tmp_path, upstream, DECLARED)
    # Then no 429 at all, and the run takes 300 / 20 s within 10%
    ok, refused = upstream.stats()
    span = max(ok) - min(ok)
    print(f"20/s declared: {refused} responses 429, 300 requests in {span:.2f}s")
    assert refused == 0 and dead_lettered == 0 and code == 0
    assert abs(span - 299 / 20) <= 0.1 * 15


@pytest.mark.alone
def test_declared_rate_holds_when_the_worker_was_stopped_mid_run(
    pubsub_resources: PubSubResources, upstream: Upstream, tmp_path: Path
) -> None:
    # Given the 300 deliveries at the declared 20/s, and the worker stopped (SIGSTOP) for 2 s
    # once 60 requests went: 40 slots fall due while it cannot run, and its waiters wake
    # together after it
    def stop_for_two_seconds(worker: WorkerProcess) -> None:
        assert wait_for(lambda: len(upstream.stats()[0]) >= 60, timeout=60)
        worker.signal(signal.SIGSTOP)
        try:
            time.sleep(2)
        finally:
            worker.signal(signal.SIGCONT)

    dead_lettered, code = _run_worker(
        pubsub_resources, tmp_path, upstream, DECLARED, stop_for_two_seconds
    )
    # Then the overdue requests still leave one by one at the rate: no 429 at all
    ok, refused = upstream.stats()
    print(f"stopped 2 s: {refused} responses 429, 300 requests in {max(ok) - min(ok):.2f}s")
    assert refused == 0 and dead_lettered == 0 and code == 0
