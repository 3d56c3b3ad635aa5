"""Delayed jobs, the pure parts: the not_before attribute, the schedule stores (memory, SQLite
and Firestore on its emulator run the same suite), the firer and the middleware."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import Confirmed, FakeClock, PausingPublisher, through
from tests.support import store_handles, wait_for
from workerpool import constants as c
from workerpool.cli import main
from workerpool.constants import Label
from workerpool.context import Flag, JobContext
from workerpool.registry import JobSpec
from workerpool.schedule import (
    Entry,
    MemorySchedule,
    ScheduleStore,
    SqliteSchedule,
    delays,
    not_before_text,
    parse_not_before,
    schedule_opener,
)
from workerpool.schedule.delays import Delays, Firer
from workerpool.schedule.firestore import FirestoreSchedule
from workerpool.schedule.when import parse_delay
from workerpool.stores import StoreUnavailable
from workerpool.testing.emulator import free_port
from workerpool.testing.fakes import make_delivery
from workerpool.worker.backoff import Backoff
from workerpool.worker.envelope import Job
from workerpool.worker.failures import publish_request_size
from workerpool.worker.outcome import (
    Ack,
    Deferred,
    Facts,
    Outcome,
    Rejected,
    Scheduled,
    Succeeded,
    decide,
)
from workerpool.worker.renewal import Renewer
from workerpool.worker.run import Run

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TOPIC = "projects/p/topics/t"


def test_not_before_is_an_absolute_utc_time_at_most_a_year_ahead() -> None:
    assert not_before_text(timedelta(seconds=90), NOW) == "2026-12-01T12:01:30.000Z"
    tokyo = datetime(2026, 12, 24, 9, 0, tzinfo=timezone(timedelta(hours=9)))
    assert not_before_text(tokyo, NOW) == "2026-12-24T00:00:00.000Z"
    assert parse_not_before("2026-12-01T12:01:30.000Z", NOW) == NOW.timestamp() + 90
    assert not_before_text(timedelta(days=2), NOW) == "2026-12-03T12:00:00.000Z"
    for bad, says in (
        (datetime(2026, 12, 24, 9, 0), "has no timezone"),
        (timedelta(days=366), "more than 365 days ahead"),
    ):
        with pytest.raises(ValueError, match=says):
            not_before_text(bad, NOW)
    for text, says in (
        ("tomorrow", "not an RFC 3339 time"),
        ("2026-12-24T09:00:00", "has no timezone"),
        ("2028-12-24T09:00:00Z", "more than 365 days ahead"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_not_before(text, NOW)
    assert [parse_delay(t).total_seconds() for t in ("90s", "5m", "2h", "1.5d")] == [
        90,
        300,
        7200,
        129600,
    ]
    with pytest.raises(ValueError, match="not a number of s, m, h or d"):
        parse_delay("90")


def test_not_before_is_strict_rfc3339_and_at_most_365_days_ahead_to_the_second() -> None:
    # Given RFC 3339 section 5.6 date-times: T or t, Z or z or a numeric offset, any fraction
    for text, utc in (
        ("2026-12-24t09:00:00z", "2026-12-24T09:00:00.000Z"),
        ("2026-12-24T10:00:00.5+01:00", "2026-12-24T09:00:00.500Z"),
        ("2026-12-24T09:00:00.123456789-00:00", "2026-12-24T09:00:00.123Z"),
        ("2026-12-31T23:59:60Z", "2027-01-01T00:00:00.000Z"),  # a leap second
    ):
        # Then each is read as the instant it names
        assert not_before_text(datetime.fromtimestamp(parse_not_before(text, NOW), UTC)) == utc
    # Given ISO 8601 forms that are not RFC 3339, and impossible times: each refused, saying why
    for text, says in (
        ("2026-W52-4T09:00Z", "not an RFC 3339 time"),
        ("20261224T090000Z", "not an RFC 3339 time"),
        ("2026-12-24T09:00Z", "not an RFC 3339 time"),  # seconds are required
        ("2026-12-24 09:00:00Z", "not an RFC 3339 time"),
        ("2026-12-24T09:00:00+0100", "not an RFC 3339 time"),
        ("2026-12-24T09:00:00+01", "not an RFC 3339 time"),
        ("\uff12026-12-24T09:00:00Z", "not an RFC 3339 time"),  # a fullwidth digit
        ("2026-12-24T09:00:00", "has no timezone"),
        ("2026-02-30T09:00:00Z", "day is out of range"),
        ("2026-12-24T24:00:00Z", "hour must be in 0..23"),
        ("2026-12-24T09:00:00+24:00", "offset is not within"),
        ("9999-12-31T23:59:60Z", "not a valid time"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_not_before(text, NOW)
    # Given times around 365 days ahead: the bound is exact, publishing and at the worker
    year = timedelta(days=365)
    assert not_before_text(year, NOW) == "2027-12-01T12:00:00.000Z"
    assert parse_not_before("2027-12-01T12:00:00Z", NOW) == (NOW + year).timestamp()
    for ahead in (timedelta(milliseconds=1), timedelta(hours=23)):
        with pytest.raises(ValueError, match="more than 365 days ahead"):
            not_before_text(year + ahead, NOW)
        with pytest.raises(ValueError, match="more than 365 days ahead"):
            parse_not_before(not_before_text(year, NOW + ahead), NOW)
    # Given values too big for a datetime: refused as ValueErrors, never an OverflowError
    with pytest.raises(ValueError, match="more than 365 days ahead"):
        not_before_text(timedelta.max, NOW)
    with pytest.raises(ValueError, match="out of range"):
        parse_delay("99999999999999999999d")
    with pytest.raises(ValueError, match="out of range"):
        not_before_text(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))), NOW)


def test_a_not_before_beyond_the_bound_at_the_worker_is_rejected_not_scheduled() -> None:
    # Given a worker whose clock says NOW, and messages 365 days and 365 days 23 hours ahead
    clock = FakeClock(NOW.timestamp())
    store = MemorySchedule()
    delays = Delays(TOPIC, store, Firer(store, TOPIC, Publisher(), clock=clock), clock=clock)
    year = not_before_text(timedelta(days=365), NOW)
    beyond = not_before_text(timedelta(days=365), NOW + timedelta(hours=23))
    # When each arrives
    kept = through(delays, _run({c.ATTR_NOT_BEFORE: year}), lambda run: Succeeded())
    refused = through(delays, _run({c.ATTR_NOT_BEFORE: beyond}), lambda run: Succeeded())
    # Then the first waits in the schedule, the second is one failure record (then ack)
    assert kept == Scheduled(year) and len(store.entries()) == 1
    assert isinstance(refused, Rejected) and refused.error_type == c.ERR_INVALID_NOT_BEFORE
    assert "more than 365 days ahead" in refused.error_message


StoreFactory = Callable[[], ScheduleStore]


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    """Handles on one backing schedule, as the workers of a fleet have."""

    def firestore(collection: str) -> ScheduleStore:
        from workerpool.schedule.firestore import FirestoreSchedule

        return FirestoreSchedule(FIRESTORE_PROJECT, collection)

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemorySchedule,
        sqlite=lambda: SqliteSchedule(tmp_path / "s.db"),
        firestore=firestore,
    ) as make:  # fmt: skip
        yield make


def _entry(job_id: str, due: float, topic: str = TOPIC) -> Entry:
    return Entry(topic, job_id, due, b"{}", {c.ATTR_JOB: "t.job", c.ATTR_JOB_ID: job_id})


def test_an_entry_is_scheduled_once_and_claimed_when_due_oldest_first(
    make_store: StoreFactory,
) -> None:
    store, other = make_store(), make_store()
    assert store.add(_entry("b", 20.0)) and store.add(_entry("a", 10.0))
    assert not other.add(_entry("a", 99.0))  # the same job id again: scheduled once
    store.add(_entry("elsewhere", 1.0, topic="projects/p/topics/other"))
    # Nothing is due yet: nothing claimed, and the next is a's
    assert store.claim_due(TOPIC, 5.0, lease=30, limit=10) == ([], 10.0)
    # Both due: claimed oldest first, up to the limit; the rest's next time is b's
    claimed, next_ready = store.claim_due(TOPIC, 25.0, lease=30, limit=1)
    assert [e.job_id for e in claimed] == ["a"] and claimed[0].due == 10.0
    assert next_ready == 20.0
    # A claimed entry is not claimed again until its lease lapses
    assert [e.job_id for e in other.claim_due(TOPIC, 26.0, lease=30, limit=10)[0]] == ["b"]
    assert other.claim_due(TOPIC, 50.0, lease=30, limit=10)[0] == []
    assert [e.job_id for e in store.claim_due(TOPIC, 55.0, lease=30, limit=10)[0]] == ["a"]
    # Fired entries are gone; the schedule lists what is left, soonest due first
    store.fired(TOPIC, ["a"])
    assert [(e.job_id, e.attributes[c.ATTR_JOB]) for e in other.entries()] == [
        ("elsewhere", "t.job"),
        ("b", "t.job"),
    ]
    assert [e.job_id for e in other.entries(TOPIC)] == ["b"]


def test_workers_claiming_at_once_never_claim_one_entry_twice(make_store: StoreFactory) -> None:
    # Given 150 due entries, and 4 workers claiming them at once, 10 at a time
    handles = [make_store() for _ in range(4)]
    for i in range(150):
        handles[i % 4].add(_entry(f"j{i:03}", float(i)))
    claimed: list[str] = []
    lock = threading.Lock()

    def claim(store: ScheduleStore) -> None:
        while True:
            got, _ = store.claim_due(TOPIC, 1000.0, lease=600, limit=10)
            if not got:  # none left unclaimed (no claim lapses within the test)
                return
            with lock:
                claimed.extend(e.job_id for e in got)

    threads = [threading.Thread(target=claim, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then each entry was claimed by one of them, once
    assert sorted(claimed) == [f"j{i:03}" for i in range(150)]


def test_a_message_too_big_for_one_document_is_kept_whole(make_store: StoreFactory) -> None:
    # Given a delayed message of 3 MB (Pub/Sub takes 10 MB; a Firestore document 1 MiB)
    store, other = make_store(), make_store()
    data = bytes(range(256)) * (3 * 4096 + 7)
    entry = Entry(TOPIC, "big", 10.0, data, {c.ATTR_JOB: "t.job", c.ATTR_JOB_ID: "big"})
    assert store.add(entry)
    # When a duplicate with other data comes, then it is claimed, published and removed
    assert not other.add(replace(entry, data=b"other" * 300_000))
    assert other.entries() == [entry]
    assert other.claim_due(TOPIC, 20.0, lease=30, limit=10) == ([entry], 50.0)
    other.fired(TOPIC, ["big"])
    # Then the first was kept whole, and nothing of either is left
    assert store.entries() == []
    if isinstance(store, FirestoreSchedule):
        assert list(store._ref(TOPIC, "big").collection("parts").stream()) == []


class Publisher:
    """Records what is published; fails the first publish of each job id in ``failing``."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.published: list[tuple[str, float]] = []
        self._failing = set(failing)
        self.lock = threading.Lock()

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        future: Future[str] = Future()
        job_id = attributes[c.ATTR_JOB_ID]
        with self.lock:
            if job_id in self._failing:
                self._failing.discard(job_id)
                future.set_exception(RuntimeError("unavailable"))
                return future
            self.published.append((job_id, time.time()))
        future.set_result(f"m-{job_id}")
        return future


