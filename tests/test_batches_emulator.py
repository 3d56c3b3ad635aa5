"""Fan-out batches with real worker processes on the Pub/Sub emulator, sharing an SQLite
store: one completion, exactly once, never early, and a deadline net."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.support import WorkerProcess, ledger_events, read_ledger, spawn_worker, wait_for
from tests.support import worker_processes as processes
from workerpool import JobMessage, publish_batch
from workerpool import constants as c
from workerpool.publishing import publish_many
from workerpool.testing.pubsub import PubSubResources

# Short leases and claims, so a killed worker's messages come back within seconds.
FAST_RECOVERY = ("--lease-extension", "10", "--claim-ttl", "6", "--max-outstanding", "8")


def _spawn(
    workers: list[WorkerProcess], env: PubSubResources, ledger: Path, store: str
) -> WorkerProcess:
    worker = spawn_worker(env, ledger, *FAST_RECOVERY, store=store)
    workers.append(worker)
    assert wait_for(worker.ready, timeout=60)
    return worker


def _completions(ledger: Path, batch_id: str) -> list[dict[str, Any]]:
    return [r for r in ledger_events(ledger, "done") if r["job_id"] == f"batch:{batch_id}:complete"]


def test_a_batch_completes_once_with_its_totals_through_kills_duplicates_and_failures(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given two workers sharing a store, and a batch of 300 children: 10 fail permanently, 5
    # fail twice then succeed, 20 are published twice
    pubsub_resources.provision(retry_policy=False, ack_deadline=10)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    children = []
    for i in range(300):
        payload: dict[str, Any] = {"seconds": 0.4}
        if i < 10:
            payload["fail"] = "permanent"
        elif i < 15:
            payload.update(fail="retryable", fail_until=3)
        children.append(JobMessage("demo.sleep", payload, f"child-{i}"))
    with processes() as workers:
        a = _spawn(workers, pubsub_resources, ledger, store)
        b = _spawn(workers, pubsub_resources, ledger, store)
        batch_id = publish_batch(
            pubsub_resources.topic_path, children, on_complete="demo.batch_done",
            store=store, publisher=pubsub_resources.publisher,
        )  # fmt: skip
        twice = [
            JobMessage(m.job, m.data, m.job_id, {c.ATTR_BATCH_ID: batch_id})
            for m in children[100:120]
        ]
        list(publish_many(pubsub_resources.publisher, pubsub_resources.topic_path, twice))
        # When one worker is killed outright twice mid-batch, and started again each time
        for done_by_then in (60, 150):
            assert wait_for(
                lambda n=done_by_then: len(ledger_events(ledger, "done")) >= n, timeout=90
            )
            a.process.kill()
            a.wait(10)
            a = _spawn(workers, pubsub_resources, ledger, store)
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=120)
        time.sleep(2)  # anything else that would run, runs now
        for worker in (a, b):
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in (a, b)]
    records = pubsub_resources.dead_letters(expected=10, timeout=10)
    runs = read_ledger(ledger)
    finals = [r["end"] for r in runs if r["job_id"].startswith("child-") and "end" in r]
    [completion] = _completions(ledger, batch_id)
    after_last = completion["start"] - max(finals)
    print(
        f"\ncompletion {completion['batch']}; started {after_last:.3f}s after the last "
        f"child's end; {len(records)} records"
    )
    # Then the completion ran once, with 290 succeeded and the 10 permanent failures, after
    # every child's final outcome and within a second of the last
    assert completion["batch"]["succeeded"] == 290 and completion["batch"]["failed"] == 10
    assert sorted(completion["batch"]["failed_job_ids"]) == sorted(f"child-{i}" for i in range(10))
    assert completion["batch"]["finalized_by"] == "last_child"
    assert 0 < after_last <= 1.0
    assert sorted(r.attributes[c.ATTR_JOB_ID] for r in records) == sorted(
        f"child-{i}" for i in range(10)
    )
    assert codes == [0, 0]


def test_children_that_finish_while_the_batch_is_published_do_not_complete_it(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker, and a publisher that holds back the last of 5 children until the
    # first 4 have run
    pubsub_resources.provision(retry_policy=False)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    children = [JobMessage("demo.sleep", {"seconds": 0.05}, f"c-{i}") for i in range(5)]
    real = pubsub_resources.publisher
    held_back: dict[str, float] = {}

    class SlowLast:
        def publish(self, topic: str, data: bytes, **attributes: str) -> Any:
            if attributes.get(c.ATTR_JOB_ID) == "c-4":
                assert wait_for(lambda: len(ledger_events(ledger, "done")) >= 4, timeout=30)
                time.sleep(1.0)  # a completion, if any came now, would have run by then
                held_back["published"] = time.time()
            return real.publish(topic, data, **attributes)

    with processes() as workers:
        worker = _spawn(workers, pubsub_resources, ledger, store)
        # When the batch is published
        result: dict[str, str] = {}
        publishing = threading.Thread(
            target=lambda: result.update(
                id=publish_batch(
                    pubsub_resources.topic_path, children, on_complete="demo.batch_done",
                    store=store, publisher=SlowLast(),
                )
            )
        )  # fmt: skip
        publishing.start()
        publishing.join(60)
        batch_id = result["id"]
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=30)
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    # Then no completion ran before the last child was published; one ran after
    [completion] = _completions(ledger, batch_id)
    assert completion["start"] > held_back["published"]
    assert completion["batch"]["succeeded"] == 5


def test_a_batch_whose_child_never_finishes_is_finalized_by_its_deadline_once(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a batch of 2 with a 6 s deadline: one child quick, one that runs 12 s
    pubsub_resources.provision(retry_policy=False)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    children = [
        JobMessage("demo.sleep", {"seconds": 0.1}, "quick"),
        JobMessage("demo.sleep", {"seconds": 12}, "slow"),
    ]
    with processes() as workers:
        worker = _spawn(workers, pubsub_resources, ledger, store)
        published = time.time()
        batch_id = publish_batch(
            pubsub_resources.topic_path, children, on_complete="demo.batch_done",
            deadline=timedelta(seconds=6), store=store, publisher=pubsub_resources.publisher,
        )  # fmt: skip
        deadline = published + 6
        # When the deadline passes, and later the slow child finishes
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=30)
        assert wait_for(lambda: "slow" in {r["job_id"] for r in ledger_events(ledger, "done")},
                        timeout=30)  # fmt: skip
        time.sleep(3)  # a second completion, if any, would have run by now
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    # Then its net finalized it within 2 s of the deadline, naming the pending child, and the
    # slow child's end fired no second completion
    [completion] = _completions(ledger, batch_id)
    late = completion["start"] - deadline
    print(f"\ndeadline completion {late:.3f}s after the deadline: {completion['batch']}")
    assert 0 <= late <= 2.0
    assert completion["batch"]["finalized_by"] == "deadline"
    assert completion["batch"]["pending_job_ids"] == ["slow"]
    assert completion["batch"]["succeeded"] == 1
