"""Dead-letter tooling and ``status`` on the emulator: list, replay, a subscription's settings,
the fleet's concurrency keys."""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.fakes import Confirmed
from tests.support import wait_for
from workerpool import JobContext, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.cli import main
from workerpool.ops import dlq
from workerpool.ops.dlq import FailureRecord, Replayer, peek
from workerpool.pubsub import subscription_path, topic_path
from workerpool.registry import Registry
from workerpool.slots import SqliteSlots
from workerpool.telemetry import Telemetry
from workerpool.testing.fakes import make_delivery
from workerpool.testing.pubsub import PubSubResources
from workerpool.worker.failures import Failure, failure_attributes, fit_record

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _rows(output: str) -> list[list[str]]:
    """Table rows of ``dlq list`` (header and count line left out), split on 2+ spaces."""
    lines = [line for line in output.splitlines()[1:] if line and "record(s) on" not in line]
    return [re.split(r"\s{2,}", line.strip()) for line in lines]


def test_dead_letters_are_listed_replayed_processed_and_gone(
    pubsub_resources: PubSubResources,
) -> None:
    # Given jobs that fail for real while a dependency is broken: 3 permanently, 2 by
    # exhausting their attempts; all published with a trace context
    pubsub_resources.provision()
    broken = threading.Event()
    broken.set()
    jobs, done = Registry(), []
    lock = threading.Lock()

    @jobs.job("t.fragile")
    def fragile(ctx: JobContext, payload: dict[str, Any]) -> None:
        if broken.is_set():
            raise PermanentError(f"bucket {payload['bucket']} is missing")
        with lock:
            done.append(ctx.job_id)

    @jobs.job("t.flaky", max_attempts=2)
    def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
        if broken.is_set():
            raise RetryableError("upstream unavailable")
        with lock:
            done.append(ctx.job_id)

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    for i in range(3):
        pubsub_resources.publish(
            "t.fragile", {"bucket": f"b{i}"}, job_id=f"fragile-{i}", traceparent=TRACEPARENT
        )
    for i in range(2):
        pubsub_resources.publish("t.flaky", {}, job_id=f"flaky-{i}", traceparent=TRACEPARENT)
    dlq = f"{pubsub_resources.dead_letter_topic}-sub"
    target = ["--project", pubsub_resources.project, "--subscription", dlq]

    with pubsub_resources.worker(
        jobs, telemetry=Telemetry(tracer_provider=tracer_provider)
    ) as worker:
        assert wait_for(lambda: worker.processor.stats["dead_lettered"] == 5, timeout=60)

        # When the dead-letter subscription is listed, twice
        code, first = _cli("dlq", "list", *target)
        again = _cli("dlq", "list", *target)[1]
        # Then the table shows each failure, and listing consumed nothing
        assert code == 0, first
        assert first.splitlines()[0].split() == [
            "JOB", "JOB_ID", "ERROR_TYPE", "ERROR_MESSAGE", "ATTEMPTS", "FAILED_AT",
        ]  # fmt: skip
        rows = {row[1]: row for row in _rows(first)}
        assert sorted(rows) == ["flaky-0", "flaky-1", "fragile-0", "fragile-1", "fragile-2"]
        assert rows["fragile-1"][:5] == [
            "t.fragile", "fragile-1", "permanent_error", "bucket b1 is missing", "1",
        ]  # fmt: skip
        assert rows["flaky-0"][:3] == ["t.flaky", "flaky-0", "attempts_exhausted"]
        assert rows["flaky-0"][4] == "2" and rows["flaky-0"][5].startswith("20")
        assert "5 record(s) on" in first
        assert sorted(row[1] for row in _rows(again)) == sorted(rows)
        # ... and --job filters
        flaky_only = _cli("dlq", "list", *target, "--job", "t.flaky")[1]
        assert sorted(row[1] for row in _rows(flaky_only)) == ["flaky-0", "flaky-1"]

        # When the cause is removed and the records are replayed (a dry run first)
        broken.clear()
        code, dry = _cli("dlq", "replay", *target, "--dry-run")
        assert code == 0 and "5 would_replay" in dry, dry
        assert len(_rows(_cli("dlq", "list", *target)[1])) == 5
        code, replayed = _cli("dlq", "replay", *target)
        # Then every record is republished, and the worker runs each job once, successfully
        assert code == 0 and "5 replayed" in replayed, replayed
        assert wait_for(lambda: len(done) == 5, timeout=30)
        assert sorted(done) == sorted(rows)
        assert worker.processor.stats["done"] == 5

    # And the replayed messages kept their job id and trace context
    replayed_spans = [
        s
        for s in spans.get_finished_spans()
        if s.attributes and s.attributes[c.SPAN_OUTCOME] == "done"
    ]
    assert len(replayed_spans) == 5
    assert {s.context.trace_id for s in replayed_spans if s.context} == {int(TRACE_ID, 16)}
    # And the dead-letter subscription is empty
    code, after = _cli("dlq", "list", *target)
    assert code == 0 and "0 record(s) on" in after and not _rows(after)
    response = pubsub_resources.subscriber.pull(
        request={
            "subscription": pubsub_resources.dead_letter_subscription_path,
            "max_messages": 10,
        },
        timeout=5,
    )
    assert not response.received_messages


