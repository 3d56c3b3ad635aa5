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
    read_ledger,
    shared_store,
    spawn_worker,
    wait_for,
    worker_processes,
)
from workerpool.cli import main
from workerpool.ops.dlq import peek
from workerpool.ordering import blocked_now
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.emulator import free_port
from workerpool.testing.pubsub import PubSubResources

_FAILING = "a-002"
_GAUGE = 'workerpool_ordering_keys_blocked{job="demo.blocking_sleep"}'


def _done(ledger: Path) -> list[str]:
    return [r["job_id"] for r in sorted(ledger_events(ledger, "done"), key=lambda r: r["start"])]


def _publish(env: PubSubResources, failing: dict[str, str]) -> None:
    """Keys a and b of 6 jobs each, where a's third job fails as ``failing`` says."""
    messages = [
        JobMessage(
            "demo.blocking_sleep",
            {"seconds": 0.01, **(failing if f"{key}-{n:03d}" == _FAILING else {})},
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


@pytest.fixture(params=["sqlite", "firestore"])
def fleet_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, str]]:
    """The store the worker and the operator's commands share (``shared_store``); the
    commands run in this process, which reaches it too."""
    url, store_env = shared_store(request.param, request, tmp_path)
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    return url, store_env


def test_a_blocked_key_stops_is_named_and_goes_on_in_order_once_unblocked(
    pubsub_resources: PubSubResources, tmp_path: Path, fleet_store: tuple[str, dict[str, str]]
) -> None:
    # Given keys a and b of 6 jobs each, where a's third job always fails, on a job that
    # blocks its key when its 2 attempts are spent, and a worker on the shared store
    env = pubsub_resources
    env.provision(ordered=True, retry_policy=False)
    _publish(env, {"fail": "retryable"})
    ledger = tmp_path / "ledger.jsonl"
    url, store_env = fleet_store
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


def _a_runs(ledger: Path) -> list[tuple[str, str, float, float]]:
    """Key a's runs from its third on, by start: (job id, outcome, start, end)."""
    runs = [r for r in read_ledger(ledger) if r["job_id"] >= _FAILING and "a-" in r["job_id"]]
    runs = [r for r in runs if r["outcome"] in ("done", "retryable")]
    return [
        (r["job_id"], r["outcome"], r["start"], r["end"])
        for r in sorted(runs, key=lambda r: r["start"])
    ]


def test_replay_runs_the_job_that_blocked_a_key_first_then_lets_the_key_go_on(
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    fleet_store: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given key a blocked by its third job, which fails while a flag file exists
    env = pubsub_resources
    env.provision(ordered=True, retry_policy=False)
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", env.host)  # the operator's commands, below
    flag = tmp_path / "broken"
    flag.touch()
    _publish(env, {"fail": "retryable", "fail_while": str(flag)})
    ledger = tmp_path / "ledger.jsonl"
    url, store_env = fleet_store
    replay = ["ordering", "replay", "key-a", "--project", env.project,
              "--dead-letter-subscription", f"{env.dead_letter_topic}-sub",
              "--idempotency-store", url]  # fmt: skip
    runner = CliRunner()
    with worker_processes() as workers:
        worker = spawn_worker(
            env, ledger, "--jobs", "workerpool_jobs.demo_ordering", store=url, extra_env=store_env
        )
        workers.append(worker)
        assert wait_for(lambda: "key-a" in blocked_now(url), timeout=60), worker.output()[-3000:]
        assert wait_for(lambda: len(_done(ledger)) >= 8, timeout=60), _done(ledger)
        # (the key is blocked before the failure record is published: the record is out too)
        assert wait_for(lambda: _records_of(env, _FAILING) == 1, timeout=30)
        # When the operator replays it before its cause is fixed
        failed = runner.invoke(main, [*replay, "--wait", "4"])
        # Then the command gives up with one line, the key still blocked, nothing after it run
        assert failed.exit_code == 1 and "stays blocked" in failed.output, failed.output
        assert "key-a" in blocked_now(url)
        # When the replay's own attempts are spent (a new failure record), the cause is fixed
        # and the operator replays it again
        assert wait_for(lambda: _records_of(env, _FAILING) == 1, timeout=60)
        flag.unlink()
        replayed_at = time.time()
        result = runner.invoke(main, [*replay, "--wait", "60"])
        print(f"{result.output}(in {time.time() - replayed_at:.2f} s)")
        assert result.exit_code == 0, result.output
        assert result.output.splitlines()[-1] == (
            f"job demo.blocking_sleep ({_FAILING}) completed; ordering key key-a unblocked"
        )
        assert wait_for(lambda: len(_done(ledger)) >= 12, timeout=60), _done(ledger)
    # Then the blocked job ran first, once, to its end, then the key's later jobs, in order
    runs = [run for run in _a_runs(ledger) if run[2] >= replayed_at]
    assert [(job_id, outcome) for job_id, outcome, _, _ in runs] == [
        (_FAILING, "done"), ("a-003", "done"), ("a-004", "done"), ("a-005", "done")
    ], runs  # fmt: skip
    assert runs[1][2] >= runs[0][3]
    # And no failure record is left: the replayed one was acked once republished
    assert _records_of(env, _FAILING) == 0
    # And replaying a key that is not blocked is one clear line and exit 2
    again = runner.invoke(main, replay)
    assert again.exit_code == 2 and "not blocked" in again.output, again.output


def _records_of(env: PubSubResources, job_id: str) -> int:
    """The failure records of ``job_id`` on the dead-letter subscription, left there."""
    found = peek(
        env.subscriber, env.dead_letter_subscription_path, match=lambda r: r.job_id == job_id
    )
    return len(found)
