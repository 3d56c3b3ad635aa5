"""Hostile input through the processor with in-process fakes (unit tier, no emulator).

Every message ends in exactly one of: its handler ran once, or one failure record was written;
either way it is acked once. Neither decode nor the failure-record builder ever raises.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from google.cloud.pubsub_v1.publisher.exceptions import MessageTooLargeError
from google.pubsub_v1 import types as pubsub_types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import hostile
from tests.hostile import RUN, Case, Target, TypedJob
from workerpool import constants as c
from workerpool.ops.dlq import FailureRecord
from workerpool.registry import Registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import Job, Rejection, decode
from workerpool.worker.failures import (
    DeadLetterPublisher,
    Failure,
    failure_attributes,
    fit_record,
    publish_request_size,
)
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.text import truncate_utf8

BACKOFF = Backoff(minimum=1.0, maximum=60.0)
LIMIT = 600_000  # max_payload_bytes of most tests: room for 100k levels of nesting
DLQ_TOPIC = "projects/workerpool-test/topics/dlq-hostile"


@dataclass
class Item:
    name: str
    count: int


@dataclass
class Reading:
    x: float = 0.0
    mode: Literal[0, 1] = 0
    low: int = 0
    high: int = 0

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high is below low")


@dataclass
class Node:
    children: list[Node]


ITEM = TypedJob(
    "t.item",
    valid=(
        '{"name": "a", "count": 1}',
        '{"count": -0, "name": ""}',
        '{"name": "\\ud800", "count": 0}',
        '{"name": "\\u0000\\udfff\\ud800", "count": ' + "9" * 4300 + "}",
        '{"name": "x", "name": "y", "count": 1}',
        '{"name": 1, "name": "ok", "count": 2}',
        '{"\\u006eame": "a", "c\\u006funt": 1}',
        '{"name": "😀\x7f\u2028", "count": -1}',
    ),
    invalid=(
        "{}",
        '{"name": "a"}',
        '{"count": 1}',
        '{"name": "a", "count": "1"}',
        '{"name": "a", "count": 1.0}',
        '{"name": "a", "count": 1e0}',
        '{"name": "a", "count": -0.0}',
        '{"name": "a", "count": true}',
        '{"name": "a", "count": false}',
        '{"name": "a", "count": null}',
        '{"name": null, "count": 1}',
        '{"name": 1, "count": 1}',
        '{"name": ["a"], "count": 1}',
        '{"name": {"a": 1}, "count": 1}',
        '{"name": "a", "count": [1]}',
        '{"name": "a", "count": 1, "extra": 1}',
        '{"name": "a", "count": 1, "\\ud800": 1}',
        '{"name": "a", "count": 1, "": 1}',
        '{"name": "ok", "count": 1, "count": "dup"}',
        '{"Name": "a", "count": 1}',
        '{"name ": "a", "count": 1}',
        '{"name": "a", "count": 1, "' + "k" * 100_000 + '": 1}',
    ),
)
READING = TypedJob(
    "t.reading",
    valid=(
        "{}",
        '{"x": 1}',
        '{"x": -0}',
        '{"x": 1e308, "mode": 1}',
        '{"x": 5e-324, "mode": 0}',
        '{"x": ' + "9" * 300 + "}",
        '{"low": 1, "high": 1}',
    ),
    invalid=(
        '{"x": ' + "9" * 400 + "}",  # an integer no float holds
        '{"x": -' + "9" * 4300 + "}",
        '{"x": true}',
        '{"x": "1"}',
        '{"x": null}',
        '{"x": [1]}',
        '{"mode": true}',  # True == 1, yet not the literal 1
        '{"mode": false}',
        '{"mode": 1.0}',
        '{"mode": 2}',
        '{"mode": "1"}',
        '{"low": 2, "high": 1}',  # refused by __post_init__
    ),
)
TREE = TypedJob(
    "t.tree",
    valid=('{"children": []}', '{"children": [{"children": []}, {"children": []}]}'),
    invalid=('{"children": [1]}', '{"children": {}}'),
)
# Parses (600 levels), but converting it takes ~4 frames a level: past the default recursion
# limit, which hypothesis raises while a test runs (so only plain tests use it).
TREE_TOO_DEEP = '{"children": [' * 300 + '{"children": []}' + "]}" * 300
UNIT = Target("t.ok", (ITEM, READING, TREE), max_payload_bytes=LIMIT)


def registry(runs: list[Any]) -> Registry:
    jobs = Registry()
    jobs.job("t.ok")(lambda ctx, payload: runs.append(payload))
    jobs.job("t.item", payload=Item)(lambda ctx, payload: runs.append(payload))
    jobs.job("t.reading", payload=Reading)(lambda ctx, payload: runs.append(payload))
    jobs.job("t.tree", payload=Node)(lambda ctx, payload: runs.append(payload))
    return jobs


@dataclass
class Harness:
    processor: Processor
    acks: FakeAcks
    dead_letters: FakeDeadLetters
    runs: list[Any]


def harness(
    max_payload_bytes: int = LIMIT, jobs: Registry | None = None, runs: list[Any] | None = None
) -> Harness:
    runs = [] if runs is None else runs
    acks, dead_letters = FakeAcks(), FakeDeadLetters()
    processor = Processor(
        registry(runs) if jobs is None else jobs,
        acks,
        FakeLeaser(),
        dead_letters,
        (),
        ProcessorSettings(backoff=BACKOFF, max_payload_bytes=max_payload_bytes),
    )
    return Harness(processor, acks, dead_letters, runs)


def check_record(delivery: Delivery, failure: Failure) -> dict[str, str]:
    """The record builder's promises, for one failure."""
    record = failure_attributes(delivery, failure, subscription="s", topic="t", worker="w")
    assert len(record) <= c.MAX_ATTRIBUTES
    for key, value in record.items():
        assert len(value.encode("utf-8")) <= c.MAX_ATTRIBUTE_VALUE_BYTES, key
        key.encode("utf-8")
    assert record[c.ATTR_ERROR_TYPE] == truncate_utf8(failure.error_type)
    for key in (c.ATTR_JOB, c.ATTR_JOB_ID):  # the priority originals survive the cut to 100
        if delivery.attributes.get(key):
            assert key in record
    # Never what Pub/Sub alone sets as it forwards a message (a replay would read it so)
    assert not [k for k in record if k.startswith(c.ATTR_PUBSUB_DEAD_LETTER_PREFIX)]
    assert record[c.ATTR_SOURCE_TOPIC] == "t"
    return record


