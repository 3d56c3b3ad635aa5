"""Fan-out batches with real worker processes on the Pub/Sub emulator, sharing an SQLite
store: one completion, exactly once, never early, and a deadline net; and a batch and delayed
jobs on a Firestore store (the emulator's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.faults.inject import ENV as FAULTS_ENV
from tests.support import (
    WorkerProcess,
    ledger_events,
    read_ledger,
    shared_store,
    spawn_worker,
    wait_for,
)
from tests.support import worker_processes as processes
from workerpool import JobContext, JobMessage, PermanentError, publish_batch
from workerpool import constants as c
from workerpool.batches import SqliteBatches
from workerpool.cli import main
from workerpool.ops.dlq import Replayer
from workerpool.publishing import publish_many
from workerpool.ratelimit import parse_rate
from workerpool.registry import Registry
from workerpool.schedule import not_before_text, parse_not_before
from workerpool.testing.pubsub import PubSubResources

# Short leases and claims, so a killed worker's messages come back within seconds.
FAST_RECOVERY = ("--lease-extension", "10", "--claim-ttl", "6", "--max-outstanding", "8")


def _spawn(
    workers: list[WorkerProcess],
    env: PubSubResources,
    ledger: Path,
    store: str,
    extra_env: dict[str, str] | None = None,
) -> WorkerProcess:
    worker = spawn_worker(env, ledger, *FAST_RECOVERY, store=store, extra_env=extra_env)
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

        def get_topic(self, **kwargs: Any) -> Any:  # (publish_batch checks the topic first)
            return real.get_topic(**kwargs)

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


def test_a_fleet_on_firestore_completes_a_batch_once_and_fires_delayed_jobs_on_time(
    pubsub_resources: PubSubResources,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given two workers sharing a Firestore store (claims, schedule, batches), 20 jobs due
    # over 6-16 s (once the batch below has run: its backlog would delay them), and a batch
    # of 60 children (5 fail permanently, 10 are published twice)
    pubsub_resources.provision(retry_policy=False, ack_deadline=10)
    ledger = tmp_path / "ledger.jsonl"
    store, extra_env = shared_store("firestore", request, tmp_path, warm=True)
    for name, value in extra_env.items():
        monkeypatch.setenv(name, value)  # the publisher's and `schedule list`'s store too
    children = [
        JobMessage(
            "demo.sleep", {"seconds": 0.2, **({"fail": "permanent"} if i < 5 else {})}, f"c-{i}"
        )
        for i in range(60)
    ]
    with processes() as workers:
        pair = [_spawn(workers, pubsub_resources, ledger, store, extra_env) for _ in range(2)]
        now = datetime.now(UTC)
        delayed = [
            JobMessage("demo.sleep", {"seconds": 0.05}, f"later-{i}",
                       not_before=not_before_text(timedelta(seconds=6 + i / 2), now))
            for i in range(20)
        ]  # fmt: skip
        far = JobMessage("demo.sleep", {}, "in-two-days", not_before=not_before_text(
            timedelta(days=2), now))  # fmt: skip
        topic = pubsub_resources.topic_path
        list(publish_many(pubsub_resources.publisher, topic, [*delayed, far]))
        # When the batch is published, then 10 of its children again
        batch_id = publish_batch(
            topic, children, on_complete="demo.batch_done", store=store,
            publisher=pubsub_resources.publisher,
        )  # fmt: skip
        twice = [
            JobMessage(m.job, m.data, m.job_id, {c.ATTR_BATCH_ID: batch_id})
            for m in children[20:30]
        ]
        list(publish_many(pubsub_resources.publisher, topic, twice))
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=30)
        later = {m.job_id for m in delayed}
        assert wait_for(
            lambda: later <= {r["job_id"] for r in ledger_events(ledger, "done")}, timeout=30
        )
        time.sleep(2)  # anything else that would run, runs now
        listed = CliRunner().invoke(main, ["schedule", "list", "--idempotency-store", store])
        for worker in pair:
            worker.signal(signal.SIGTERM)
        codes = [worker.wait(30) for worker in pair]
    done = ledger_events(ledger, "done")
    runs = read_ledger(ledger)
    finals = [r["end"] for r in runs if r["job_id"].startswith("c-") and "end" in r]
    [completion] = _completions(ledger, batch_id)
    after_last = completion["start"] - max(finals)
    due = {m.job_id: parse_not_before(m.not_before) for m in delayed}
    lateness = sorted(r["start"] - due[r["job_id"]] for r in done if r["job_id"] in due)
    print(
        f"\ncompletion {completion['batch']}; started {after_last:.3f}s after the last child's "
        f"end; delayed jobs late by {lateness[0]:.3f}-{lateness[-1]:.3f}s"
    )
    # Then the completion ran once, after every child's final outcome and within a second of
    # the last, with each child counted once
    assert completion["batch"]["succeeded"] == 55 and completion["batch"]["failed"] == 5
    assert sorted(completion["batch"]["failed_job_ids"]) == [f"c-{i}" for i in range(5)]
    assert completion["batch"]["finalized_by"] == "last_child"
    assert 0 < after_last <= 1.0
    # ... each delayed job ran once, none before its time nor a second after it
    assert Counter(r["job_id"] for r in done if r["job_id"] in due) == Counter(list(due))
    assert lateness[0] >= 0 and lateness[-1] <= 1.0
    # ... and what is still due waits in the Firestore schedule: the 2-day job and the
    # batch's deadline net
    assert listed.exit_code == 0, listed.output
    assert {line.split()[4] for line in listed.output.splitlines()[:-1]} == {
        "in-two-days", f"batch:{batch_id}:deadline",
    }  # fmt: skip
    assert codes == [0, 0]
    records = pubsub_resources.dead_letters(expected=5, timeout=10)
    assert sorted(r.attributes[c.ATTR_JOB_ID] for r in records) == [f"c-{i}" for i in range(5)]


def test_a_replayed_child_updates_its_open_batch_and_never_reopens_a_final_one(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given two batches on one worker: A (a child that fails the first time it runs, and one
    # that waits for a gate) and B (one child that fails the first time)
    pubsub_resources.provision()
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    jobs, ran, completions = Registry(), Counter[str](), []
    gate, lock = threading.Event(), threading.Lock()

    @jobs.job("t.once_broken")
    def once_broken(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            ran[ctx.job_id] += 1
            first = ran[ctx.job_id] == 1
        if first:
            raise PermanentError("a dependency is missing")

    @jobs.job("t.gated")
    def gated(ctx: JobContext, payload: dict[str, Any]) -> None:
        gate.wait(60)

    @jobs.job("t.batch_done")
    def batch_done(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            completions.append(payload)

    def publish(children: list[JobMessage]) -> str:
        return publish_batch(
            pubsub_resources.topic_path, children, on_complete="t.batch_done", store=store,
            publisher=pubsub_resources.publisher,
        )  # fmt: skip

    a = publish([JobMessage("t.once_broken", {}, "a-1"), JobMessage("t.gated", {}, "a-2")])
    b = publish([JobMessage("t.once_broken", {}, "b-1")])
    with pubsub_resources.worker(jobs, idempotency_store=store) as worker:
        # When both failing children are dead-lettered (B is then final, A waits on a-2)
        assert wait_for(lambda: len(completions) == 1, timeout=60)
        assert worker.processor.stats["dead_lettered"] == 2
        # ... and replayed from the dead-letter topic, and run again, successfully
        replayer = Replayer(
            pubsub_resources.subscriber, pubsub_resources.publisher,
            pubsub_resources.dead_letter_subscription_path,
        )  # fmt: skip
        replayed = sorted(r.record.job_id for r in replayer.replay() if r.status == "replayed")
        assert wait_for(lambda: ran["a-1"] == 2 and ran["b-1"] == 2, timeout=30)
        # ... and then A's last child ends
        gate.set()
        assert wait_for(lambda: len(completions) == 2, timeout=30)
        time.sleep(2)  # a second completion of B, if the replay reopened it, would be here
    batches = SqliteBatches(tmp_path / "fleet.db")
    final_b, final_a = batches.get(b), batches.get(a)
    batches.close()
    by_batch = {p["batch_id"]: p for p in completions}
    # Then A, open when its child was replayed, counts it done; B, final before, was not
    # reopened: one completion each, B's still saying what it said
    assert replayed == ["a-1", "b-1"]
    assert len(completions) == 2 and sorted(by_batch) == sorted([a, b])
    assert (by_batch[a]["succeeded"], by_batch[a]["failed"]) == (2, 0)
    assert (by_batch[b]["succeeded"], by_batch[b]["failed"]) == (0, 1)
    assert by_batch[b]["failed_job_ids"] == ["b-1"]
    assert final_a is not None and (final_a.done, final_a.failed) == (2, 0)
    assert final_b is not None and (final_b.done, final_b.failed) == (0, 1)


def test_a_batch_of_children_under_a_slot_limit_and_a_rate_completes_once_across_a_drain(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given 30 children that each hold a slot of a key of limit 2 and a token of 5/s, and a
    # worker of 6 slots that is drained after 10 of them (another takes over)
    pubsub_resources.provision(retry_policy=False)
    store = f"sqlite:///{tmp_path / 'fleet.db'}"
    jobs, starts, running, peak, completions = Registry(), [], [0], [0], []
    lock = threading.Lock()

    @jobs.job("t.limited", concurrency="partner", rate_limit="partner")
    def limited(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            starts.append(time.monotonic())
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        ctx.sleep(0.2)
        with lock:
            running[0] -= 1

    @jobs.job("t.batch_done")
    def batch_done(ctx: JobContext, payload: dict[str, Any]) -> None:
        with lock:
            completions.append(payload)

    batch_id = publish_batch(
        pubsub_resources.topic_path, [JobMessage("t.limited", {}, f"c-{i}") for i in range(30)],
        on_complete="t.batch_done", store=store, publisher=pubsub_resources.publisher,
    )  # fmt: skip
    limits = {
        "idempotency_store": store, "max_outstanding": 6, "concurrency": {"partner": 2},
        "rate_limits": {"partner": parse_rate("5/s:1")}, "drain_timeout": 5.0,
    }  # fmt: skip
    with pubsub_resources.worker(jobs, **limits):
        assert wait_for(lambda: len(starts) >= 10, timeout=60)
    drained_at = len(starts)
    with pubsub_resources.worker(jobs, **limits):
        assert wait_for(lambda: len(completions) == 1, timeout=60)
        time.sleep(1)  # a second completion would be here by now
    ordered = sorted(starts)
    most_in_a_second = max(sum(1 for t in ordered if s <= t < s + 1.0) for s in ordered)
    print(f"\npeak {peak[0]}, {len(starts)} runs, drained after {drained_at}, at most "
          f"{most_in_a_second} started in a second")  # fmt: skip
    # Then never more than 2 ran at once, never more started in a second than 5/s and its
    # burst of 1 allow, and the batch completed once with all 30, across the drain
    assert peak[0] <= 2
    assert most_in_a_second <= 6
    [completion] = completions
    assert completion["batch_id"] == batch_id
    assert (completion["succeeded"], completion["failed"]) == (30, 0)
    assert len(starts) >= 30


def _outcomes(worker: WorkerProcess, job_id: str) -> list[str]:
    """How ``worker`` settled the messages of ``job_id`` (done, duplicate, ...): its job log
    lines, in order (a last line not written whole yet is left out)."""
    text = worker.output()
    lines = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
    return [r["outcome"] for r in lines if r.get("job_id") == job_id and "outcome" in r]


def _publish_command(env: PubSubResources, store: str, jsonl: Path, deadline: str) -> list[str]:
    return [
        sys.executable, "-m", "workerpool", "publish",
        "--project", env.project, "--topic", env.topic, "--file", str(jsonl),
        "--on-complete", "demo.batch_done", "--batch-id", "daily-report",
        "--batch-deadline", deadline, "--idempotency-store", store,
    ]  # fmt: skip


def test_a_batch_id_used_again_for_other_children_is_refused_and_the_same_batch_runs_once(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker, and batch daily-report (mon-1..3, an 8 s deadline) published from the
    # command line twice (a publisher trying again)
    pubsub_resources.provision(retry_policy=False)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    files = {day: tmp_path / f"{day}.jsonl" for day in ("mon", "tue")}
    for day, path in files.items():
        lines = [{"job": "demo.sleep", "job_id": f"{day}-{i}", "data": {}} for i in (1, 2, 3)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cli_env = {**os.environ, "PUBSUB_EMULATOR_HOST": pubsub_resources.host}

    def publish(day: str) -> subprocess.CompletedProcess[str]:
        command = _publish_command(pubsub_resources, store, files[day], "8s")
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=cli_env)

    with processes() as workers:
        worker = _spawn(workers, pubsub_resources, ledger, store)
        published = time.time()
        first, again = publish("mon"), publish("mon")
        assert wait_for(lambda: _completions(ledger, "daily-report"), timeout=30)
        # When tue-1..3 are published under its id, and then mon-1..3 once more
        refused, replayed = publish("tue"), publish("mon")
        # ... and its deadline passes
        time.sleep(max(0.0, published + 8 + 3 - time.time()))
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    ran = [r["job_id"] for r in ledger_events(ledger, "done")]
    print(f"\nrefused: exit {refused.returncode}: {refused.stderr.strip()}")
    # Then the other children are refused in one line, exit 2, and none of them is published
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "workerpool: error: batch daily-report exists already (final) with other children, "
        "topic or on_complete: give this batch another id"
    ]
    assert not [job_id for job_id in ran if job_id.startswith("tue-")]
    # ... while the same batch, again, is accepted each time, and completes once
    assert [p.returncode for p in (first, again, replayed)] == [0, 0, 0], replayed.stderr
    [completion] = _completions(ledger, "daily-report")
    assert completion["batch"]["succeeded"] == 3
    assert completion["batch"]["finalized_by"] == "last_child"


def _batch_on_a_doomed_worker(
    workers: list[WorkerProcess], env: PubSubResources, tmp_path: Path, seconds: float
) -> tuple[WorkerProcess, str]:
    """A worker to be killed (SIGKILL) once a child's outcome has finalized a batch, before it
    has put the completion in the schedule (the file ``killed-at`` then says when, and which
    child), and a batch of 5 children of ``seconds`` each (60 s deadline) published to it."""
    env.provision(retry_policy=False, ack_deadline=10)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    faults = {FAULTS_ENV: json.dumps({"kill_before_handover": str(tmp_path / "killed-at")})}
    worker = spawn_worker(
        env, ledger, *FAST_RECOVERY, "--jobs", "tests.faults.inject", store=store, extra_env=faults
    )
    workers.append(worker)
    assert wait_for(worker.ready, timeout=60)
    children = [JobMessage("demo.sleep", {"seconds": seconds}, f"c-{i}") for i in range(5)]
    batch_id = publish_batch(
        env.topic_path, children, on_complete="demo.batch_done", deadline=timedelta(seconds=60),
        store=store, publisher=env.publisher,
    )  # fmt: skip
    return worker, batch_id


def test_a_completion_whose_worker_died_before_handing_it_over_goes_out_as_the_next_starts(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker that is killed once it has finalized a batch of 5 children (60 s
    # deadline), before it has put the completion in the schedule
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    batches = SqliteBatches(tmp_path / "fleet.db")
    with processes() as workers:
        doomed, batch_id = _batch_on_a_doomed_worker(workers, pubsub_resources, tmp_path, 0.1)
        assert doomed.wait(60) == -signal.SIGKILL
        killed = json.loads((tmp_path / "killed-at").read_text())
        finalized = batches.get(batch_id)
        # When another worker starts
        after = _spawn(workers, pubsub_resources, ledger, store)
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=60)
        # ... and the child that finalized the batch comes back to it (never acked)
        assert wait_for(lambda: _outcomes(after, killed["job_id"]), timeout=60)
        # ... and the completion is published a second time (two hand-overs at once)
        [first] = _completions(ledger, batch_id)
        complete_id = f"batch:{batch_id}:complete"
        again = JobMessage("demo.batch_done", first["batch"], complete_id)
        list(publish_many(pubsub_resources.publisher, pubsub_resources.topic_path, [again]))
        assert wait_for(lambda: len(_outcomes(after, complete_id)) == 2, timeout=30)
        time.sleep(2)  # a second completion, if any, would have run by now
        after.signal(signal.SIGTERM)
        assert after.wait(30) == 0
    handed_over = batches.get(batch_id)
    batches.close()
    [completion] = _completions(ledger, batch_id)
    published = completion["published"] - after.launched
    started, from_kill = completion["start"] - after.launched, completion["start"] - killed["at"]
    print(
        f"\ncompletion published {published:.2f}s and started {started:.2f}s after the next "
        f"worker was launched, {from_kill:.2f}s after the kill"
    )
    # Then the batch was final with its completion not handed over when the worker died, and
    # the next worker put it out within 10 s of its start; it ran once (published twice), all
    # 5 counted
    assert finalized is not None and finalized.finalized_by and not finalized.completion_sent
    assert published <= 10.0
    assert completion["batch"]["succeeded"] == 5
    assert _outcomes(after, complete_id) == ["done", "duplicate"]
    assert handed_over is not None and handed_over.completion_sent


def test_a_completion_whose_worker_died_before_handing_it_over_goes_out_with_a_redelivery(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a worker running 5 children of a batch (60 s deadline), to be killed once it has
    # finalized the batch, before it has put the completion in the schedule; and a second
    # worker started meanwhile, which keeps running (nobody starts after the kill)
    ledger, store = tmp_path / "ledger.jsonl", f"sqlite:///{tmp_path / 'fleet.db'}"
    with processes() as workers:
        doomed, batch_id = _batch_on_a_doomed_worker(workers, pubsub_resources, tmp_path, 8)
        assert wait_for(lambda: len(ledger_events(ledger, "start", doomed.pid)) == 5, timeout=30)
        other = _spawn(workers, pubsub_resources, ledger, store)
        assert doomed.alive()  # the batch was not final yet when the other worker started
        # When the first is killed there
        assert doomed.wait(60) == -signal.SIGKILL
        killed = json.loads((tmp_path / "killed-at").read_text())
        # ... and the child that finalized the batch comes back to the other (never acked)
        assert wait_for(lambda: _completions(ledger, batch_id), timeout=60)
        assert wait_for(lambda: _outcomes(other, killed["job_id"]), timeout=60)
        time.sleep(2)  # a second completion, if any, would have run by now
        other.signal(signal.SIGTERM)
        assert other.wait(30) == 0
    [completion] = _completions(ledger, batch_id)
    published = completion["published"] - killed["at"]
    print(f"\ncompletion published {published:.2f}s after the kill (ack deadline 10 s)")
    # Then a redelivery put the completion out once the dead worker's messages came back (their
    # ack deadline is 10 s; a child may run its 8 s again first), not at the batch's deadline
    # 60 s away; it ran once
    assert published <= 30.0
    assert completion["batch"]["succeeded"] == 5