def test_the_firer_publishes_each_entry_when_due_never_before(tmp_path: Path) -> None:
    # Given entries due over the next second, one added by another worker (not expected)
    store, publisher = SqliteSchedule(tmp_path / "s.db"), Publisher()
    firer = Firer(store, TOPIC, publisher, reread=0.3)
    start = time.time()
    dues = {f"j{i}": start + 0.2 * i for i in range(1, 6)}
    for job_id, due in dues.items():
        store.add(_entry(job_id, due))
        if job_id != "j3":
            firer.expect(due)
    firer.start()
    try:
        deadline = time.monotonic() + 10
        while len(publisher.published) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        firer.stop(5)
    # Then each was published once, in the order they fell due, none before its time (how
    # late is bench.batches's to measure)
    assert [job_id for job_id, _ in publisher.published] == sorted(dues, key=dues.__getitem__)
    assert all(at >= dues[job_id] for job_id, at in publisher.published)
    assert store.entries() == []
    store.close()


class _Broken(MemorySchedule):
    """A schedule whose reads fail with ``error`` the first ``times`` times."""

    def __init__(self, error: Exception, times: int) -> None:
        super().__init__()
        self._error, self._left = error, times

    def claim_due(
        self, topic: str, now: float, lease: float, limit: int
    ) -> tuple[list[Entry], float | None]:
        if self._left:
            self._left -= 1
            raise self._error
        return super().claim_due(topic, now, lease, limit)