def _publish_failure(resources: PubSubResources, data: bytes, attributes: dict[str, str]) -> None:
    """A failure record of a message with ``attributes``, as a worker publishes it."""
    failure = {
        c.ATTR_ERROR_TYPE: "permanent_error",
        c.ATTR_ERROR_MESSAGE: "no",
        c.ATTR_DELIVERY_ATTEMPT: "1",
        c.ATTR_SOURCE_SUBSCRIPTION: resources.subscription_path,
        c.ATTR_SOURCE_TOPIC: resources.topic_path,
        c.ATTR_WORKER: "w",
        c.ATTR_FAILED_AT: "2026-11-30T00:00:00.000+00:00",
    }
    dlq_topic = topic_path(resources.project, resources.dead_letter_topic)
    resources.publisher.publish(dlq_topic, data, **attributes, **failure).result(30)


def test_replay_strips_failure_attributes_and_honours_limit_and_job(
    pubsub_resources: PubSubResources,
) -> None:
    # Given failure records on a dead-letter subscription (published as a worker would)
    pubsub_resources.provision()
    for i, job in enumerate(("t.a", "t.b", "t.a", "t.a")):
        attributes = {"job": job, "job_id": f"{job}-{i}", "traceparent": TRACEPARENT, "extra": "x"}
        _publish_failure(pubsub_resources, b'{"k": 1}', attributes)
    # When two records of t.a are replayed
    replayer = Replayer(
        pubsub_resources.subscriber,
        pubsub_resources.publisher,
        pubsub_resources.dead_letter_subscription_path,
    )
    results = list(replayer.replay(job="t.a", limit=2))
    # Then exactly those two are on the source subscription, with the original attributes only
    assert [r.status for r in results] == ["replayed", "replayed"]
    received = pubsub_resources.subscriber.pull(
        request={"subscription": pubsub_resources.subscription_path, "max_messages": 10}, timeout=10
    ).received_messages
    assert len(received) == 2
    for message in received:
        assert dict(message.message.attributes) == {
            "job": "t.a",
            "job_id": message.message.attributes["job_id"],
            "traceparent": TRACEPARENT,
            "extra": "x",
        }
        assert message.message.data == b'{"k": 1}'
    # And the other two records are still there
    left = peek(pubsub_resources.subscriber, pubsub_resources.dead_letter_subscription_path)
    assert sorted(r.job for r in left) == ["t.a", "t.b"]