def run_one(h: Harness, data: bytes, attributes: dict[str, str], **kw: Any) -> str:
    """Process one message; return "run" or its record's error_type, checking that it was
    exactly one of them, acked once."""
    before_runs, before_records = len(h.runs), len(h.dead_letters.records)
    message_id = f"m-{len(h.acks.acked) + len(h.acks.modacked)}"
    h.processor.process(make_delivery(data, attributes, message_id=message_id, **kw))
    runs = len(h.runs) - before_runs
    records = h.dead_letters.records[before_records:]
    assert runs + len(records) == 1, (runs, records)
    assert h.acks.acked[-1:] == [f"ack-{message_id}"] and h.acks.modacked == []
    if runs:
        return RUN
    [(delivery, failure)] = records
    check_record(delivery, failure)
    return failure.error_type


UNIT_SETTINGS = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@UNIT_SETTINGS
@given(case=hostile.cases(UNIT, large=LIMIT + 10_000))
def test_every_hostile_message_ends_in_its_one_expected_outcome(case: Case) -> None:
    # Given a message from the grammar, When it is processed, Then it ran once or got one
    # record, of the error type the grammar expects
    assert run_one(harness(), case.data, case.attributes) == case.expected, case.kind


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=hostile.soup_bodies,
    attributes=hostile.soup_attributes,
    attempt=st.one_of(st.none(), st.integers(1, 9)),
)
def test_arbitrary_bytes_and_attributes_end_in_exactly_one_outcome(
    body: bytes, attributes: dict[str, str], attempt: int | None
) -> None:
    outcome = run_one(harness(), body, attributes, attempt=attempt)
    assert outcome in {RUN, c.ERR_NOT_JSON, c.ERR_NOT_OBJECT, c.ERR_MISSING_JOB,
                       c.ERR_UNKNOWN_JOB, c.ERR_INVALID_PAYLOAD, c.ERR_OVERSIZE}  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=hostile.cases(UNIT, large=LIMIT + 10_000))
