"""Copies made on a message's last delivery, with the idempotency claims of two workers
sharing one store (pure logic: in-process fakes for Pub/Sub)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.fakes import PausingPublisher
from tests.support import wait_for
from workerpool import JobContext, RetryableError
from workerpool import constants as c
from workerpool.idempotency.memory import MemoryStore
from workerpool.idempotency.middleware import Idempotency
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.renewal import Renewer
from workerpool.worker.timers import Timers

TOPIC, SUBSCRIPTION = "projects/p/topics/jobs", "projects/p/subscriptions/workers"
LAST = 5  # the subscription's max_delivery_attempts


class Topic:
    """A publisher whose messages are kept, to be delivered by hand."""

    def __init__(self) -> None:
        self.published: list[tuple[bytes, dict[str, str]]] = []

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        self.published.append((data, attributes))
        future: Future[str] = Future()
        future.set_result(f"copy-{len(self.published)}")
        return future

    def delivery(self, index: int, attempt: int = 1) -> Delivery:
        data, attributes = self.published[index]
        return make_delivery(data, attributes, message_id=f"copy-{index + 1}", attempt=attempt)


@dataclass
class Worker:
    processor: Processor
    acks: FakeAcks
    middleware: Idempotency
    runs: list[str] = field(default_factory=list)


def _worker(
    owner: str, store: MemoryStore, timers: Timers, topic: Topic, release: threading.Event
) -> Worker:
    jobs = Registry()
    runs: list[str] = []

    @jobs.job("t.j")
    def handler(ctx: JobContext, payload: dict[str, Any]) -> None:
        runs.append(ctx.message_id)
        if owner == "A":
            release.wait(10)
            raise RetryableError("the holder failed")

    middleware = Idempotency(store, owner, timers, ttl=30)
    middleware.start()
    acks = FakeAcks()
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [middleware],
        ProcessorSettings(Backoff(1.0, 10.0)), renewer=Renewer(topic, TOPIC, SUBSCRIPTION, LAST),
    )  # fmt: skip
    return Worker(processor, acks, middleware, runs)


@contextlib.contextmanager
def _workers(
    store: MemoryStore, topic: Topic, release: threading.Event, *owners: str
) -> Iterator[list[Worker]]:
    """Workers of these owners on one store and topic, started, and closed at the end."""
    timers = Timers()
    timers.start()
    workers = [_worker(owner, store, timers, topic, release) for owner in owners]
    try:
        yield workers
    finally:
        release.set()
        for worker in workers:
            worker.middleware.close(5)
        timers.close(5)


@pytest.fixture
def two_workers() -> Iterator[tuple[Topic, Worker, Worker, threading.Event]]:
    """Workers A and B on one store and topic; A's runs of job ``t.j`` wait for the event,
    then fail; B's succeed."""
    topic, release = Topic(), threading.Event()
    with _workers(MemoryStore(), topic, release, "A", "B") as (a, b):
        yield topic, a, b, release


def test_a_copy_of_a_message_whose_job_still_runs_waits_and_runs_if_the_holder_fails(
    two_workers: tuple[Topic, Worker, Worker, threading.Event],
) -> None:
    topic, a, b, release = two_workers
    attributes = {"job": "t.j", "job_id": "J"}
    # Given A running job J from message M
    holder = threading.Thread(
        target=a.processor.process, args=(make_delivery(b"{}", attributes, message_id="M"),)
    )
    holder.start()
    assert wait_for(lambda: a.runs == ["M"], timeout=5)
    # When M's lease lapses and B gets it on its last delivery: a copy is made, M acked
    b.processor.process(make_delivery(b"{}", attributes, message_id="M", attempt=LAST))
    assert b.acks.acked == ["ack-M"] and len(topic.published) == 1
    assert topic.published[0][1][c.ATTR_COPY_OF] == "M"
    # Then the copy, delivered while A still runs J, waits (it is not acked as a duplicate)
    b.processor.process(topic.delivery(0))
    assert b.acks.acked == ["ack-M"] and b.runs == []
    # and once A's run fails, the copy runs J
    release.set()
    holder.join(10)
    b.processor.process(topic.delivery(0, attempt=2))
    assert b.runs == ["copy-1"]
    assert wait_for(lambda: b.acks.acked == ["ack-M", "ack-copy-1"], timeout=5)  # once recorded
    assert dict(b.processor.stats) == {"deferred": 2, "done": 1}