@pytest.mark.parametrize("error", [StoreUnavailable("locked"), RuntimeError("a bug")])
def test_the_firer_survives_a_failing_store_and_fires_once_it_answers(error: Exception) -> None:
    store, publisher = _Broken(error, times=2), Publisher()
    store.add(_entry("a", time.time()))
    firer = Firer(store, TOPIC, publisher, reread=0.05)
    firer.start()
    try:
        deadline = time.monotonic() + 10
        while not publisher.published and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        firer.stop(5)
    assert [job_id for job_id, _ in publisher.published] == ["a"]


def test_an_entry_not_published_is_fired_again_once_its_claim_lapses() -> None:
    clock = FakeClock(100.0)
    store, publisher = MemorySchedule(), Publisher(failing=frozenset({"a"}))
    store.add(_entry("a", 100.0))
    firer = Firer(store, TOPIC, publisher, clock=clock)
    firer._publish(store.claim_due(TOPIC, clock(), lease=30, limit=10)[0])
    assert publisher.published == [] and [e.job_id for e in store.entries()] == ["a"]
    assert store.claim_due(TOPIC, clock() + 10, lease=30, limit=10)[0] == []  # still claimed
    firer._publish(store.claim_due(TOPIC, clock() + 31, lease=30, limit=10)[0])
    assert [job_id for job_id, _ in publisher.published] == ["a"] and store.entries() == []


