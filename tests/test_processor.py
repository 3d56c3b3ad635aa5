"""The processor and its decision table, with in-process fakes (pure logic)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from google.pubsub_v1.types import ReceivedMessage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workerpool import Defer, JobContext, PermanentError, RetryableError
from workerpool import constants as c
from workerpool.constants import Label
from workerpool.errors import ConfigError
from workerpool.registry import Registry
from workerpool.schedule.when import parse_not_before
from workerpool.telemetry.logs import CloudLoggingFormatter
from workerpool.telemetry.textlog import TextFormatter
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import failure_attributes
from workerpool.worker.lease import Leaser
from workerpool.worker.middleware import Ended, Middleware, TimeLimit
from workerpool.worker.outcome import (
    Ack,
    AlreadyDone,
    DeadLetter,
    Deferred,
    DuplicateOfRunning,
    Facts,
    Failed,
    Interrupted,
    LostLease,
    Nack,
    NotStarted,
    Outcome,
    RecordFailed,
    RedeliveredWhileRunning,
    Rejected,
    Renew,
    Succeeded,
    Unavailable,
    decide,
)
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.puller import to_delivery
from workerpool.worker.renewal import Renewer
from workerpool.worker.run import Run, Settled
from workerpool.worker.timers import Timers

BACKOFF = Backoff(minimum=1.0, maximum=60.0)
SUBSCRIPTION = "projects/p/subscriptions/s"


@dataclass
class Item:
    name: str
    count: int


def build(
    jobs: Registry, *, max_payload_bytes: int = 4096, **kwargs: Any
) -> tuple[Processor, FakeAcks, FakeDeadLetters]:
    acks, dead_letters = FakeAcks(), FakeDeadLetters(**kwargs)
    processor = Processor(
        jobs,
        acks,
        FakeLeaser(),
        dead_letters,
        (),
        ProcessorSettings(BACKOFF, max_payload_bytes),
    )
    return processor, acks, dead_letters


def _facts(attempt: int = 1, max_attempts: int = 5, *, retry_policy: bool = False) -> Facts:
    return Facts(attempt, max_attempts, BACKOFF, retry_policy)


def test_decision_table() -> None:
    table = {
        Succeeded(): Ack(Label.DONE),
        AlreadyDone(): Ack(Label.DUPLICATE),
        DuplicateOfRunning(): Ack(Label.DUPLICATE),
        Rejected("not_json", "x"): DeadLetter("not_json", "x"),
        Interrupted(): Nack(0.0, Label.DRAINED),
        NotStarted(): Nack(0.0, Label.RELEASED),
        LostLease(after=12.5): Nack(12.5, Label.DEFERRED),
    }
    for outcome, action in table.items():
        assert decide(outcome, _facts()) == action
    for outcome in (Failed("E", "x"), Unavailable("down"), RecordFailed("down")):
        action = decide(outcome, _facts(3))
        assert isinstance(action, Nack) and 2.0 <= action.delay <= 4.0
        assert action.label == Label.RETRIED
    deferred = decide(RedeliveredWhileRunning(), _facts())
    assert isinstance(deferred, Nack) and deferred.label == "deferred" and deferred.delay >= 1
    # ... no later than just after the holder's claim would lapse, and never in a hot loop
    # (the 4th attempt's backoff: 8-16 s)
    assert decide(RedeliveredWhileRunning(lapses_in=3.0), _facts(4)) == Nack(4.0, "deferred")
    assert decide(RedeliveredWhileRunning(lapses_in=-9.0), _facts(4)) == Nack(1.0, "deferred")
    spaced = decide(RedeliveredWhileRunning(lapses_in=50.0), _facts(4))
    assert isinstance(spaced, Nack) and 8.0 <= spaced.delay <= 16.0
    at_cap = decide(Deferred("at the cap", 7.0), _facts(9))
    assert at_cap == Nack(7.0, Label.DEFERRED)  # past max_attempts, yet not dead-lettered
    last = decide(Failed("RetryableError", "flaky"), _facts(5))
    assert last == DeadLetter(c.ERR_ATTEMPTS_EXHAUSTED, "RetryableError after 5 attempts: flaky")
    # A record that could not be published is retried, also on the last attempt
    assert decide(RecordFailed("down"), _facts(5)).label == Label.RETRIED  # type: ignore[union-attr]


def test_on_the_last_delivery_a_wait_renews_the_message_and_a_failure_is_recorded() -> None:
    last = Facts(5, 8, BACKOFF, last_delivery=True)
    # Waiting is not failing: a copy comes back instead, after the same delay
    waits = {
        Deferred("at the cap", 7.0): Renew(7.0, Nack(7.0, Label.DEFERRED)),
        LostLease(after=12.5): Renew(12.5, Nack(12.5, Label.DEFERRED)),
        Interrupted(): Renew(0.0, Nack(0.0, Label.DRAINED)),
        NotStarted(): Renew(0.0, Nack(0.0, Label.RELEASED)),
    }
    for outcome, action in waits.items():
        assert decide(outcome, last) == action
    for outcome in (RedeliveredWhileRunning(), Unavailable("down"), RecordFailed("down")):
        renew = decide(outcome, last)
        assert isinstance(renew, Renew) and renew.after == renew.otherwise.delay > 0
    # With a retry policy the copy keeps the delay that the nack leaves to the policy
    policy = Facts(5, 8, BACKOFF, retry_policy=True, last_delivery=True)
    assert decide(Deferred("later", 30.0), policy) == Renew(30.0, Nack(0.0, Label.DEFERRED))
    # A failure counted per job id goes on in a copy; counted per delivery, it ends here
    counted = Facts(3, 8, BACKOFF, last_delivery=True, tries_outlive_message=True)
    assert isinstance(decide(Failed("E", "x"), counted), Renew)
    assert decide(Failed("RetryableError", "flaky"), last) == DeadLetter(
        c.ERR_DELIVERY_LIMIT,
        "RetryableError at delivery 5, the last the subscription's dead-letter policy allows:"
        " flaky",
    )
    # What decided before still decides: success, duplicates, bad input, the last attempt
    assert decide(Succeeded(), last) == Ack(Label.DONE)
    assert decide(AlreadyDone(), last) == Ack(Label.DUPLICATE)
    assert decide(Rejected("not_json", "x"), last) == DeadLetter("not_json", "x")
    exhausted = decide(Failed("E", "x"), Facts(8, 8, BACKOFF, last_delivery=True))
    assert isinstance(exhausted, DeadLetter) and exhausted.error_type == c.ERR_ATTEMPTS_EXHAUSTED


class _Publisher:
    """Publishes into a list; or fails, as a topic that cannot be reached."""

    def __init__(self, fail: str = "") -> None:
        self.published: list[tuple[str, bytes, dict[str, str]]] = []
        self.fail = fail

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        future: Future[str] = Future()
        if self.fail == "at-once":
            raise ValueError("refused before it was sent")
        if self.fail == "later":
            future.set_exception(RuntimeError("topic unreachable"))
        else:
            self.published.append((topic, data, attributes))
            future.set_result(f"copy-{len(self.published)}")
        return future


class _Heard(Middleware):
    """Every settlement, as the telemetry hears it."""

    def __init__(self) -> None:
        self.events: list[Settled] = []

    def settled(self, event: Settled) -> None:
        self.events.append(event)


@pytest.mark.parametrize(
    "fail", ["", "later", "at-once"], ids=["published", "not-published", "refused"]
)
def test_a_deferral_on_the_last_delivery_is_a_copy_of_the_same_job_then_an_ack(
    fail: str,
) -> None:
    jobs = Registry()

    @jobs.job("t.wait")
    def wait(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise Defer("a slot is not free", delay=30)

    publisher = _Publisher(fail)
    acks = FakeAcks()
    heard = _Heard()
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [heard], ProcessorSettings(BACKOFF),
        renewer=Renewer(publisher, "projects/p/topics/jobs", SUBSCRIPTION, 5),
    )  # fmt: skip
    # Given messages on deliveries 4 and 5 of the 5 the subscription allows, one without a job id
    processor.process(make_delivery(b"{}", {"job": "t.wait"}, message_id="m4", attempt=4))
    processor.process(make_delivery(b'{"a": 1}', {"job": "t.wait"}, message_id="m5", attempt=5))
    # and one given back unstarted on its last delivery (a drain)
    drained = make_delivery(b"{}", {"job": "t.wait", "job_id": "j-9"}, message_id="m9", attempt=5)
    processor.give_back([drained])
    # Then the 4th is nacked as before
    assert acks.modacked[0] == ("ack-m4", 30)
    assert processor.stats == {"deferred": 2, "released": 1}
    # (a settlement says whether its message was renewed; its label says why it came back)
    renewed = {event.message_id: event.renewed for event in heard.events}
    assert renewed == {"m4": False, "m5": not fail, "m9": not fail}
    if fail:
        # Copies not published: the others are nacked too (the policy's forward is the backstop)
        assert acks.modacked == [("ack-m4", 30), ("ack-m5", 30), ("ack-m9", 0)]
        assert acks.acked == []
        return
    # and the others are published again, as the same jobs, then acked
    (topic, data, deferred), (_, _, released) = publisher.published
    assert (topic, data) == ("projects/p/topics/jobs", b'{"a": 1}')
    assert deferred["job"] == "t.wait" and deferred[c.ATTR_JOB_ID] == "m5"
    assert (deferred[c.ATTR_COPY_OF], deferred[c.ATTR_COPY_FOR]) == (
        "m5",
        "projects/p/subscriptions/s",
    )
    assert 25 < parse_not_before(deferred[c.ATTR_NOT_BEFORE]) - time.time() <= 30  # its delay
    assert released == {  # due at once
        "job": "t.wait",
        "job_id": "j-9",
        "copy_of": "m9",
        "copy_for": "projects/p/subscriptions/s",
    }
    assert acks.acked == ["ack-m5", "ack-m9"] and len(acks.modacked) == 1


def test_with_a_retry_policy_every_nack_is_immediate_and_pub_sub_spaces_them() -> None:
    policy = _facts(3, retry_policy=True)
    for outcome in (
        Failed("E", "x"),
        Unavailable("down"),
        RecordFailed("down"),
        RedeliveredWhileRunning(),
        Deferred("later", 30.0),
        LostLease(after=20.0),
    ):
        action = decide(outcome, policy)
        assert isinstance(action, Nack) and action.delay == 0.0, outcome
    assert decide(Succeeded(), policy) == Ack(Label.DONE)


def test_backoff_grows_with_jitter_within_bounds() -> None:
    delays = [[BACKOFF.delay(attempt) for _ in range(200)] for attempt in range(1, 9)]
    for attempt, samples in enumerate(delays, 1):
        ceiling = min(60.0, 2.0 ** (attempt - 1))
        assert all(max(1.0, ceiling / 2) <= d <= ceiling for d in samples)
    assert len(set(delays[4])) > 100  # jittered, not lock-step


def test_typed_payload_is_converted_and_mismatch_names_the_field() -> None:
    jobs = Registry()
    seen: list[Item] = []

    @jobs.job("t.item", payload=Item)
    def handle(ctx: JobContext, item: Item) -> None:
        seen.append(item)

    processor, acks, dead_letters = build(jobs)
    processor.process(make_delivery(b'{"name": "a", "count": 2}', {"job": "t.item"}))
    processor.process(
        make_delivery(b'{"name": "a", "count": "2"}', {"job": "t.item"}, message_id="m-2")
    )
    assert seen == [Item("a", 2)]
    assert acks.acked == ["ack-m-1", "ack-m-2"]
    [(_, failure)] = dead_letters.records
    assert failure.error_type == c.ERR_INVALID_PAYLOAD
    assert failure.error_message == "count: expected int, got str"


def test_handler_errors_map_to_outcomes() -> None:
    jobs = Registry()

    @jobs.job("t.raise", max_attempts=3)
    def handle(ctx: JobContext, payload: dict[str, Any]) -> None:
        kind = payload["kind"]
        if kind == "retry":
            raise RetryableError("later")
        if kind == "permanent":
            raise PermanentError("never", error_type="bad_customer")
        raise KeyError("bug")

    processor, acks, dead_letters = build(jobs)
    for i, kind in enumerate(["retry", "permanent", "bug"]):
        body = json.dumps({"kind": kind}).encode()
        processor.process(make_delivery(body, {"job": "t.raise"}, message_id=f"m{i}"))
    assert [a for a, _ in acks.modacked] == ["ack-m0", "ack-m2"]  # retried, not acked
    assert acks.acked == ["ack-m1"]
    assert [f.error_type for _, f in dead_letters.records] == ["bad_customer"]
    assert processor.stats == {"retried": 2, "dead_lettered": 1}


def test_unrecorded_failure_is_never_acked() -> None:
    processor, acks, _ = build(Registry(), fail=True)
    processor.process(make_delivery(b"{}", {"job": "nope"}))
    assert acks.acked == []
    assert [a for a, _ in acks.modacked] == ["ack-m-1"]


def test_unknown_job_option_is_rejected_at_registration() -> None:
    jobs = Registry()
    try:
        jobs.job("t.x", retries=3)
    except TypeError as exc:
        assert "unknown option(s) retries" in str(exc)
    else:
        raise AssertionError("an unknown option was accepted")


_attributes = st.dictionaries(
    st.sampled_from(["job", "job_id", "traceparent", "x"]) | st.text(min_size=1, max_size=20),
    st.sampled_from(["t.ok", "t.item", "", "nope"]) | st.text(max_size=40),
    max_size=8,
)
_bodies = st.one_of(
    st.binary(max_size=200),
    st.just(b""),
    # Over the limit: random bytes repeated to a random size (drawing 5,000 random bytes one
    # by one is most of what this test would cost, and only the size decides the outcome).
    st.builds(
        lambda head, size: (head * size)[:size],
        st.binary(min_size=1, max_size=64),
        st.integers(4097, 5000),
    ),
    st.builds(
        lambda v: json.dumps(v).encode(),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3)
            ),
            max_leaves=6,
        ),
    ),
    st.builds(lambda n, k: json.dumps({"name": n, "count": k}).encode(), st.text(), st.integers()),
)


# tests/test_hostile_input.py holds the wide grammar; this keeps the processor's own shapes.
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, attributes=_attributes, attempt=st.one_of(st.none(), st.integers(1, 9)))
def test_random_messages_end_as_a_run_or_one_failure_record(
    body: bytes, attributes: dict[str, str], attempt: int | None
) -> None:
    jobs = Registry()
    runs: list[object] = []
    jobs.job("t.ok")(lambda ctx, payload: runs.append(payload))
    jobs.job("t.item", payload=Item)(lambda ctx, payload: runs.append(payload))
    processor, acks, dead_letters = build(jobs)
    processor.process(make_delivery(body, attributes, attempt=attempt))
    # Exactly one of: the handler ran, or one failure record was written; either way one ack.
    assert len(runs) + len(dead_letters.records) == 1
    assert acks.acked == ["ack-m-1"] and acks.modacked == []
    for delivery, failure in dead_letters.records:
        record = failure_attributes(delivery, failure, subscription="s", topic="t", worker="w")
        assert len(record) <= c.MAX_ATTRIBUTES
        assert all(len(v.encode()) <= c.MAX_ATTRIBUTE_VALUE_BYTES for v in record.values())
        assert record[c.ATTR_ERROR_TYPE] == failure.error_type
        assert failure.error_type in {
            c.ERR_NOT_JSON,
            c.ERR_NOT_OBJECT,
            c.ERR_MISSING_JOB,
            c.ERR_UNKNOWN_JOB,
            c.ERR_INVALID_PAYLOAD,
            c.ERR_OVERSIZE,
        }


@contextlib.contextmanager
def _time_limited(
    jobs: Registry, before: Sequence[Middleware] = (), after: Sequence[Middleware] = ()
) -> Iterator[Processor]:
    """A processor whose chain is ``before``, a time limit on timers that run, then ``after``;
    the timers stop as the block ends."""
    timers = Timers()
    timers.start()
    chain = [*before, TimeLimit(timers), *after]
    try:
        yield Processor(
            jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), chain, ProcessorSettings(BACKOFF)
        )
    finally:
        timers.close()


def test_time_limit_says_the_cancel_is_a_timeout() -> None:
    jobs, seen = Registry(), []

    @jobs.job("t.slow", timeout=0.2)
    def slow(ctx: JobContext, payload: dict[str, Any]) -> None:
        assert ctx.cancelled.wait(10)
        seen.append(ctx.timed_out.is_set())
        raise RetryableError("gave up at the timeout")

    with _time_limited(jobs) as processor:
        processor.process(make_delivery(b"{}", {"job": "t.slow"}))
    assert seen == [True]
    assert processor.stats == {"retried": 1}


class _SlowBefore(Middleware):
    """A middleware whose ``before`` takes longer than the job's timeout (a slow store)."""

    def before(self, run: Run) -> None:
        time.sleep(0.5)