def test_decode_never_raises(case: Case) -> None:
    jobs = registry([])
    for limit in (0, LIMIT, c.MAX_MESSAGE_BYTES):
        decoded = decode(make_delivery(case.data, case.attributes), jobs, attempt=1,
                         max_payload_bytes=limit)  # fmt: skip
        assert isinstance(decoded, Job | Rejection)
        if isinstance(decoded, Rejection):
            decoded.error_message.encode("utf-8")
            assert len(decoded.error_message.encode()) <= c.MAX_ATTRIBUTE_VALUE_BYTES


any_text = st.text(st.characters(exclude_categories=()), max_size=3000)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    original=st.dictionaries(
        hostile.publishable_text.filter(lambda k: k != ""), hostile.publishable_text,
        max_size=c.MAX_ATTRIBUTES,
    ),
    error_type=any_text,
    error_message=any_text,
    job=any_text,
    job_id=any_text,
    attempt=st.integers(-(2**63), 2**63),
)  # fmt: skip
def test_the_record_builder_never_raises_and_keeps_to_the_limits(
    original: dict[str, str], error_type: str, error_message: str, job: str, job_id: str,
    attempt: int,
) -> None:  # fmt: skip
    # Given any original attributes and any failure text, lone surrogates included
    delivery = make_delivery(b"x", original)
    failure = Failure(error_type, error_message, job, job_id, attempt)
    # When its record is built, Then it keeps Pub/Sub's limits and encodes as UTF-8
    record = check_record(delivery, failure) if error_type else None
    if record is not None:
        assert record[c.ATTR_ERROR_TYPE].encode()


def test_a_seeded_stream_of_every_kind_ends_as_the_grammar_expects() -> None:
    # Given 2,000 hostile messages of every kind from a seed
    h = harness()
    cases = hostile.generate(UNIT, 2000, seed=8259, small=4096, large=LIMIT + 10_000)
    # When they are processed one after the other
    outcomes: Counter[str] = Counter()
    for case in cases:
        outcome = run_one(h, case.data, case.attributes)
        # Then each ends as expected
        assert outcome == case.expected, (case.kind, case.data[:200], case.attributes)
        outcomes[outcome] += 1
    print(dict(outcomes))
    assert set(outcomes) == {RUN, c.ERR_NOT_JSON, c.ERR_NOT_OBJECT, c.ERR_MISSING_JOB,
                             c.ERR_UNKNOWN_JOB, c.ERR_INVALID_PAYLOAD, c.ERR_OVERSIZE}  # fmt: skip
    assert len(h.acks.acked) == len(cases) and h.processor.stats["dead_lettered"] == sum(
        n for outcome, n in outcomes.items() if outcome != RUN
    )


def test_every_listed_edge_case_ends_as_expected() -> None:
    # Given every catalogued body, for the dict job and each typed job
    h = harness(max_payload_bytes=c.MAX_MESSAGE_BYTES)
    table: list[tuple[str, bytes, str]] = []
    for body in hostile.NOT_JSON + hostile.DEEP_NOT_JSON:
        table += [(job, body, c.ERR_NOT_JSON) for job in ("t.ok", "t.item")]
    for body in hostile.NOT_OBJECT:
        table += [(job, body, c.ERR_NOT_OBJECT) for job in ("t.ok", "t.item")]
    table += [("t.ok", text.encode(), RUN) for text in hostile.OBJECTS]
    for typed in UNIT.typed:
        table += [(typed.name, text.encode(), RUN) for text in typed.valid]
        table += [(typed.name, text.encode(), c.ERR_INVALID_PAYLOAD) for text in typed.invalid]
    table.append(("t.tree", TREE_TOO_DEEP.encode(), c.ERR_INVALID_PAYLOAD))
    # When each is processed, Then it ends as the table says
    wrong = [
        (job, body[:80], expected, outcome)
        for job, body, expected in table
        if (outcome := run_one(h, body, {"job": job, "job_id": "j"})) != expected
    ]
    assert wrong == []