def test_an_entry_whose_ordering_key_is_paused_goes_out_at_once_not_a_claim_later() -> None:
    # Given an entry of ordering key k due, the key paused by the client: a publish of it
    # failed after its caller had stopped waiting for it, so nobody resumed it
    clock = FakeClock(100.0)
    store, publisher = MemorySchedule(), PausingPublisher()
    publisher.paused.add("k")
    publisher.answering = True
    attributes = {c.ATTR_JOB: "t.job", c.ATTR_JOB_ID: "a", c.ATTR_ORDERING_KEY: "k"}
    store.add(Entry(TOPIC, "a", 100.0, b"{}", attributes))
    firer = Firer(store, TOPIC, publisher, clock=clock)
    # When it is claimed and published
    firer._publish(store.claim_due(TOPIC, clock(), lease=30, limit=10)[0])
    # Then the key is resumed and the entry goes out now: it is removed, not left to its claim
    assert publisher.paused == set() and store.entries() == []


class _Refusing(Publisher):
    """Raises at once for ``refused`` (a client closed, a message too large), every time."""

    def __init__(self, refused: str) -> None:
        super().__init__()
        self.refused = refused

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
    ) -> Future[str]:
        if attributes[c.ATTR_JOB_ID] == self.refused:
            raise ValueError("refused by the client")
        return super().publish(topic, data, ordering_key, **attributes)


def test_an_entry_the_client_refuses_at_once_holds_up_none_claimed_with_it() -> None:
    # Given three entries due, the oldest of which the client refuses as it is sent
    clock = FakeClock(100.0)
    store, publisher = MemorySchedule(), _Refusing("a")
    for job_id in ("a", "b", "c"):
        store.add(_entry(job_id, 100.0))
    firer = Firer(store, TOPIC, publisher, clock=clock)
    # When they are claimed and published together
    firer._publish(store.claim_due(TOPIC, clock(), lease=30, limit=10)[0])
    # Then the other two are out and removed; the refused one stays, for its claim to lapse
    assert [job_id for job_id, _ in publisher.published] == ["b", "c"]
    assert [e.job_id for e in store.entries()] == ["a"]


def test_entries_pub_sub_does_not_confirm_are_waited_for_one_timeout_in_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given three entries due, and a Pub/Sub that confirms none of them
    monkeypatch.setattr(delays, "_PUBLISH_TIMEOUT", 0.3)
    waits: list[float] = []

    class Unanswering(Publisher):
        def publish(
            self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
        ) -> Future[str]:
            return Confirmed(waits)

    clock = FakeClock(100.0)
    store = MemorySchedule()
    for job_id in ("a", "b", "c"):
        store.add(_entry(job_id, 100.0))
    firer = Firer(store, TOPIC, Unanswering(), clock=clock)
    # When they are claimed and published together
    firer._publish(store.claim_due(TOPIC, clock(), lease=30, limit=10)[0])
    # Then the first is waited for the whole timeout, the others not at all (it is spent),
    # and all three stay, for their claims to lapse
    assert 0 < waits[0] <= 0.3 and waits[1:] == [0.0, 0.0]
    assert sorted(e.job_id for e in store.entries()) == ["a", "b", "c"]