def test_a_run_whose_timeout_passes_before_its_handler_starts_fails_as_timed_out() -> None:
    # Given a job of a 0.2 s timeout, behind a middleware that takes 0.5 s before it
    jobs, started = Registry(), []
    jobs.job("t.late", timeout=0.2)(lambda ctx, payload: started.append(1))
    with _time_limited(jobs, after=[_SlowBefore()]) as processor:
        # When it runs
        processor.process(make_delivery(b"{}", {"job": "t.late"}))
    # Then its handler never starts, and the run is a timeout: a failure, retried with
    # backoff and counted against its attempts (not given back as a drain would be)
    assert started == []
    assert processor.stats == {"retried": 1}


def test_generator_handlers_are_refused_and_async_ones_known_at_registration() -> None:
    # Given handlers whose call would only build a generator, and async ones
    async def coroutine(ctx: JobContext, payload: dict[str, Any]) -> None: ...

    async def async_generator(ctx: JobContext, payload: dict[str, Any]) -> Any:
        yield None

    def generator(ctx: JobContext, payload: dict[str, Any]) -> Any:
        yield None

    class AsyncCallable:
        async def __call__(self, ctx: JobContext, payload: dict[str, Any]) -> None: ...

    for handler in [async_generator, generator]:
        # When a generator is registered, Then registration fails and says why
        with pytest.raises(TypeError, match=r"'t.bad': .* is a generator function"):
            Registry().job("t.bad")(handler)
    for handler in [coroutine, functools.partial(coroutine), AsyncCallable()]:
        # When an async handler is registered, Then it is known as one (it will be awaited)
        jobs = Registry()
        jobs.job("t.async")(handler)
        spec = jobs.get("t.async")
        assert spec is not None and spec.is_async