def test_a_pass_longer_than_the_ack_deadline_sees_every_record_once_and_ends(
    pubsub_resources: PubSubResources, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 20 failure records on a dead-letter subscription with a 10 s ack deadline, pulled
    # one a pull, as a pass over the many pulls of a large subscription goes
    pubsub_resources.provision()
    short = subscription_path(pubsub_resources.project, f"{pubsub_resources.dead_letter_topic}-10s")
    pubsub_resources.subscriber.create_subscription(request={
        "name": short, "ack_deadline_seconds": 10,
        "topic": topic_path(pubsub_resources.project, pubsub_resources.dead_letter_topic),
    })  # fmt: skip
    for i in range(20):
        _publish_failure(pubsub_resources, b"{}", {"job": "t.a", "job_id": f"a-{i}"})
    monkeypatch.setattr(dlq, "_BATCH", 1)
    examined: list[str] = []

    def slow_and_wants_the_last(record: FailureRecord) -> bool:
        examined.append(record.job_id)
        time.sleep(0.6)
        return record.job_id == "a-19"

    # When a replay of the last one outlasts the ack deadline of the records it holds
    results: list[Any] = []
    replayer = Replayer(pubsub_resources.subscriber, pubsub_resources.publisher, short)
    replay = threading.Thread(
        target=lambda: results.extend(replayer.replay(match=slow_and_wants_the_last)),
        daemon=True,
    )
    replay.start()
    replay.join(timeout=60)
    # Then the pass looked at each record once, replayed the one it wanted, and ended, and
    # every other record is still there
    assert not replay.is_alive(), "the pass never ended"
    assert sorted(examined) == sorted(f"a-{i}" for i in range(20))
    assert [(r.status, r.record.job_id) for r in results] == [("replayed", "a-19")]
    monkeypatch.undo()
    assert len(peek(pubsub_resources.subscriber, short)) == 19


def test_a_replayed_job_that_fails_again_is_not_replayed_again_in_the_same_pass(
    pubsub_resources: PubSubResources,
) -> None:
    # Given 3 failure records, and workers that fail each replayed job again at once (its new
    # failure record is on the dead-letter topic before the replay goes on)
    pubsub_resources.provision()
    for i in range(3):
        _publish_failure(pubsub_resources, b"{}", {"job": "t.a", "job_id": f"a-{i}"})

    class FailingAgain:
        def publish(self, topic: str, data: bytes, **attributes: str) -> Any:
            future = pubsub_resources.publisher.publish(topic, data, **attributes)
            future.result(30)
            _publish_failure(pubsub_resources, data, attributes)
            return future

    dlq = pubsub_resources.dead_letter_subscription_path
    # When the records are replayed
    replayed = Replayer(pubsub_resources.subscriber, FailingAgain(), dlq).replay()
    results = list(itertools.islice(replayed, 10))
    # Then each is replayed once, and the new failures are left for the next pass
    assert sorted((r.status, r.record.job_id) for r in results) == [
        ("replayed", "a-0"), ("replayed", "a-1"), ("replayed", "a-2"),
    ]  # fmt: skip
    left = peek(pubsub_resources.subscriber, dlq)
    assert sorted(r.job_id for r in left) == ["a-0", "a-1", "a-2"]
    assert not {r.message_id for r in left} & {r.record.message_id for r in results}


def test_records_forwarded_by_the_dead_letter_policy_are_understood() -> None:
    record = FailureRecord(
        "ack",
        "m-1",
        b"{}",
        {
            "job": "t.a",
            c.ATTR_COPY_OF: "m-0",  # a copy made on a last delivery, then forwarded:
            c.ATTR_COPY_FOR: "jobs-sub",  # replayed as a message of its own
            c.ATTR_FIRED_AT: "2020-01-01T00:00:00.000+00:00",  # (and scheduled as one)
            c.ATTR_PUBSUB_DELIVERY_COUNT: "10",
            c.ATTR_PUBSUB_SOURCE_SUBSCRIPTION: "jobs-sub",
            c.ATTR_PUBSUB_SOURCE_PROJECT: "p",
            # What its publisher set, as a worker's failure record would say it: never read
            c.ATTR_SOURCE_TOPIC: "projects/p/topics/victim",
            c.ATTR_ERROR_TYPE: "handler_error",
            c.ATTR_ERROR_MESSAGE: "looks like an ordinary failure",
            c.ATTR_DELIVERY_ATTEMPT: "1",
            c.ATTR_FAILED_AT: "2020-01-01T00:00:00.000+00:00",
        },
    )
    assert (record.error_type, record.attempts) == (c.ERR_DELIVERY_LIMIT, "10")
    assert (record.error_message, record.failed_at) == ("", "")
    assert record.replay_attributes() == {"job": "t.a"}

    class Subscriber:
        def get_subscription(self, request: dict[str, str], timeout: float) -> Any:
            assert request == {"subscription": "projects/p/subscriptions/jobs-sub"}
            return type("Sub", (), {"topic": "projects/p/topics/jobs"})()

    assert Replayer(Subscriber(), None, "dlq").source_topic(record) == "projects/p/topics/jobs"


class _OnePull:
    """A dead-letter subscription whose first pull brings ``records`` ((data, attributes)
    each), and nothing after; it keeps the acks it is sent."""

    def __init__(self, records: list[tuple[bytes, dict[str, str]]]) -> None:
        self.records = records
        self.acked: list[str] = []
        self.pulls = 0

    def pull(self, request: dict[str, Any], timeout: float) -> Any:
        self.pulls += 1
        received = [
            SimpleNamespace(ack_id=f"a{i}", message=SimpleNamespace(
                message_id=f"m{i}", data=data, attributes=attributes, publish_time=None,
            ))
            for i, (data, attributes) in enumerate(self.records)
        ] if self.pulls == 1 else []  # fmt: skip
        return SimpleNamespace(received_messages=received)

    def acknowledge(self, request: dict[str, Any]) -> None:
        self.acked.extend(request["ack_ids"])

    def modify_ack_deadline(self, request: dict[str, Any]) -> None:
        pass


def test_a_record_whose_data_was_cut_is_kept_not_replayed_in_part() -> None:
    # Given a failure record of a payload too large to fit beside its failure attributes
    data = b'{"rows": "' + b"x" * (c.MAX_PUBLISH_REQUEST_BYTES - 100) + b'"}'
    delivery = make_delivery(data, {"job": "t.a", "job_id": "big-1"})
    failure = Failure("handler_error", "boom", "t.a", "big-1", 5)
    attributes = failure_attributes(
        delivery, failure, subscription="s", topic="projects/p/topics/t", worker="w"
    )
    cut, record = fit_record("projects/p/topics/dlq", data, attributes)
    assert len(cut) < len(data) and record[c.ATTR_DATA_CUT] == str(len(data))

    class Publisher:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def publish(self, topic: str, data: bytes, **attributes: str) -> Any:
            self.sent.append(data)
            raise AssertionError("a part of the payload was published")

    subscriber, publisher = _OnePull([(cut, record)]), Publisher()
    # When it is replayed, Then it is refused, saying why, and kept: nothing is published
    [replayed] = Replayer(subscriber, publisher, "dlq").replay()
    assert replayed.status == "failed" and "its data was cut" in replayed.detail
    assert publisher.sent == [] and subscriber.acked == []


def test_records_pub_sub_does_not_confirm_are_waited_for_one_timeout_in_all_and_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three failure records, and a Pub/Sub that confirms no republish
    monkeypatch.setattr(dlq, "_PUBLISH_TIMEOUT", 0.3)
    waits: list[float] = []
    attributes = {"job": "t.a", c.ATTR_SOURCE_TOPIC: "projects/p/topics/t"}

    class Publisher:
        def publish(self, topic: str, data: bytes, **attributes: str) -> Any:
            return Confirmed(waits)

    subscriber = _OnePull([(b"{}", attributes)] * 3)
    # When they are replayed
    results = list(Replayer(subscriber, Publisher(), "dlq").replay())
    # Then the first republish is waited for the whole timeout, the others not at all (it is
    # spent), and all three records are kept
    assert 0 < waits[0] <= 0.3 and waits[1:] == [0.0, 0.0]
    assert [r.status for r in results] == ["failed"] * 3 and subscriber.acked == []


def test_status_shows_settings_and_says_monitoring_is_unavailable_on_the_emulator(
    pubsub_resources: PubSubResources,
) -> None:
    pubsub_resources.provision(
        ack_deadline=30, max_delivery_attempts=7, min_backoff=2, max_backoff=20
    )
    code, output = _cli(
        "status",
        "--project",
        pubsub_resources.project,
        "--subscription",
        pubsub_resources.subscription,
    )
    assert code == 0, output
    fields = dict(line.split(": ", 1) for line in output.splitlines())
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    assert fields["subscription"] == pubsub_resources.subscription_path
    assert fields["topic"] == pubsub_resources.topic_path
    assert fields["ack deadline"] == "30s"
    assert fields["retry policy"] == "backoff 2s .. 20s"
    assert fields["dead-letter policy"] == (
        f"projects/{pubsub_resources.project}/topics/{pubsub_resources.dead_letter_topic} "
        "after 7 delivery attempts"
    )
    assert fields["filter"] == "none" and fields["exactly-once delivery"] == "disabled"
    assert fields["backlog, oldest unacked age"].startswith("unavailable on the emulator")
    missing = CliRunner().invoke(
        main, ["status", "--project", pubsub_resources.project, "--subscription", "nope"]
    )
    assert missing.exit_code == 2
    assert "subscription projects/workerpool-test/subscriptions/nope does not exist" in (
        missing.output
    )


def test_status_shows_the_fleets_concurrency_keys(
    pubsub_resources: PubSubResources, tmp_path: Path
) -> None:
    # Given a store the workers share, where one slot of "exports" is held
    pubsub_resources.provision()
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    store = SqliteSlots(tmp_path / "fleet.db")
    store.acquire("exports", "w1/run", 2, 60)
    store.close()
    # When status is asked about the declared limits
    code, output = _cli(
        "status", "--project", pubsub_resources.project,
        "--subscription", pubsub_resources.subscription, "--idempotency-store", url,
        "--concurrency", "exports=2", "--concurrency", "partner:*=1",
    )  # fmt: skip
    # Then it shows each key beside the subscription's settings
    assert code == 0, output
    fields = {
        k.strip(): v.strip() for k, v in (line.split(": ", 1) for line in output.splitlines())
    }
    assert fields["concurrency exports"].startswith("limit 2, 1 held: w1/run (token 1, ")
    assert fields["concurrency partner:*"] == "limit 1 each, no key in use"