def test_a_delayed_message_whose_copy_would_not_fit_a_publish_is_refused_not_scheduled() -> None:
    # Given a message near Pub/Sub's limit without a job id, not due yet: its copy for the
    # schedule carries its job id written out, which takes it past a publish request's bound
    store = MemorySchedule()
    delays = Delays(TOPIC, store, Firer(store, TOPIC, Publisher()))
    ahead = not_before_text(timedelta(seconds=90))
    attributes = {c.ATTR_JOB: "t.job", c.ATTR_NOT_BEFORE: ahead}
    data = b'{"x": "' + b"y" * (c.MAX_PUBLISH_REQUEST_BYTES - 150) + b'"}'
    data += b" " * (c.MAX_PUBLISH_REQUEST_BYTES - publish_request_size(TOPIC, data, attributes))
    assert publish_request_size(TOPIC, data, attributes) == c.MAX_PUBLISH_REQUEST_BYTES
    delivery = make_delivery(data, attributes, message_id="m-1234567890")
    job = Job(JobSpec("t.job", lambda ctx, payload: None), "m-1234567890", {}, "m-1234567890",
              1, None, attributes)  # fmt: skip
    ctx = JobContext("t.job", job.job_id, job.message_id, 1, None, Flag())
    run = Run(job, ctx, delivery, lambda r, o: True)
    # When it comes, Then it is refused (its failure record follows), and nothing is kept
    outcome = through(delays, run, lambda run: Succeeded())
    assert isinstance(outcome, Rejected) and outcome.error_type == c.ERR_OVERSIZE
    assert store.entries() == []


def _run(attributes: dict[str, str]) -> Run:
    spec = JobSpec("t.job", lambda ctx, payload: None)
    attributes = {c.ATTR_JOB: "t.job", c.ATTR_JOB_ID: "j-1", **attributes}
    delivery = make_delivery(b'{"x":1}', attributes)
    job = Job(spec, "j-1", {"x": 1}, "m-1", 1, None, attributes)
    ctx = JobContext("t.job", "j-1", "m-1", 1, None, Flag())
    return Run(job, ctx, delivery, lambda run, outcome: True)


def test_a_job_not_due_yet_is_scheduled_and_acked_instead_of_run() -> None:
    clock = FakeClock(NOW.timestamp())
    store = MemorySchedule()
    delays = Delays(TOPIC, store, Firer(store, TOPIC, Publisher(), clock=clock), clock=clock)
    ran: list[str] = []

    def handler(run: Run) -> Succeeded:
        ran.append(run.job.job_id)
        return Succeeded()

    ahead = not_before_text(timedelta(seconds=90), NOW)
    outcome = through(delays, _run({c.ATTR_NOT_BEFORE: ahead}), handler)
    assert outcome == Scheduled(ahead) and ran == []
    [entry] = store.entries()
    assert (entry.job_id, entry.due, entry.data) == ("j-1", NOW.timestamp() + 90, b'{"x":1}')
    assert entry.attributes[c.ATTR_NOT_BEFORE] == ahead  # published again as it came
    facts = Facts(1, 3, Backoff())
    assert decide(outcome, facts) == Ack(Label.SCHEDULED)
    # Due (or past): it runs; without a not_before too
    clock.advance(90)
    assert through(delays, _run({c.ATTR_NOT_BEFORE: ahead}), handler) == Succeeded()
    assert through(delays, _run({}), handler) == Succeeded()
    assert ran == ["j-1", "j-1"]
    # A bad not_before can never run: recorded as such
    bad = through(delays, _run({c.ATTR_NOT_BEFORE: "soon"}), handler)
    assert isinstance(bad, Rejected) and bad.error_type == c.ERR_INVALID_NOT_BEFORE
    # Without a schedule (the store is none) it rides on its ack deadline, 600 s a step
    riding = Delays(TOPIC, None, None, clock=clock)
    later = not_before_text(timedelta(hours=2), datetime.fromtimestamp(clock(), UTC))
    assert through(riding, _run({c.ATTR_NOT_BEFORE: later}), handler) == Deferred(
        f"not before {later}", 600
    )


