"""A key blocked at max_attempts (``ordered_exhausted="block"``), with a real worker process on
the emulator: the key stops, the CLI names it, and unblocking it lets its later jobs run in
order. The checks read the jobs' own ledger (workerpool_jobs.demo)."""

from __future__ import annotations

import time
from pathlib import Path

from click.testing import CliRunner

from tests.support import ledger_events, spawn_worker, wait_for, worker_processes
from workerpool.cli import main
from workerpool.publishing import JobMessage, publish_many
from workerpool.testing.pubsub import PubSubResources

_FAILING = "a-002"


def _done(ledger: Path) -> list[str]:
    return [r["job_id"] for r in sorted(ledger_events(ledger, "done"), key=lambda r: r["start"])]


def test_a_blocked_key_stops_is_named_and_goes_on_in_order_once_unblocked(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given keys a and b of 6 jobs each, where a's third job always fails, on a job that
    # blocks its key when its 2 attempts are spent
    env = pubsub_resources
    env.provision(ordered=True, retry_policy=False)
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
    ledger = tmp_path / "ledger.jsonl"
    store = ["--idempotency-store", f"sqlite:///{tmp_path / 'claims.db'}"]
    runner = CliRunner()
    with worker_processes() as workers:
        worker = spawn_worker(env, ledger, "--jobs", "workerpool_jobs.demo_ordering")
        workers.append(worker)
        # When the failing job exhausts its attempts
        records = env.dead_letters(expected=1, timeout=60)
        assert [r.attributes["job_id"] for r in records] == [_FAILING], worker.output()[-3000:]
        assert wait_for(lambda: len(_done(ledger)) >= 8, timeout=60), _done(ledger)
        # Then key a stops: its later jobs come back and are given back unrun, for as long
        # as several rechecks take, while key b ran to its end
        time.sleep(12)
        done = _done(ledger)
        assert sorted(done) == ["a-000", "a-001"] + [f"b-{n:03d}" for n in range(6)], done
        # And the CLI names the blocked key and the job that blocked it
        listed = runner.invoke(main, ["ordering", "blocked", *store])
        assert listed.exit_code == 0, listed.output
        assert f"blocked ordering key key-a: job demo.blocking_sleep ({_FAILING})" in listed.output
        # When the operator unblocks it
        unblocked_at = time.time()
        result = runner.invoke(main, ["ordering", "unblock", "key-a", *store])
        assert result.exit_code == 0, result.output
        # Then the key's later jobs run, in publish order, after the unblock
        assert wait_for(lambda: len(_done(ledger)) >= 11, timeout=60), _done(ledger)
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