def test_a_converter_crash_is_a_failure_record_not_an_escape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a payload class whose annotation cannot be resolved (a class local to a function)
    @dataclass
    class Inner:
        value: int

    @dataclass
    class Outer:
        inner: Inner

    runs: list[Any] = []
    jobs = registry(runs)
    jobs.job("t.local", payload=Outer)(lambda ctx, payload: runs.append(payload))
    h = harness(jobs=jobs, runs=runs)
    # When a message for it is processed
    with caplog.at_level(logging.ERROR, logger="workerpool.worker.envelope"):
        outcome = run_one(h, b'{"inner": {"value": 1}}', {"job": "t.local"})
    # Then it gets one invalid_payload record, and the log says what broke
    assert outcome == c.ERR_INVALID_PAYLOAD
    assert "t.local" in caplog.text and "NameError" in caplog.text


class SizeCheckingPublisher:
    """Refuses what google-cloud-pubsub refuses: a publish request over 10,000,000 bytes."""

    def __init__(self) -> None:
        self.published: list[tuple[bytes, dict[str, str]]] = []

    def publish(self, topic: str, data: bytes, ordering_key: str = "", **attributes: str) -> Any:
        message = pubsub_types.PubsubMessage(data=data, attributes=attributes)
        size = pubsub_types.PublishRequest(topic=topic, messages=[message])._pb.ByteSize()
        assert publish_request_size(topic, data, attributes) >= size
        if size > c.MAX_PUBLISH_REQUEST_BYTES:
            raise MessageTooLargeError(f"{size} bytes")
        self.published.append((data, attributes))
        return Done(str(len(self.published)))


@dataclass
class Done:
    value: str

    def result(self, timeout: float | None = None) -> str:
        return self.value


def big_attributes(count: int) -> dict[str, str]:
    return {f"x{i:02}": hostile.fill_utf8("", 1024, "é") for i in range(count)}


@pytest.mark.parametrize(
    ("size", "attributes", "expected"),
    [
        (c.MAX_MESSAGE_BYTES, {}, RUN),
        (c.MAX_MESSAGE_BYTES + 1, {}, c.ERR_OVERSIZE),
        (10_000_000 - 200, {}, c.ERR_NOT_JSON),  # fits Pub/Sub; its record would not
        (10_000_000 - 60_000, big_attributes(60), c.ERR_NOT_JSON),
        (10 * 1024 * 1024, big_attributes(97), c.ERR_NOT_JSON),
    ],
    ids=["10MiB-object", "10MiB+1", "10MB-200-junk", "attributes-make-room", "data-is-cut"],
)
def test_messages_up_to_10_mb_end_in_one_outcome_and_their_record_fits_pubsub(
    size: int, attributes: dict[str, str], expected: str
) -> None:
    # Given the default payload limit and a dead-letter publisher with Pub/Sub's size check
    runs: list[Any] = []
    publisher = SizeCheckingPublisher()
    acks = FakeAcks()
    dead_letters = DeadLetterPublisher(
        publisher, DLQ_TOPIC, subscription="projects/p/subscriptions/s", source_topic="t",
        worker="w",
    )  # fmt: skip
    processor = Processor(
        registry(runs), acks, FakeLeaser(), dead_letters, (),
        ProcessorSettings(backoff=BACKOFF),
    )  # fmt: skip
    job = "t.ok" if expected == RUN else "t.item"
    data = (
        hostile.fill_utf8('{"a": "', size - 2, "😀").encode() + b'"}'
        if expected == RUN
        else b"\xff" * size
    )
    # When a message of that size is processed
    processor.process(make_delivery(data, {"job": job, "job_id": "big", **attributes}))
    # Then it ran, or its failure record was published (cut to fit if it had to be); acked
    assert acks.acked == ["ack-m-1"] and acks.modacked == []
    if expected == RUN:
        assert len(runs) == 1 and publisher.published == []
        return
    [(record_data, record)] = publisher.published
    assert record[c.ATTR_ERROR_TYPE] == expected and record[c.ATTR_JOB_ID] == "big"
    fits_whole = size + 2000 + 1100 * len(attributes) < c.MAX_PUBLISH_REQUEST_BYTES
    assert (record_data == data) == fits_whole or "data" in record[c.ATTR_ERROR_MESSAGE]
    # A record whose data was cut says how long it was (a replay must not send the part)
    assert record.get(c.ATTR_DATA_CUT) == (None if record_data == data else str(len(data)))
    assert all(len(v.encode()) <= c.MAX_ATTRIBUTE_VALUE_BYTES for v in record.values())