def test_a_fired_copy_that_finds_a_worker_a_little_behind_comes_back_not_lost() -> None:
    # Given a delayed job scheduled, and due now by the clock of the firer, which claims it
    clock = FakeClock(NOW.timestamp())
    store = MemorySchedule()
    firer = Firer(store, TOPIC, Publisher(), clock=clock)
    due_text = not_before_text(timedelta(seconds=90), NOW)
    delays = Delays(TOPIC, store, firer, clock=clock)
    assert through(delays, _run({c.ATTR_NOT_BEFORE: due_text}), lambda run: Succeeded()) == (
        Scheduled(due_text)
    )
    [claimed], _ = store.claim_due(TOPIC, NOW.timestamp() + 90.02, 30.0, 10)
    # When its fired copy reaches a worker whose clock is 0.3 s behind, before the firer
    # removes the entry
    behind = FakeClock(NOW.timestamp() + 89.7)
    late_worker = Delays(TOPIC, store, Firer(store, TOPIC, Publisher(), clock=behind), clock=behind)
    outcome = through(late_worker, _run({c.ATTR_NOT_BEFORE: due_text}), lambda run: Succeeded())
    store.fired(TOPIC, [claimed.job_id])
    # Then that copy is not acked as scheduled (nothing would be left to run): it comes back
    # when due (an ack deadline of a second: the acks round a delay under one up to it)
    assert isinstance(outcome, Deferred)
    assert outcome.delay == pytest.approx(0.3)
    assert store.entries() == []
    # And a second delivery of a job due later than an entry's claim could last is still
    # acked as scheduled once: its entry is there, not yet fired
    later = not_before_text(timedelta(hours=1), NOW)
    for _ in range(2):
        assert through(delays, _run({c.ATTR_NOT_BEFORE: later}), lambda run: Succeeded()) == (
            Scheduled(later)
        )
    assert len(store.entries()) == 1


def test_a_fired_copy_that_finds_a_worker_far_behind_comes_back_not_lost() -> None:
    # Given a delayed job scheduled, and a worker whose clock is 60 s behind the firer's,
    # which each copy reaches while it is being published (before the firer removes its entry)
    clock, behind = FakeClock(NOW.timestamp()), FakeClock(NOW.timestamp() - 60)
    store = MemorySchedule()
    late_worker = Delays(TOPIC, store, Firer(store, TOPIC, Publisher(), clock=behind), clock=behind)
    met: list[Outcome] = []

    class Delivering(Publisher):
        def publish(
            self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
        ) -> Future[str]:
            met.append(through(late_worker, _run(attributes), lambda run: Succeeded()))
            return super().publish(topic, data, ordering_key, **attributes)

    firer = Firer(store, TOPIC, Delivering(), clock=clock)
    due_text = not_before_text(timedelta(seconds=90), NOW)
    delays = Delays(TOPIC, store, firer, clock=clock)
    assert through(delays, _run({c.ATTR_NOT_BEFORE: due_text}), lambda run: Succeeded()) == (
        Scheduled(due_text)
    )
    # When it falls due by the firer's clock and is fired
    clock.advance(90)
    behind.advance(90)
    firer.start()
    try:
        assert wait_for(lambda: met and store.entries() == [], timeout=5)
    finally:
        firer.stop(5)
    # Then the copy, 60 s early by that worker's clock, is not acked as scheduled (nothing
    # would be left to run once the firer removed the entry): it comes back when due there
    [outcome] = met
    assert isinstance(outcome, Deferred) and outcome.delay == pytest.approx(60)
    assert store.entries() == []


def test_a_copy_made_of_a_fired_copy_is_scheduled_again_when_it_is_due_later() -> None:
    # Given a copy the schedule fired, whose run defers for an hour on its last delivery (a
    # fresh copy is published in its place, due then)
    clock = FakeClock(time.time())  # (a copy's not_before is set by the time it is made)
    sent: list[dict[str, str]] = []

    class Recording(Publisher):
        def publish(
            self, topic: str, data: bytes, ordering_key: str = "", **attributes: str
        ) -> Future[str]:
            sent.append(attributes)
            return super().publish(topic, data, ordering_key, **attributes)

    fired = _run({c.ATTR_NOT_BEFORE: not_before_text(NOW), c.ATTR_FIRED_AT: "x"}).delivery
    assert Renewer(Recording(), TOPIC, "projects/p/subscriptions/s", 5).renew([(fired, 3600)])
    # When that copy comes, an hour early
    store = MemorySchedule()
    delays = Delays(TOPIC, store, Firer(store, TOPIC, Publisher(), clock=clock), clock=clock)
    outcome = through(delays, _run(sent[0]), lambda run: Succeeded())
    # Then it is put in the schedule like any delayed job (it carries no fired_at), not
    # deferred 600 s at a time, a delivery each
    assert c.ATTR_FIRED_AT not in sent[0] and isinstance(outcome, Scheduled)
    assert [entry.due for entry in store.entries()] == [pytest.approx(clock() + 3600, abs=60)]


