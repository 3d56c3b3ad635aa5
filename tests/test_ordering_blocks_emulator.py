"""A key blocked at max_attempts (``ordered_exhausted="block"``), with a real worker process on
the emulator, on each shared store: the key stops, ``workerpool status`` and the gauge name it,
and unblocking it lets its later jobs run in order. The checks read the jobs' own ledger
(workerpool_jobs.demo)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import (
    ledger_events,
    metric,
    shared_store,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.cli import main
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

_FAILING = "a-002"
_GAUGE = 'workerpool_ordering_keys_blocked{job="demo.blocking_sleep"}'


def _done(ledger: Path) -> list[str]:
    return [r["job_id"] for r in sorted(ledger_events(ledger, "done"), key=lambda r: r["start"])]


def _publish(env: PubSubResources) -> None:
    """Keys a and b of 6 jobs each, where a's third job always fails."""
    messages = [
        JobMessage(
            "demo.blocking_sleep",
            {"seconds": 0.01, **({"fail": "retryable"} if f"{key}-{n:03d}" == _FAILING else {})},
            f"{key}-{n:03d}",
            ordering_key=f"key-{key}",
        )
        for n in range(6)
        for key in "ab"
    ]
    for _ in publish_many(env.publisher, env.topic_path, messages):
        pass


def _status(env: PubSubResources, store: str, store_env: dict[str, str]) -> str:
    """``workerpool status`` run as an operator runs it: a process of its own."""
    command = [sys.executable, "-m", "workerpool", "status", "--project", env.project,
               "--subscription", env.subscription, "--idempotency-store", store]  # fmt: skip
    environment = {**os.environ, "PUBSUB_EMULATOR_HOST": env.host, **store_env}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("kind", ["sqlite", "firestore"])
def test_a_blocked_key_stops_is_named_and_goes_on_in_order_once_unblocked(
    kind: str,
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given keys a and b of 6 jobs each, where a's third job always fails, on a job that
    # blocks its key when its 2 attempts are spent, and a worker on the shared store
    env = pubsub_resources
    env.provision(ordered=True, retry_policy=False)
    _publish(env)
    ledger = tmp_path / "ledger.jsonl"
    url, store_env = shared_store(kind, request, tmp_path)
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)  # the operator's commands below run in this process
    store = ["--idempotency-store", url]
    runner = CliRunner()
    port = free_port()
    with worker_processes() as workers:
        worker = spawn_worker(
            env, ledger, "--jobs", "workerpool_jobs.demo_ordering", "--metrics-port", str(port),
            store=url, extra_env=store_env,
        )  # fmt: skip
        workers.append(worker)
        # When the failing job exhausts its attempts
        records = env.dead_letters(expected=1, timeout=60)
        assert [r.attributes["job_id"] for r in records] == [_FAILING], worker.output()[-3000:]
        assert wait_for(lambda: len(_done(ledger)) >= 8, timeout=60), _done(ledger)
        # Then the gauge reads one key blocked by the job, and `workerpool status`, a process
        # of its own while the worker runs, names the key and the job that blocked it
        assert wait_for(lambda: metric(port, _GAUGE) == 1, timeout=10), metric(port, _GAUGE)
        named = f"blocked ordering key key-a: job demo.blocking_sleep ({_FAILING})"
        assert named in _status(env, url, store_env)
        # And key a stops: its later jobs come back and are given back unrun, for as long
        # as several rechecks take, while key b ran to its end
        time.sleep(12)
        done = _done(ledger)
        assert sorted(done) == ["a-000", "a-001"] + [f"b-{n:03d}" for n in range(6)], done
        listed = runner.invoke(main, ["ordering", "blocked", *store])
        assert listed.exit_code == 0 and named in listed.output, listed.output
        assert metric(port, _GAUGE) == 1
        # When the operator unblocks it
        unblocked_at = time.time()
        result = runner.invoke(main, ["ordering", "unblock", "key-a", *store])
        assert result.exit_code == 0, result.output
        # Then the key's later jobs run, in publish order, after the unblock, and the gauge
        # and the status say nothing is blocked
        assert wait_for(lambda: len(_done(ledger)) >= 11, timeout=60), _done(ledger)
        assert wait_for(lambda: metric(port, _GAUGE) == 0, timeout=10), metric(port, _GAUGE)
        assert "blocked ordering key" not in _status(env, url, store_env)
    later = [
        r for r in ledger_events(ledger, "done") if r["job_id"] > _FAILING and "a-" in r["job_id"]
    ]
    assert [r["job_id"] for r in sorted(later, key=lambda r: r["start"])] == [
        "a-003", "a-004", "a-005"
    ]  # fmt: skip
    assert min(r["start"] for r in later) >= unblocked_at
    # And unblocking a key that is not blocked is one clear line and exit 2
    again = runner.invoke(main, ["ordering", "unblock", "key-a", *store])
    assert again.exit_code == 2 and "not blocked" in again.output, again.output