def test_a_handler_that_returns_a_coroutine_is_never_acked_as_done() -> None:
    # Given a plain def that hands back a coroutine instead of running it
    jobs, ran = Registry(), []

    async def body() -> None:
        ran.append(True)

    jobs.job("t.sneaky")(lambda ctx, payload: body())
    processor, acks, dead_letters = build(jobs)
    # When a message for it is processed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be a leak
        processor.process(make_delivery(b"{}", {"job": "t.sneaky"}))
    # Then it is recorded as a failure, not counted done, and its body never ran
    [(_, failure)] = dead_letters.records
    assert failure.error_type == c.ERR_HANDLER_RETURNED_AWAITABLE
    assert processor.stats == {"dead_lettered": 1} and ran == []
    assert acks.acked == ["ack-m-1"]


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"x": NaN}',
        b'{"x": Infinity}',
        b'{"x": -Infinity}',
        b'{"x": 1e400}',
        b'{"x": ' + b"9" * 5000 + b"}",
    ],
    ids=["deep-list", "deep-object", "nan", "infinity", "-infinity", "1e400", "5000-digits"],
)
def test_json_that_python_would_choke_on_or_that_rfc_8259_forbids_is_not_json(
    body: bytes,
) -> None:
    # Given a job with a float field, and a body that is not RFC 8259 JSON or nests too deep
    jobs, runs = Registry(), []

    @dataclass
    class Reading:
        x: float = 0.0

    jobs.job("t.reading", payload=Reading)(lambda ctx, payload: runs.append(payload))
    processor, acks, dead_letters = build(jobs, max_payload_bytes=c.MAX_MESSAGE_BYTES)
    # When it is processed
    processor.process(make_delivery(body, {"job": "t.reading"}))
    # Then it never reaches the handler: one not_json record, and the message is acked
    assert runs == []
    assert [f.error_type for _, f in dead_letters.records] == [c.ERR_NOT_JSON]
    assert acks.acked == ["ack-m-1"]