def test_a_delayed_job_without_a_job_id_is_published_again_as_the_same_job() -> None:
    # Given a message that goes by its message id (no job_id attribute), not due yet
    store = MemorySchedule()
    delays = Delays(TOPIC, store, Firer(store, TOPIC, Publisher()))
    ahead = not_before_text(timedelta(seconds=90))
    attributes = {c.ATTR_JOB: "t.job", c.ATTR_NOT_BEFORE: ahead}
    spec = JobSpec("t.job", lambda ctx, payload: None)
    delivery = make_delivery(b"{}", attributes, message_id="m-7")
    job = Job(spec, "m-7", {}, "m-7", 1, None, attributes)
    run = Run(job, JobContext("t.job", "m-7", "m-7", 1, None, Flag()), delivery, lambda r, o: True)
    # When it is scheduled
    assert through(delays, run, lambda run: Succeeded()) == Scheduled(ahead)
    # Then its copy carries the job id, so a copy fired twice still runs once
    [entry] = store.entries()
    assert entry.attributes == {**attributes, c.ATTR_JOB_ID: "m-7"}
    # With no room left for it (Pub/Sub allows 100 attributes), as it came: else never fired
    crowded = {**attributes, **{f"a{i}": "x" for i in range(98)}}
    run.delivery = make_delivery(b"{}", crowded, message_id="m-8")
    run.job = replace(job, job_id="m-8", message_id="m-8", attributes=crowded)
    assert through(delays, run, lambda run: Succeeded()) == Scheduled(ahead)
    assert [e.attributes for e in store.entries() if e.job_id == "m-8"] == [crowded]


def _cli(*args: str) -> Result:
    """The CLI run in this process: the subprocess a user starts costs a second each."""
    return CliRunner().invoke(main, list(args))


def test_schedule_list_shows_the_delayed_jobs_soonest_first(tmp_path: Path) -> None:
    store = SqliteSchedule(tmp_path / "claims.db")
    now = time.time()
    store.add(_entry("in-two-days", now + 2 * 86400))
    store.add(_entry("in-a-minute", now + 60))
    store.close()
    result = _cli("schedule", "list", "--idempotency-store", f"sqlite:///{tmp_path}/claims.db")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[4] for line in lines[:2]] == ["in-a-minute", "in-two-days"]
    assert lines[1].split()[2] == "2.0d" and lines[-1] == "2 delayed job(s)"


def test_publish_refuses_a_delay_it_cannot_honour() -> None:
    args = ["publish", "--project", "p", "--topic", "t", "--job", "j", "--data", "{}"]
    for extra, says in (
        (["--delay", "90s", "--not-before", "2026-12-24T09:00:00Z"], "not both"),
        (["--delay", "soon"], "not a number of s, m, h or d"),
        (["--not-before", "2026-12-24T09:00:00"], "has no timezone"),
        (["--not-before", "2026-W52-4T09:00:00Z"], "not an RFC 3339 time"),
        (["--not-before", "20261224T090000Z"], "not an RFC 3339 time"),
        (["--delay", "400d"], "more than 365 days ahead"),
        (["--delay", "365.001d"], "more than 365 days ahead"),
        (["--delay", "99999999999999999999d"], "out of range"),
    ):
        result = _cli(*args, *extra)
        assert result.exit_code == 2, result.output
        assert says in result.output and len(result.output.strip().splitlines()) == 1


def test_a_firestore_schedule_sits_beside_the_idempotency_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", "127.0.0.1:1")  # no credentials lookup
    opener = schedule_opener("firestore://my-project/jobs")
    assert opener is not None
    store = opener()
    assert isinstance(store, FirestoreSchedule)
    assert store._docs.id == "jobs-schedule"
    store.close()
    assert schedule_opener("none") is None


def test_firestore_unreachable_is_unavailable_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{free_port()}")  # nothing listens
    store = FirestoreSchedule(FIRESTORE_PROJECT, "schedule", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.claim_due(TOPIC, 2.0, lease=30, limit=10)
    assert time.monotonic() - started < 4
    store.close()