def test_a_record_never_passes_for_one_pub_sub_forwarded_whatever_its_publisher_set() -> None:
    # Given a message whose publisher set what Pub/Sub sets as it forwards a message to a
    # dead-letter topic, naming another subscription, and a source topic of its own
    forged = {
        c.ATTR_JOB: "t.ok",
        c.ATTR_PUBSUB_DELIVERY_COUNT: "5",
        c.ATTR_PUBSUB_SOURCE_SUBSCRIPTION: "victim-sub",
        c.ATTR_PUBSUB_SOURCE_PROJECT: "p",
        c.ATTR_SOURCE_TOPIC: "projects/p/topics/victim",
    }
    failure = Failure("handler_error", "boom", "t.ok", "j-1", 1)
    # When its failure record is written, then it is this worker's record, of this topic
    record = check_record(make_delivery(b"{}", forged), failure)
    assert FailureRecord("ack", "m", b"{}", record).forwarded_by_policy is False


@pytest.mark.parametrize("originals", [10, 95])
def test_a_record_near_the_limit_cuts_its_data_only_when_it_must_and_keeps_100_attributes(
    originals: int,
) -> None:
    # Given messages of many attributes, whose data comes within a few bytes to a few
    # thousand bytes of a publish request's limit once the failure attributes are added, or
    # over it alone
    attributes = {f"attribute-{i:03d}": "v" * 20 for i in range(originals)}
    attributes[c.ATTR_JOB] = "t.item"
    failure = Failure("handler_error", "boom", "t.item", "j-1", 5)
    topic = "projects/p/topics/dlq"
    base = c.MAX_PUBLISH_REQUEST_BYTES - 2000 - 30 * originals
    for size in [*range(base, base + 3000, 13), c.MAX_PUBLISH_REQUEST_BYTES - 100]:
        data = b"x" * size
        record = failure_attributes(
            make_delivery(data, attributes), failure, subscription="s", topic="t", worker="w"
        )
        # When the record is made to fit
        cut, fitted = fit_record(topic, data, record)
        # Then it fits, with at most 100 attributes, and says when its data was cut
        assert publish_request_size(topic, cut, fitted) <= c.MAX_PUBLISH_REQUEST_BYTES
        assert len(fitted) <= c.MAX_ATTRIBUTES
        assert (c.ATTR_DATA_CUT in fitted) == (cut != data)
        ours = {k: v for k, v in fitted.items() if k in (*c.FAILURE_ATTRIBUTES, "job", "job_id")}
        ours.pop(c.ATTR_DATA_CUT, None)
        if cut != data:
            # ... cut only where the data whole does not fit even beside our attributes alone
            assert publish_request_size(topic, data, ours) > c.MAX_PUBLISH_REQUEST_BYTES, size
            continue
        # ... and whole, having left out no more original attributes than it had to
        left_out = sorted(k for k in record if k not in fitted)
        if left_out:
            one_back = {**fitted, left_out[0]: record[left_out[0]]}
            assert publish_request_size(topic, data, one_back) > c.MAX_PUBLISH_REQUEST_BYTES, size