def test_a_copy_of_a_message_given_back_waits_for_its_claim_to_be_let_go(
    two_workers: tuple[Topic, Worker, Worker, threading.Event],
) -> None:
    topic, a, b, _ = two_workers
    # Given A holding M on its last delivery, claimed as it was admitted
    held = make_delivery(b"{}", {"job": "t.j", "job_id": "J"}, message_id="M", attempt=LAST)
    a.processor.admitted([held])
    # When A gives it back unstarted (a drain): a copy is made and M acked
    a.processor.give_back([held])
    assert a.acks.acked == ["ack-M"] and a.acks.modacked == []
    # Then the copy, delivered to B before the claim was let go, waits; after, it runs
    b.processor.process(topic.delivery(0))
    assert b.runs == [] and b.acks.acked == []
    assert wait_for(lambda: _let_go(a.middleware, "J"), timeout=5)
    b.processor.process(topic.delivery(0, attempt=2))
    assert b.runs == ["copy-1"]
    assert wait_for(lambda: b.acks.acked == ["ack-copy-1"], timeout=5)


class _SlowReleases(MemoryStore):
    """Its releases wait for ``go``: one is in flight until then."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.releasing = threading.Event(), threading.Event()

    def release_many(
        self, claims: Sequence[tuple[str, str]], owner: str, *, failed: bool = False
    ) -> None:
        self.releasing.set()
        self.go.wait(10)
        super().release_many(claims, owner, failed=failed)


def test_a_copy_reaching_the_worker_that_lets_its_claim_go_waits_for_the_release() -> None:
    store, topic = _SlowReleases(), Topic()
    with _workers(store, topic, store.go, "B") as (worker,):
        # Given a message given back on its last delivery, its claim's release in flight
        held = make_delivery(b"{}", {"job": "t.j", "job_id": "J"}, message_id="M", attempt=LAST)
        worker.processor.admitted([held])
        worker.processor.give_back([held])
        assert store.releasing.wait(5)
        # When its copy reaches the same worker: it waits (taking the claim back now would
        # have it released from under the run, and a duplicate could run beside it)
        worker.processor.admitted([topic.delivery(0)])
        worker.processor.process(topic.delivery(0))
        assert worker.runs == [] and dict(worker.processor.stats) == {"released": 1, "deferred": 1}
        # Then, once the release is done, the copy runs
        store.go.set()
        assert wait_for(lambda: _let_go(worker.middleware, "J"), timeout=5)
        worker.processor.process(topic.delivery(0, attempt=2))
        assert worker.runs == ["copy-1"]


def test_at_the_end_of_a_drain_nothing_is_copied_and_a_copy_for_another_subscription_is_not_run(
    two_workers: tuple[Topic, Worker, Worker, threading.Event],
) -> None:
    topic, a, b, _ = two_workers
    # At the drain deadline there is no time for a publish: a plain nack
    held = make_delivery(b"{}", {"job": "t.j", "job_id": "J"}, message_id="M", attempt=LAST)
    a.processor.give_back([held], force=True)
    assert topic.published == [] and a.acks.modacked == [("ack-M", 0)]
    # A copy the topic's other subscription made reaches this one too: acked, never run
    other = {"job": "t.j", "job_id": "K", c.ATTR_COPY_OF: "N", c.ATTR_COPY_FOR: "other"}
    b.processor.process(make_delivery(b"{}", other, message_id="N2"))
    assert b.runs == [] and b.acks.acked == ["ack-N2"]
    assert dict(b.processor.stats) == {"duplicate": 1}
    # A message with only one of a copy's marks (a publisher's own attribute) runs
    b.processor.process(make_delivery(b"{}", {"job": "t.j", c.ATTR_COPY_FOR: "x"}, message_id="P"))
    assert b.runs == ["P"]


def test_a_message_with_no_room_for_a_copys_attributes_is_nacked() -> None:
    # Pub/Sub allows 100 attributes: a copy adds its own (job id, copy_of, copy_for)
    topic = Topic()
    renewer = Renewer(topic, TOPIC, SUBSCRIPTION, LAST)
    crowded = {f"a{i}": "x" for i in range(98)} | {"job": "t.j"}
    full = make_delivery(b"{}", crowded, message_id="M", attempt=LAST)
    roomy = make_delivery(b"{}", {"job": "t.j"}, message_id="M1", attempt=LAST)
    assert renewer.renew([(full, 0.0), (roomy, 10**9)]) == [False, True]
    [(_, copy)] = topic.published
    assert copy[c.ATTR_JOB_ID] == "M1" and copy[c.ATTR_COPY_FOR] == SUBSCRIPTION
    assert copy[c.ATTR_NOT_BEFORE] > "2027"  # a delay beyond a year is held to one


def _let_go(middleware: Idempotency, job_id: str) -> bool:
    """Whether no live claim holds ``job_id`` (read from the memory store's own records)."""
    store = middleware._store
    assert isinstance(store, MemoryStore)
    record = store._records.get(job_id)
    return record is None or (record.completed_at is None and record.until <= time.time())


class _Unanswered(Future[str]):
    """A publish Pub/Sub never answers: says how long it was waited for, each time."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float] = []

    def result(self, timeout: float | None = None) -> str:
        assert timeout is not None, "a copy is never waited for without a timeout"
        self.waited.append(timeout)
        time.sleep(timeout)
        raise TimeoutError


class _Unreachable:
    def __init__(self) -> None:
        self.futures: list[_Unanswered] = []

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        self.futures.append(_Unanswered())
        return self.futures[-1]


def _waiting(count: int) -> list[Delivery]:
    return [
        make_delivery(b"{}", {"job": "t.j", "job_id": f"J{i}"}, message_id=f"M{i}", attempt=LAST)
        for i in range(count)
    ]


def test_a_drain_waits_for_copies_no_later_than_its_deadline() -> None:
    topic = _Unreachable()
    acks = FakeAcks()
    processor = Processor(
        Registry(), acks, FakeLeaser(), FakeDeadLetters(), (), ProcessorSettings(Backoff(1, 10)),
        renewer=Renewer(topic, TOPIC, SUBSCRIPTION, LAST, timeout=10),
    )  # fmt: skip
    waiting = _waiting(3)
    # Given a drain that must end within 2 s (the platform's kill follows)
    processor.renew_until(time.monotonic() + 2)
    # When it gives back messages on their last delivery and Pub/Sub does not answer
    processor.give_back(waiting[:2])
    # Then their copies are waited for until the deadline, not the renewal's own 10 s
    waited = [timeout for future in topic.futures for timeout in future.waited]
    assert len(topic.futures) == 2 and sum(waited) <= 2, waited
    assert acks.modacked == [("ack-M0", 0), ("ack-M1", 0)] and acks.acked == []
    # And in its last second no copy is published at all (it could land after the nack)
    processor.give_back(waiting[2:])
    assert len(topic.futures) == 2 and acks.modacked[-1] == ("ack-M2", 0)


def test_a_copy_waited_for_when_the_drain_starts_is_waited_for_until_its_deadline() -> None:
    topic = _Unreachable()
    renewer = Renewer(topic, TOPIC, SUBSCRIPTION, LAST, timeout=10)
    result: list[list[bool]] = []
    # Given a renewal waiting for a copy Pub/Sub does not answer (it may wait 10 s)
    renewing = threading.Thread(target=lambda: result.append(renewer.renew([(_waiting(1)[0], 0)])))
    renewing.start()
    assert wait_for(lambda: len(topic.futures) == 1, timeout=5, interval=0.01)
    # When a drain that ends in 0.3 s starts, Then the renewal gives up by its deadline
    renewer.stop_by(time.monotonic() + 0.3)
    renewing.join(5)
    assert result == [[False]]
    assert sum(topic.futures[0].waited) < 5


class _Counting(Future[str]):
    """A publish that failed with a timeout of its own (a socket's), counting its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.set_exception(TimeoutError("socket timed out"))

    def result(self, timeout: float | None = None) -> str:
        self.reads += 1
        return super().result(timeout)


def test_a_copy_whose_publish_failed_with_a_timeout_is_not_waited_for() -> None:
    failed = _Counting()

    class Topic:
        def publish(
            self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
        ) -> Future[str]:
            return failed

    renewer = Renewer(Topic(), TOPIC, SUBSCRIPTION, LAST, timeout=10)
    assert renewer.renew([(_waiting(1)[0], 0)]) == [False]
    assert failed.reads == 1  # read once, not again and again until the timeout


def _keyed_last(message_id: str) -> Delivery:
    return make_delivery(b"{}", {"job": "t.j", "job_id": message_id}, message_id=message_id,
                         ordering_key="k", attempt=LAST)  # fmt: skip


def test_a_copy_whose_publish_fails_after_its_wait_leaves_its_key_publishable() -> None:
    # Given a copy of a keyed message whose publish Pub/Sub answers only after the renewal
    # stopped waiting for it, and then fails (the client pauses the key)
    topic = PausingPublisher()
    renewer = Renewer(topic, TOPIC, SUBSCRIPTION, LAST, timeout=0.2)
    assert renewer.renew([(_keyed_last("M1"), 0)]) == [False]
    topic.fail_pending()
    assert topic.paused == {"k"}
    # When the next message of that key is copied, Pub/Sub answering again
    topic.answering = True
    # Then its copy is published: the key is resumed first, not left paused (which would
    # nack the message instead, on its last delivery a forward to the dead-letter topic)
    assert renewer.renew([(_keyed_last("M2"), 0)]) == [True]
    assert topic.paused == set()