def test_a_lone_surrogate_in_a_field_name_still_gets_its_failure_record() -> None:
    # Given a typed job, and a payload whose unexpected field name is a lone surrogate
    jobs = Registry()
    jobs.job("t.item", payload=Item)(lambda ctx, payload: None)
    processor, acks, dead_letters = build(jobs)
    # When it is processed
    processor.process(make_delivery(b'{"\\ud800": 1}', {"job": "t.item"}))
    # Then one invalid_payload record is written, with a message every UTF-8 encoder accepts
    [(delivery, failure)] = dead_letters.records
    assert failure.error_type == c.ERR_INVALID_PAYLOAD
    record = failure_attributes(delivery, failure, subscription="s", topic="t", worker="w")
    assert "\\ud800" in record[c.ATTR_ERROR_MESSAGE]
    for value in record.values():
        value.encode("utf-8")
    assert acks.acked == ["ack-m-1"]


def test_log_lines_with_lone_surrogates_are_written() -> None:
    # Given both log formats and a message carrying a lone surrogate
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, "field %s", ("\ud800",), None)
    for formatter in (CloudLoggingFormatter(), TextFormatter()):
        # When it is formatted, Then the line encodes as UTF-8 and shows the escape
        line = formatter.format(record)
        assert "\\ud800" in line
        line.encode("utf-8")


def test_job_config_sections_are_converted_once_and_mistakes_named() -> None:
    # Given a job with a config dataclass and one without
    @dataclass(frozen=True)
    class Limits:
        hosts: list[str]
        timeout: float = 10.0

    jobs = Registry()
    jobs.job("t.typed", config=Limits)(lambda ctx, payload: None)
    jobs.job("t.plain")(lambda ctx, payload: None)
    # When their sections are converted, Then the typed one is its dataclass, the other as is
    configs = jobs.configs({"t.typed": {"hosts": ["a"], "timeout": 5}, "t.plain": {"x": 1}})
    assert configs == {"t.typed": Limits(["a"], 5.0), "t.plain": {"x": 1}}
    # And a missing required setting, a wrong type and a non-dataclass config are named
    with pytest.raises(ConfigError, match=r'^\[jobs."t.typed"\] hosts: required field is missing$'):
        jobs.configs({})
    with pytest.raises(ConfigError, match=r"hosts\[0\]: expected str, got int$"):
        jobs.configs({"t.typed": {"hosts": [1]}})
    with pytest.raises(TypeError, match="config must be a dataclass"):
        jobs.job("t.bad", config=dict)


def test_the_handler_sees_the_publish_time_pub_sub_gave_to_the_microsecond() -> None:
    jobs, seen = Registry(), []

    @jobs.job("t.when")
    def when(ctx: JobContext, payload: dict[str, Any]) -> None:
        seen.append(ctx.publish_time)

    processor = Processor(
        jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), [], ProcessorSettings(BACKOFF)
    )
    stamps = [(0, 0), (1_764_940_000, 999_999_999), (2_000_000_000, 123_456_789), (1, 1_000)]
    for seconds, nanos in stamps:
        received = ReceivedMessage.pb(ReceivedMessage(ack_id=f"ack-{seconds}"))
        received.message.message_id, received.message.data = f"m-{seconds}", b"{}"
        received.message.attributes["job"] = "t.when"
        received.message.publish_time.seconds, received.message.publish_time.nanos = seconds, nanos
        processor.process(to_delivery(received))
    # Nanoseconds are cut to microseconds, as protobuf's ``ToDatetime`` cuts them.
    assert seen == [datetime.fromtimestamp(s, UTC) + timedelta(microseconds=n // 1000)
                    for s, n in stamps]  # fmt: skip


def test_a_run_that_ends_is_never_told_of_its_timeout() -> None:
    jobs, contexts = Registry(), []

    def failing(ctx: JobContext, payload: dict[str, Any]) -> None:
        contexts.append(ctx)
        raise ValueError("fails")

    jobs.job("t.quick", timeout=0.1)(lambda ctx, payload: contexts.append(ctx))
    jobs.job("t.failing", timeout=0.1)(failing)
    with _time_limited(jobs) as processor:
        for name in ["t.quick", "t.failing"] * 3:
            processor.process(make_delivery(b"{}", {"job": name}))
        # When their timeout, and many ticks of the time limit, have passed since they ended
        time.sleep(0.5)
    # Then none was told it timed out, however it ended: each left the time limit's watch
    assert processor.stats == {"done": 3, "retried": 3} and len(contexts) == 6
    assert not any(ctx.timed_out.is_set() or ctx.cancelled.is_set() for ctx in contexts)


def test_settled_takes_its_fields_in_order_with_their_defaults() -> None:
    # Settled has an __init__ of its own (it is made once a message): a field added to the
    # class but not to it, or a default that differs, would go unnoticed at every use
    parameters = list(inspect.signature(Settled.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Settled)
    assert [p.name for p in parameters] == [f.name for f in fields]
    made = Settled(Label.DONE, "t.job", "j-1", "m-1", 1)
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert getattr(made, f.name) == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING and f.name != "settled_at":
            assert getattr(made, f.name) == f.default_factory(), f.name
    assert 0 < time.monotonic() - made.settled_at < 60
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.label = Label.RETRIED  # type: ignore[misc]


class _RecordsCompletions(Middleware):
    """Has a successful run's completion recorded off its thread, as the idempotency store's
    middleware does, noting whether something waits for the record."""

    def __init__(self) -> None:
        self.awaited: list[bool] = []

    def after(self, run: Run, ended: Ended) -> Ended:
        if isinstance(ended, Succeeded):

            def record(then: Callable[[Outcome], None], *, awaited: bool = False) -> None:
                self.awaited.append(awaited)
                then(Succeeded())

            run.completion = record
        return ended


@pytest.mark.parametrize(
    ("ordered", "ordering_key", "awaited"),
    [(True, "k", True), (True, "", False), (False, "k", False)],
    ids=["keyed_on_an_ordered_subscription", "unkeyed", "keyed_on_an_unordered_one"],
)
def test_a_completion_is_awaited_where_the_next_message_of_its_key_waits_for_it(
    ordered: bool, ordering_key: str, awaited: bool
) -> None:
    # Given a processor whose successes are recorded off the slot thread
    jobs = Registry()

    @jobs.job("t.ok")
    def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        return None

    recording, acks = _RecordsCompletions(), FakeAcks()
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [recording],
        ProcessorSettings(BACKOFF, ordered=ordered),
    )  # fmt: skip
    delivery = make_delivery(b"{}", {"job": "t.ok", "job_id": "j"}, ordering_key=ordering_key)
    # When a message runs and succeeds
    processor.process(delivery)
    # Then its record is awaited (not left to wait for others to share its write) only where
    # the next message of its ordering key starts once it settles; it is acked either way
    assert recording.awaited == [awaited]
    assert acks.acked == [delivery.ack_id]


class _DrainEndsWhileHeard(Middleware):
    """Hears each dead-lettered message while the end of a drain tries to give it back."""

    def __init__(self) -> None:
        self.processor: Processor | None = None
        self.heard: list[tuple[str, bool, int]] = []

    def dead_lettered(self, delivery: Delivery, job_id: str) -> None:
        assert self.processor is not None
        settled = delivery.settled  # (still leased: it is extended)
        self.heard.append((job_id, settled, self.processor.give_back([delivery], force=True)))


def test_a_message_whose_failure_record_is_out_is_acked_even_as_a_drain_ends() -> None:
    # Given a job that always fails, and a middleware that hears its record is out while the
    # end of a drain gives back whatever is held
    jobs = Registry()

    @jobs.job("t.bad")
    def bad(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise PermanentError("never")

    acks, records, hearing = FakeAcks(), FakeDeadLetters(), _DrainEndsWhileHeard()
    processor = Processor(
        jobs, acks, FakeLeaser(), records, [hearing], ProcessorSettings(BACKOFF)
    )  # fmt: skip
    hearing.processor = processor
    # When it runs and is dead-lettered
    processor.process(make_delivery(b"{}", {"job": "t.bad", "job_id": "j1"}))
    # Then the middleware heard it with the message still leased; the drain could not take
    # it, and its run acked it: one record, one ack, no nack
    assert hearing.heard == [("j1", False, 0)]
    assert len(records.records) == 1 and acks.acked == ["ack-m-1"] and acks.modacked == []
    assert processor.stats == {"dead_lettered": 1}


@dataclass
class _AcksSeeingLeases(FakeAcks):
    """Records, as each ack or nack is queued, whether the leaser still held its message."""

    leaser: Leaser | None = None
    held_when_queued: dict[str, bool] = dataclasses.field(default_factory=dict)

    def _seen(self, ack_ids: list[str]) -> None:
        assert self.leaser is not None
        holding = {d.ack_id for d in self.leaser.holding()}
        self.held_when_queued.update((a, a in holding) for a in ack_ids)

    def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
        self._seen([ack_id])
        return super().ack(ack_id, confirm=confirm)

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        self._seen(ack_ids)
        super().modack(ack_ids, seconds)


def test_a_message_stays_held_until_its_ack_or_nack_is_queued() -> None:
    # Given a processor whose leaser holds three messages: one whose job succeeds, one whose
    # job fails (a nack), one given back before it starts
    jobs = Registry()
    jobs.job("t.ok")(lambda ctx, payload: None)

    @jobs.job("t.fails")
    def fails(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RetryableError("later")

    acks = _AcksSeeingLeases()
    leaser = acks.leaser = Leaser(acks, granted=600)
    processor = Processor(jobs, acks, leaser, FakeDeadLetters(), (), ProcessorSettings(BACKOFF))
    ok, failing, unstarted = (
        make_delivery(b"{}", {"job": name}, message_id=name)
        for name in ("t.ok", "t.fails", "t.unstarted")
    )
    leaser.add([ok, failing, unstarted])
    # When they are settled
    processor.process(ok)
    processor.process(failing)
    processor.give_back([unstarted])
    # Then each was still held when its ack or nack was queued (a drain that finds nothing
    # held has every ack queued before it flushes them), and none is held after
    assert acks.held_when_queued == {"ack-t.ok": True, "ack-t.fails": True, "ack-t.unstarted": True}
    assert leaser.holding() == []


@dataclass
class _AcksRefusingNacks(FakeAcks):
    """A nack cannot be queued (a bug in the queuing)."""

    def modack(self, ack_ids: list[str], seconds: float) -> None:
        raise RuntimeError("cannot queue")


def test_a_message_whose_nack_cannot_be_queued_is_not_held_for_good() -> None:
    # Given a processor whose nacks cannot be queued, and two held messages: one whose job
    # fails, one given back before it starts
    jobs = Registry()

    @jobs.job("t.fails")
    def fails(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RetryableError("later")

    acks = _AcksRefusingNacks()
    leaser = Leaser(acks, granted=600)
    processor = Processor(jobs, acks, leaser, FakeDeadLetters(), (), ProcessorSettings(BACKOFF))
    failing, unstarted = (
        make_delivery(b"{}", {"job": name}, message_id=name) for name in ("t.fails", "t.x")
    )
    leaser.add([failing, unstarted])
    # When they are settled, and queuing their nacks fails
    with pytest.raises(RuntimeError, match="cannot queue"):
        processor.process(failing)
    with pytest.raises(RuntimeError, match="cannot queue"):
        processor.give_back([unstarted])
    # Then neither is held any more (a drain would wait for them until its deadline): their
    # leases lapse and they come back
    assert leaser.holding() == []


def test_a_deferral_by_a_delay_that_is_no_number_of_seconds_is_refused() -> None:
    for delay in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number of seconds"):
            Defer("later", delay=delay)


def test_a_release_that_raises_after_a_hand_back_is_logged_and_the_others_are_still_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given two messages taken by one hand-back, whose runs ended meanwhile and left their
    # release for when it is done, the first's release raising (a bug)
    first, second = (
        make_delivery(b"{}", {"job": "t.x", "job_id": f"j{i}"}, message_id=f"m{i}") for i in (1, 2)
    )
    released: list[Delivery] = []

    def broken(delivery: Delivery) -> None:
        raise RuntimeError("a bug")

    assert first.take_back() and second.take_back()
    assert first.leave_after(broken) and second.leave_after(released.append)
    # When the hand-back finishes each, on its thread
    with caplog.at_level(logging.ERROR):
        for delivery in (first, second):
            Processor._finish_hand_back(delivery)
    # Then the failure is logged, not raised, the second is still released, and both are
    # done: a release left for later now goes on at once
    assert released == [second]
    assert "releasing m1 after its hand-back failed" in caplog.text
    assert not first.leave_after(released.append) and not second.leave_after(released.append)


def test_a_jobs_own_log_lines_are_named_after_it_and_carry_its_job_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs = Registry()
    jobs.job("t.logs")(lambda ctx, payload: ctx.logger.info("step %d", 1))
    jobs.job("t.quiet")(lambda ctx, payload: None)
    processor = Processor(jobs, FakeAcks(), FakeLeaser(), FakeDeadLetters(), [])
    with caplog.at_level(logging.INFO, logger="workerpool.job"):
        for name, job_id in [("t.logs", "j-1"), ("t.quiet", "j-2"), ("t.logs", "j-3")]:
            processor.process(make_delivery(b"{}", {"job": name, "job_id": job_id}))
    lines = [(r.name, r.getMessage(), getattr(r, "job_id", None)) for r in caplog.records]
    assert lines == [("workerpool.job.t.logs", "step 1", "j-1"),
                     ("workerpool.job.t.logs", "step 1", "j-3")]  # fmt: skip


class _Noted(Middleware):
    """Keeps a weak reference to every run it sees."""

    def __init__(self) -> None:
        self.runs: list[weakref.ref[Run]] = []

    def before(self, run: Run) -> None:
        self.runs.append(weakref.ref(run))


def test_a_run_that_never_started_its_handler_is_not_kept_once_it_ends() -> None:
    # Given runs whose timeout passes in the middleware before their handler starts
    jobs, started = Registry(), []
    jobs.job("t.late", timeout=0.05)(lambda ctx, payload: started.append(1))
    noted = _Noted()
    with _time_limited(jobs, before=[noted], after=[_SlowBefore()]) as processor:
        # When they run and end
        for _ in range(2):
            processor.process(make_delivery(b"{}", {"job": "t.late"}))
    gc.collect()
    # Then they never started, and nothing holds them any more
    assert started == [] and processor.stats == {"retried": 2}
    assert [ref() for ref in noted.runs] == [None, None]


class _WaitsBefore(Middleware):
    """Outside the time limit: takes ``seconds`` before the rest (a wait for a token)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def before(self, run: Run) -> None:
        time.sleep(self.seconds)


def test_the_timeout_counts_from_the_time_limit_not_from_the_middleware_before_it() -> None:
    # Given a job of a 0.3 s timeout behind a middleware that takes 0.5 s before the limit
    jobs, told, waited = Registry(), list[bool](), list[float]()

    @jobs.job("t.patient", timeout=0.3)
    def patient(ctx: JobContext, payload: dict[str, Any]) -> None:
        started = time.monotonic()
        told.append(ctx.cancelled.wait(0.1))  # not told at once
        told.append(ctx.cancelled.wait(10) and ctx.timed_out.is_set())
        waited.append(time.monotonic() - started)

    with _time_limited(jobs, before=[_WaitsBefore(0.5)]) as processor:
        # When it runs
        processor.process(make_delivery(b"{}", {"job": "t.patient"}))
    # Then its handler starts, and is told of the timeout 0.3 s after the limit, not at once
    assert told == [False, True] and waited[0] >= 0.25


def test_a_callback_that_raises_on_one_runs_timeout_leaves_the_next_runs_limit_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given runs whose handler adds a callback on its cancel that raises
    jobs, told = Registry(), []

    @jobs.job("t.hooked", timeout=0.1)
    def hooked(ctx: JobContext, payload: dict[str, Any]) -> None:
        ctx.cancelled.when_set(lambda: 1 / 0)
        told.append(ctx.cancelled.wait(10) and ctx.timed_out.is_set())

    with _time_limited(jobs) as processor, caplog.at_level(logging.ERROR):
        # When two run one after the other
        for _ in range(2):
            processor.process(make_delivery(b"{}", {"job": "t.hooked"}))
    # Then each is told of its timeout, and the callback's failure is logged
    assert told == [True, True]
    assert sum("a callback on its timeout failed" in r.getMessage() for r in caplog.records) == 2
