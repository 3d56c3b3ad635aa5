"""Leaderless firing, in process: the marks' compare-and-sets on every backend, and firers
that share them publishing each tick once (a fake publisher; the emulator test runs real
workers)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests.conftest import FIRESTORE_PROJECT
from tests.fakes import Confirmed, FakeClock
from tests.support import store_handles, wait_for
from workerpool.periodic import Mark, Marks, MemoryMarks, Periodic, SqliteMarks, Ticks
from workerpool.periodic.firing import Periodics
from workerpool.periodic.marks import (
    BUFFERED,
    MISSED,
    PUBLISHED,
    REQUESTED,
    SKIPPED,
    UNPUBLISHED,
    Pause,
)  # fmt: skip
from workerpool.stores import StoreError

HOUR = 3600.0
DAY = 24 * HOUR
NOW = 1_800_000_000.0  # on the hour
# How often the firers look at a clock the test moves by hand (a real one: each second).
POLL = 0.05


@pytest.fixture(params=["memory", "sqlite", "firestore"])
def opened(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], Marks]]:
    """Opens the marks, as each worker does (in memory: one store the process shares)."""

    def firestore(collection: str) -> Marks:
        from workerpool.periodic.firestore import FirestoreMarks

        return FirestoreMarks(FIRESTORE_PROJECT, collection)

    with store_handles(
        request.param, request, monkeypatch,
        memory=MemoryMarks, sqlite=lambda: SqliteMarks(tmp_path / "m.db"), firestore=firestore,
    ) as make:  # fmt: skip
        yield make


@pytest.fixture
def marks(opened: Callable[[], Marks]) -> Marks:
    return opened()


class Publisher:
    """Records what is published; every publish succeeds at once."""

    def __init__(self) -> None:
        self.published: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def publish(self, topic: str, data: bytes, **attributes: str) -> Future[str]:
        with self._lock:
            self.published.append(attributes)
        future: Future[str] = Future()
        future.set_result(str(len(self.published)))
        return future

    def job_ids(self) -> list[str]:
        with self._lock:
            return [a["job_id"] for a in self.published]


def hourly(catch_up: str = "latest", window: float = 10 * HOUR) -> Periodic:
    return Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, catch_up, window)


def job_id(tick: float) -> str:
    return hourly().job_id(tick)


job_id_of = job_id  # (in tests whose run_state names its argument job_id)


def test_one_mark_per_tick_and_one_take_over(marks: Marks) -> None:
    assert marks.mark("h", NOW, NOW) is True
    assert marks.mark("h", NOW, NOW + 1) is False
    assert marks.unpublished(NOW + 1) == [Mark("h", NOW, NOW)]
    assert marks.unpublished(NOW) == []
    # Given an unpublished mark, when two workers take it over, then one does.
    assert marks.take_over(Mark("h", NOW, NOW), NOW + 10) is True
    assert marks.take_over(Mark("h", NOW, NOW), NOW + 10) is False
    marks.published("h", NOW, NOW - HOUR)
    assert marks.unpublished(NOW + 100) == []
    assert marks.take_over(Mark("h", NOW, NOW + 10), NOW + 20) is False
    assert marks.last("h") == NOW and marks.last("other") is None


def test_published_forgets_older_marks(marks: Marks) -> None:
    for tick in (NOW - 2 * HOUR, NOW - HOUR, NOW):
        marks.mark("h", tick, tick)
        marks.published("h", tick, tick - HOUR)
    marks.mark("g", NOW - 5 * HOUR, NOW)
    assert marks.last("h") == NOW
    assert marks.unpublished(NOW + 1) == [Mark("g", NOW - 5 * HOUR, NOW)]  # not h's to forget


def _run(firers: list[Periodics], publisher: Publisher, count: int) -> list[str]:
    for firer in firers:
        firer.start()
    try:
        wait_for(lambda: len(publisher.job_ids()) >= count, timeout=10)
    finally:
        for firer in firers:
            firer.close(5)
    return publisher.job_ids()


class Counted:
    """What the firers counted (their ``on_ticks``), by schedule and outcome."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, schedule: str, outcome: str, count: int) -> None:
        self.calls.append((schedule, outcome, count))

    def totals(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for _, outcome, count in self.calls:
            totals[outcome] += count
        return dict(totals)


@pytest.mark.parametrize(
    ("catch_up", "expected", "counted"),
    [
        ("all", [-4, -3, -2, -1, 0], {"fired": 5}),
        ("latest", [0], {"fired": 1, "missed": 4}),
        ("none", [], {"missed": 5}),
    ],
)
def test_catch_up_after_the_fleet_was_down(
    opened: Callable[[], Marks], marks: Marks, catch_up: str, expected: list[int],
    counted: dict[str, int],
) -> None:  # fmt: skip
    # Given the tick 5 hours ago fired, and the fleet down since
    marks.mark("h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    marks.published("h", NOW - 5 * HOUR, 0)
    # When three workers start at once
    publisher, counts = Publisher(), Counted()
    firers = [
        Periodics([hourly(catch_up)], opened(), "t", publisher, clock=lambda: NOW + 60,
                  on_ticks=counts)
        for _ in range(3)
    ]  # fmt: skip
    ids = _run(firers, publisher, len(expected))
    # Then each missed tick is published once (all), the latest only, or none
    assert sorted(ids) == sorted(job_id(NOW + h * HOUR) for h in expected)
    # And the ticks fired and those left out are counted once, by one of the workers
    assert counts.totals() == counted


def test_catch_up_stops_at_the_window(opened: Callable[[], Marks], marks: Marks) -> None:
    # Given the last tick fired 5 hours ago and a window of 2 hours, then the ticks within it
    marks.mark("h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    marks.published("h", NOW - 5 * HOUR, 0)
    publisher = Publisher()
    firer = Periodics([hourly("all", 2 * HOUR)], opened(), "t", publisher, clock=lambda: NOW + 60)
    assert sorted(_run([firer], publisher, 2)) == [job_id(NOW - HOUR), job_id(NOW)]


def test_nothing_is_caught_up_on_the_first_start(opened: Callable[[], Marks], marks: Marks) -> None:
    publisher = Publisher()
    firer = Periodics([hourly("all")], opened(), "t", publisher, clock=lambda: NOW + 60)
    firer.start()
    firer.close(5)
    assert publisher.job_ids() == [] and marks.last("h") is None


def test_a_mark_left_unpublished_is_published_by_another(
    opened: Callable[[], Marks], marks: Marks
) -> None:
    # Given a worker that marked the tick and died before publishing it
    marks.mark("h", NOW, NOW)
    # When another worker runs 10 s later
    publisher = Publisher()
    firer = Periodics([hourly("none")], opened(), "t", publisher, clock=lambda: NOW + 10)
    # Then it publishes the tick, with not_before = the tick
    assert _run([firer], publisher, 1) == [job_id(NOW)]
    assert publisher.published[0]["not_before"] == "2027-01-15T08:00:00.000Z"
    assert marks.unpublished(NOW + 100) == []


def test_a_tick_due_is_published_once_by_many_firers(opened: Callable[[], Marks]) -> None:
    # Given ticks every second, a clock that moves, and four firers sharing the marks
    publisher = Publisher()
    clock = _Clock(NOW)
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1))
    firers = [
        Periodics([every], opened(), "t", publisher, clock=clock, poll=POLL) for _ in range(4)
    ]
    for firer in firers:
        firer.start()
    try:
        for _ in range(5):  # when five ticks come due, one by one
            clock.now += 1
            wait_for(lambda: clock.now - NOW <= len(publisher.job_ids()), timeout=10)
    finally:
        for firer in firers:
            firer.close(5)
    # Then each was published once
    assert sorted(publisher.job_ids()) == [every.job_id(NOW + s) for s in range(1, 6)]


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_no_schedules_no_thread() -> None:
    firer = Periodics([], MemoryMarks(), "t", Publisher())
    firer.start()
    firer.close(1)


@pytest.mark.parametrize(("overlap", "previous_runs", "expected"), [
    ("skip", True, []), ("skip", False, [0]), ("allow", True, [0]),
])  # fmt: skip
def test_overlap_skip_leaves_out_a_tick_while_the_previous_one_runs(
    opened: Callable[[], Marks], marks: Marks, overlap: str, previous_runs: bool,
    expected: list[int],
) -> None:  # fmt: skip
    # Given the tick an hour ago published and its job still holding its claim (or not)
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "latest",
                        10 * HOUR, overlap)  # fmt: skip
    publisher = Publisher()
    counts = Counted()
    firer = Periodics([schedule], opened(), "t", publisher, clock=lambda: NOW + 60,
                      on_ticks=counts)  # fmt: skip
    asked: list[str] = []
    firer.run_state = lambda job_id: "running" if asked.append(job_id) or previous_runs else "ended"
    # When the tick on the hour comes due (caught up at start)
    firer.start()
    assert wait_for(lambda: marks.last("h") == NOW and not marks.unpublished(NOW + 100), 10)
    firer.close(5)
    # Then it is published, or, with "skip" while the previous one runs, marked skipped
    assert publisher.job_ids() == [job_id(NOW + h * HOUR) for h in expected]
    assert asked == ([job_id(NOW - HOUR)] if overlap == "skip" else [])
    last = marks.last_run("h", NOW + 1)
    assert last is not None and last.tick == (NOW if expected else NOW - HOUR)
    assert counts.totals() == ({"fired": 1} if expected else {"skipped": 1})


@pytest.mark.parametrize(("published_ago", "state", "expected"), [
    (60, "unclaimed", []), (700, "unclaimed", [0]), (60, "ended", [0]), (700, "running", []),
])  # fmt: skip
def test_overlap_skip_counts_a_tick_not_claimed_yet_as_running_for_overlap_unclaimed(
    marks: Marks, published_ago: float, state: str, expected: list[int]
) -> None:
    # Given the tick an hour ago published a while ago (marked then), its job claimed by no
    # worker yet (or ended, or running), and overlap_unclaimed 10 minutes
    marks.mark("h", NOW - HOUR, NOW - published_ago)
    marks.published("h", NOW - HOUR, 0)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "latest",
                        10 * HOUR, "skip", overlap_unclaimed=600)  # fmt: skip
    publisher = Publisher()
    firer = Periodics([schedule], marks, "t", publisher, clock=lambda: NOW + 1)
    firer.run_state = lambda job_id: state
    # When the tick on the hour comes due (caught up at start)
    firer.start()
    assert wait_for(lambda: marks.last("h") == NOW and not marks.unpublished(NOW + 100), 10)
    firer.close(5)
    # Then it is skipped while the one before is queued within the bound or runs, else fired
    assert publisher.job_ids() == [job_id(NOW + h * HOUR) for h in expected]


def test_overlap_buffer_one_keeps_one_tick_waiting_and_fires_it_when_the_run_ends(
    opened: Callable[[], Marks], marks: Marks
) -> None:
    # Given the tick an hour ago published and its job still running, overlap "buffer_one"
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "none",
                        10 * HOUR, "buffer_one")  # fmt: skip
    publisher, counts, clock = Publisher(), Counted(), _Clock(NOW - 1)
    firers = [Periodics([schedule], opened(), "t", publisher, clock=clock, on_ticks=counts,
                        poll=POLL) for _ in range(2)]  # fmt: skip
    runs = threading.Event()
    runs.set()
    for firer in firers:
        firer.run_state = lambda job_id: (
            "running" if runs.is_set() and job_id == hourly().job_id(NOW - HOUR) else "ended"
        )
        firer.start()
    try:
        # When the tick on the hour comes due, then the next one, while it still runs
        clock.now = NOW + 1
        assert wait_for(lambda: marks.unpublished(REQUESTED) == [Mark("h", NOW, BUFFERED)], 10)
        clock.now = NOW + HOUR + 1
        assert wait_for(lambda: marks.latest("h") == (NOW + HOUR, SKIPPED), 10)
        # Then the first waits, unpublished, and the second is skipped
        assert publisher.job_ids() == []
        # And once the run ends, the waiting tick is published, once
        runs.clear()
        assert wait_for(lambda: publisher.job_ids() == [job_id(NOW)], 10)
        assert wait_for(lambda: not marks.unpublished(clock.now + 100), 10)
    finally:
        for firer in firers:
            firer.close(5)
    assert publisher.job_ids() == [job_id(NOW)]
    assert counts.totals() == {"skipped": 1, "fired": 1}


class _Failing(MemoryMarks):
    """Marks whose first calls fail: the store out of reach, then a bug."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[Exception] = [StoreError("store down"), RuntimeError("a bug")]

    def mark_many(self, ticks: Sequence[tuple[str, float]], now: float) -> list[bool]:
        if self.failures:
            raise self.failures.pop(0)
        return super().mark_many(ticks, now)


def test_the_firing_thread_survives_a_store_that_fails_and_a_bug() -> None:
    # Given ticks every second and marks whose first two calls raise
    publisher = Publisher()
    clock = _Clock(NOW)
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1))
    marks = _Failing()
    firer = Periodics([every], marks, "t", publisher, clock=clock, poll=POLL)
    firer.start()
    try:
        # When three ticks come due, one by one, the first two meeting a failure each
        for left in (1, 0):
            clock.now += 1
            assert wait_for(lambda left=left: len(marks.failures) == left, timeout=10)
        clock.now += 1
        assert wait_for(publisher.job_ids, timeout=10)
    finally:
        firer.close(5)
    # Then the first two were lost to the failures and the thread went on to fire the third
    assert publisher.job_ids() == [every.job_id(NOW + 3)]


class _Unreachable(MemoryMarks):
    """Marks whose ``method`` raises StoreError until ``failures`` calls have."""

    def __init__(self, method: str, failures: int) -> None:
        super().__init__()
        self.method, self.failures, self.calls = method, failures, 0

    def _reach(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.failures:
                self.failures -= 1
                raise StoreError("store down")

    def mark_many(self, ticks: Sequence[tuple[str, float]], now: float) -> list[bool]:
        self._reach("mark_many")
        return super().mark_many(ticks, now)

    def latest(self, schedule: str) -> tuple[float, int] | None:
        self._reach("latest")
        return super().latest(schedule)


def test_a_tick_the_store_could_not_mark_is_fired_once_it_can() -> None:
    # Given ticks every second and a store that cannot be reached for the first three looks
    publisher, clock = Publisher(), _Clock(NOW)
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1))
    marks = _Unreachable("mark_many", 3)
    firer = Periodics([every], marks, "t", publisher, clock=clock, poll=POLL)
    firer.start()
    try:
        # When a tick comes due while it is out of reach, and the store answers again
        clock.now += 1
        assert wait_for(lambda: publisher.job_ids() == [every.job_id(NOW + 1)], timeout=10)
    finally:
        firer.close(5)
    # Then that tick was fired once, on a later look: no worker fired it meanwhile
    assert marks.failures == 0 and marks.latest("s") == (NOW + 1, PUBLISHED)


def test_a_catch_up_the_store_could_not_read_is_made_once_it_can() -> None:
    # Given the tick 5 hours ago fired, the fleet down since, and a store whose first read of
    # the last tick fails
    marks = _Unreachable("latest", 1)
    MemoryMarks.mark(marks, "h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    MemoryMarks.published(marks, "h", NOW - 5 * HOUR, 0)
    publisher, clock = Publisher(), _Clock(NOW + 60)
    firer = Periodics([hourly("all")], marks, "t", publisher, clock=clock, poll=POLL)
    # When a worker starts, then an hour passes
    firer.start()
    try:
        assert wait_for(lambda: len(publisher.job_ids()) == 5, timeout=10)
        clock.now += HOUR
        assert wait_for(lambda: len(publisher.job_ids()) == 6, timeout=10)
    finally:
        firer.close(5)
    # Then every missed tick was caught up once the store answered, before the next tick
    assert publisher.job_ids() == [job_id(NOW + h * HOUR) for h in range(-4, 2)]


@pytest.mark.parametrize(
    ("catch_up", "expected", "counted"),
    [("all", [-1, 0], {"fired": 2}), ("latest", [0], {"fired": 1, "missed": 1}),
     ("none", [], {"missed": 2})],
)  # fmt: skip
def test_a_worker_suspended_for_days_looks_back_as_a_restart_would_not_tick_by_tick(
    catch_up: str, expected: list[int], counted: dict[str, int]
) -> None:
    # Given a worker firing an hourly schedule (a window of 2 hours)
    marks, publisher, counts = MemoryMarks(), Publisher(), Counted()
    clock = _Clock(NOW - 2 * DAY + 1)
    schedule = hourly(catch_up, window=2 * HOUR)
    firer = Periodics([schedule], marks, "t", publisher, clock=clock, poll=POLL, on_ticks=counts)
    firer.start()
    try:
        clock.now += HOUR
        assert wait_for(lambda: marks.latest("h") == (NOW - 2 * DAY + HOUR, PUBLISHED), 10)
        # When it is suspended for two days, its clock stepping forward by that much
        clock.now = NOW + 60
        assert wait_for(lambda: sum(counts.totals().values()) >= 1 + sum(counted.values()), 10)
    finally:
        firer.close(5)
    # Then it applies its catch_up policy to what it missed within the window, as a restart
    # would: not the 47 ticks one by one
    assert publisher.job_ids()[1:] == [job_id(NOW + h * HOUR) for h in expected]
    assert counts.totals() == {**counted, "fired": 1 + counted.get("fired", 0)}


class _Waits(threading.Event):
    """A stop event that records each wait of the firing thread, and ends the thread after
    ``looks`` of them (each returns at once)."""

    def __init__(self, looks: int) -> None:
        super().__init__()
        self.looks, self.timeouts = looks, list[float | None]()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.looks:
            self.set()
        return self.is_set()


def test_while_the_store_cannot_answer_the_look_back_the_thread_waits_a_poll_each_look() -> None:
    # Given a store out of reach from the start, and a worker that looks every second
    marks = _Unreachable("latest", 1_000_000)
    firer = Periodics([hourly()], marks, "t", Publisher(), clock=_Clock(NOW + 60), poll=1.0)
    firer._stop = waits = _Waits(looks=5)
    # When it tries its start-up look-back, again and again
    firer.start()
    try:
        assert wait_for(waits.is_set, timeout=10)
    finally:
        firer.close(5)
    # Then between two tries it waits a whole poll: it does not spin
    assert waits.timeouts[:5] == [1.0] * 5


def test_a_pass_slowed_by_the_store_fires_the_tick_that_fell_meanwhile_late_not_missed() -> None:
    # Given catch_up "none", the tick an hour ago fired, and a store call that takes 8 s
    # just as the tick on the hour falls
    clock = _Clock(NOW - 1.0)

    class SlowOnce(MemoryMarks):
        slow = True

        def unpublished(self, marked_before: float) -> list[Mark]:
            if self.slow and clock.now >= NOW - 1.0:
                self.slow = False
                clock.now += 8.0
            return super().unpublished(marked_before)

    marks, publisher, counts = SlowOnce(), Publisher(), Counted()
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    # (the call's 8 s pass on the monotonic clock too, as they would)
    firer = Periodics([hourly("none")], marks, "t", publisher, clock=clock, monotonic=clock,
                      poll=POLL, on_ticks=counts)  # fmt: skip
    # When the worker runs through it
    firer.start()
    try:
        assert wait_for(lambda: marks.latest("h") == (NOW, PUBLISHED), timeout=10)
    finally:
        firer.close(5)
    # Then the tick was fired, 8 s late: a slow pass is no downtime of the worker
    assert publisher.job_ids() == [job_id(NOW)] and counts.totals() == {"fired": 1}


def test_ticks_the_store_could_not_mark_in_an_outage_are_caught_up_by_the_policy() -> None:
    # Given a 1 s schedule with catch_up "latest", and a store that fails fast for 100 s
    clock = _Clock(NOW + 0.5)
    marks, publisher, counts = _Unreachable("mark_many", 0), Publisher(), Counted()
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="latest")
    firer = Periodics([every], marks, "t", publisher, clock=clock, poll=POLL, on_ticks=counts)
    firer.start()
    try:
        marks.failures = 1_000_000
        for _ in range(100):
            clock.now += 1
            calls = marks.calls
            assert wait_for(lambda calls=calls: marks.calls > calls, timeout=10)
        # When it answers again
        marks.failures = 0
        assert wait_for(lambda: publisher.job_ids(), timeout=10)
        assert wait_for(lambda: "missed" in counts.totals(), timeout=10)
    finally:
        firer.close(5)
    # Then the latest tick is fired and the others counted missed, as after a downtime: not
    # 100 ticks at once
    assert publisher.job_ids() == [every.job_id(NOW + 100)]
    assert counts.totals() == {"fired": 1, "missed": 99}


def test_a_tick_the_store_missed_for_a_second_fires_late_even_with_catch_up_none() -> None:
    # Given catch_up "none", the tick an hour ago fired, and the store failing the mark of
    # the tick on the hour once
    clock = _Clock(NOW - 0.5)
    marks, publisher, counts = _Unreachable("mark_many", 0), Publisher(), Counted()
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    firer = Periodics([hourly("none")], marks, "t", publisher, clock=clock, poll=POLL,
                      on_ticks=counts)  # fmt: skip
    firer.start()
    try:
        marks.failures, calls = 1, marks.calls
        clock.now = NOW + 0.1
        assert wait_for(lambda: marks.calls > calls and not marks.failures, timeout=10)
        # When it answers a second later
        clock.now = NOW + 1.1
        assert wait_for(lambda: publisher.job_ids(), timeout=10)
    finally:
        firer.close(5)
    # Then the tick is fired, a second late: a blip of the store is no downtime of the fleet
    assert publisher.job_ids() == [job_id(NOW)] and counts.totals() == {"fired": 1}


def test_an_operators_run_during_an_outage_hides_none_of_the_ticks_missed_around_it() -> None:
    # Given catch_up "all", a tick each minute, and the store failing this worker's marks for
    # ten minutes, while an operator triggers a run (its mark is written by the command)
    clock = _Clock(NOW - 0.5)
    marks, publisher = _Unreachable("mark_many", 0), Publisher()
    minutely = Periodic("m", "demo.echo", Ticks(ZoneInfo("UTC"), every=60), catch_up="all")
    firer = Periodics([minutely], marks, "t", publisher, clock=clock, poll=POLL)
    firer.start()
    try:
        marks.failures = 1_000_000
        for step in range(1, 601, 10):
            clock.now, calls = NOW + step, marks.calls
            if step == 301:
                MemoryMarks.mark_many(marks, [("m", NOW + 300.123)], REQUESTED)
            assert wait_for(lambda calls=calls: marks.calls > calls, timeout=10)
        # When it answers again
        marks.failures = 0
        expected = {minutely.job_id(NOW + 60 * k) for k in range(10)}  # up to NOW + 591
        assert wait_for(lambda: expected <= set(publisher.job_ids()), timeout=10)
    finally:
        firer.close(5)
    # Then every tick of the ten minutes is fired (caught up), the operator's run besides
    assert len(publisher.job_ids()) == 11


def test_a_clock_stepped_in_the_middle_of_a_pass_is_looked_back_over_not_walked() -> None:
    # Given a tick each second, catch_up "latest", and the clock stepping an hour forward
    # during a store call (not a wait)
    clock = _Clock(NOW + 0.5)

    class StepsOnce(MemoryMarks):
        step = False

        def unpublished(self, marked_before: float) -> list[Mark]:
            if self.step:
                self.step = False
                clock.now += HOUR
            return super().unpublished(marked_before)

    marks, publisher, counts = StepsOnce(), Publisher(), Counted()
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="latest")
    firer = Periodics([every], marks, "t", publisher, clock=clock, poll=POLL, on_ticks=counts)
    firer.start()
    try:
        marks.step = True
        assert wait_for(lambda: "missed" in counts.totals(), timeout=10)
    finally:
        firer.close(5)
    # Then its catch_up applies (the latest fired, 999 counted missed, as many as a look-back
    # counts), not 3,600 ticks one by one
    assert publisher.job_ids() == [every.job_id(NOW + HOUR)]
    assert counts.totals() == {"fired": 1, "missed": 999}


def test_a_catch_up_of_a_thousand_ticks_is_marked_and_published_in_parts_of_500() -> None:
    # Given a tick each second last fired 1,000 s ago, catch_up "all"
    class Counting(MemoryMarks):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def mark_many(self, ticks: Sequence[tuple[str, float]], now: float) -> list[bool]:
            self.sizes.append(len(ticks))
            return super().mark_many(ticks, now)

    marks, publisher = Counting(), Publisher()
    marks.mark("s", NOW - 1000, NOW - 1000)
    marks.published("s", NOW - 1000, 0)
    marks.sizes.clear()
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="all")
    firer = Periodics([every], marks, "t", publisher, clock=lambda: NOW + 0.5, poll=POLL)
    # When a worker starts and catches them up
    firer.start()
    try:
        assert wait_for(lambda: len(publisher.job_ids()) == 1000, timeout=10)
    finally:
        firer.close(5)
    # Then it marked (and so published and recorded) them 500 at a time, as a burst goes
    assert marks.sizes == [500, 500]


def test_the_confirmations_of_a_catch_up_share_one_timeout_when_pub_sub_does_not_answer() -> None:
    # Given a tick each second last fired 5 s ago, catch_up "all", and a Pub/Sub that never
    # confirms a publish (each wait for a confirmation lasts its whole timeout, on a clock
    # the test moves)
    monotonic, waits = FakeClock(0.0), []

    class Unanswering(Publisher):
        def publish(self, topic: str, data: bytes, **attributes: str) -> Future[str]:
            super().publish(topic, data, **attributes)
            return Confirmed(waits, monotonic.advance)

    marks, publisher = MemoryMarks(), Unanswering()
    marks.mark("s", NOW - 5, NOW - 5)
    marks.published("s", NOW - 5, 0)
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="all")
    firer = Periodics([every], marks, "t", publisher, clock=lambda: NOW + 0.5, poll=POLL,
                      monotonic=monotonic)  # fmt: skip
    # When a worker catches them up
    firer.start()
    try:
        assert wait_for(lambda: len(waits) >= 5, timeout=10)
    finally:
        firer.close(5)
    # Then the five confirmations were waited for 30 s in all, not 30 s each
    assert waits[:5] == [30.0, 0.0, 0.0, 0.0, 0.0]
    assert sorted(publisher.job_ids()[:5]) == [every.job_id(NOW - s) for s in range(4, -1, -1)]


def test_a_mark_left_before_its_overlap_was_decided_is_decided_again_when_taken_over() -> None:
    # Given overlap "skip" and the previous tick's job still running; a worker marked the
    # tick on the hour and died before it decided to skip it; and another tick whose marker
    # died after publishing it (its job is claimed), before recording it published
    marks = MemoryMarks()
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    marks.mark("h", NOW, NOW + 0.1)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "none",
                        10 * HOUR, "skip")  # fmt: skip
    publisher, counts = Publisher(), Counted()
    firer = Periodics([schedule], marks, "t", publisher, clock=lambda: NOW + 10, poll=POLL,
                      on_ticks=counts)  # fmt: skip
    firer.run_state = lambda job_id: "running" if job_id == job_id_of(NOW - HOUR) else "unclaimed"
    # When another worker takes the mark over
    firer.start()
    try:
        assert wait_for(lambda: not marks.unpublished(NOW + 100), timeout=10)
    finally:
        firer.close(5)
    # Then it skips the tick, as its marker would have: it never runs beside the previous one
    assert publisher.job_ids() == []
    assert counts.totals() == {"skipped": 1}
    assert marks.last_run("h", NOW + 1) == Mark("h", NOW - HOUR, NOW - HOUR)


@pytest.mark.parametrize(("overlap", "catch_up", "published", "counted"), [
    ("skip", "latest", [0], {"fired": 1, "missed": 3, "skipped": 1}),
    ("buffer_one", "latest", [0], {"fired": 1, "missed": 3, "skipped": 1}),
    ("allow", "latest", [0, -4], {"fired": 2, "missed": 3}),
    # The first caught up runs, the next waits for it, the others are skipped
    ("buffer_one", "all", [-3], {"fired": 1, "skipped": 3}),
])  # fmt: skip
def test_a_mark_left_as_the_fleet_went_down_never_runs_beside_a_tick_after_it(
    opened: Callable[[], Marks], marks: Marks, overlap: str, catch_up: str,
    published: list[int], counted: dict[str, int],
) -> None:  # fmt: skip
    # Given the tick 5 hours ago published, the next one marked by a worker that died before
    # publishing it, and the whole fleet down since (nothing runs)
    marks.mark("h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    marks.published("h", NOW - 5 * HOUR, 0)
    marks.mark("h", NOW - 4 * HOUR, NOW - 4 * HOUR)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, catch_up,
                        10 * HOUR, overlap)  # fmt: skip
    publisher, counts = Publisher(), Counted()
    firer = Periodics([schedule], opened(), "t", publisher, clock=lambda: NOW + 60, poll=POLL,
                      on_ticks=counts)  # fmt: skip
    firer.run_state = lambda job_id: "unclaimed"
    # When a worker starts: it looks back, and takes the mark over
    firer.start()
    try:
        assert wait_for(lambda: all(m.tick != NOW - 4 * HOUR
                                    for m in marks.unpublished(NOW + 100)), timeout=10)  # fmt: skip
        assert wait_for(lambda: sum(counts.totals().values()) == sum(counted.values()), 10)
    finally:
        firer.close(5)
    # Then the mark left is skipped, unless overlap is "allow": it never runs beside a tick
    # caught up after it
    assert publisher.job_ids() == [job_id(NOW + h * HOUR) for h in published]
    assert counts.totals() == counted


def test_a_mark_left_as_the_fleet_went_down_with_only_a_tick_waiting_for_it_runs_first() -> None:
    # Given a tick marked by a worker that died before publishing it, the next tick waiting
    # for it to run (overlap "buffer_one"), and the whole fleet down since
    marks = MemoryMarks()
    marks.mark("h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    marks.published("h", NOW - 5 * HOUR, 0)
    marks.mark("h", NOW - 4 * HOUR, NOW - 4 * HOUR)
    marks.mark("h", NOW - 3 * HOUR, NOW - 4 * HOUR)
    assert marks.take_over(Mark("h", NOW - 3 * HOUR, NOW - 4 * HOUR), BUFFERED)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "none",
                        10 * HOUR, "buffer_one")  # fmt: skip
    publisher = Publisher()
    firer = Periodics([schedule], marks, "t", publisher, clock=lambda: NOW + 60, poll=POLL)
    firer.run_state = lambda job_id: "unclaimed"
    # When a worker starts and takes the marks over
    firer.start()
    try:
        assert wait_for(lambda: publisher.job_ids() != [], timeout=10)
    finally:
        firer.close(5)
    # Then the left tick runs (nothing after it ran), and the one waiting for it still waits
    assert publisher.job_ids() == [job_id(NOW - 4 * HOUR)]
    assert marks.unpublished(NOW + 100) == [Mark("h", NOW - 3 * HOUR, BUFFERED)]


@pytest.mark.parametrize("later", ["published", "waiting"])
def test_a_mark_taken_over_again_after_a_failed_publish_is_published_whatever_came_after_it(
    opened: Callable[[], Marks], marks: Marks, later: str
) -> None:
    # Given a tick 3 hours back that an operator asked for, taken over 40 s ago by a worker
    # whose publish failed (it stays unpublished, marked then), and a later tick published
    # (or waiting for the previous run, overlap "buffer_one")
    overlap = "skip" if later == "published" else "buffer_one"
    marks.mark("h", NOW, NOW)
    if later == "published":
        marks.published("h", NOW, 0)
    else:
        assert marks.take_over(Mark("h", NOW, NOW), BUFFERED)
    marks.mark("h", NOW - 3 * HOUR, NOW + 20)
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "latest",
                        10 * HOUR, overlap)  # fmt: skip
    publisher = Publisher()
    firer = Periodics([schedule], opened(), "t", publisher, clock=lambda: NOW + 60, poll=POLL)
    firer.run_state = lambda job_id: "unclaimed"  # (its job never went out)
    # When another worker takes it over
    firer.start()
    try:
        assert wait_for(lambda: job_id(NOW - 3 * HOUR) in publisher.job_ids(), timeout=10)
    finally:
        firer.close(5)
    # Then it publishes it: a running fleet's take-over, not a mark left as the fleet went down
    assert publisher.job_ids()[0] == job_id(NOW - 3 * HOUR)


class _RunsUnread(MemoryMarks):
    """Marks whose previous runs cannot be read: the store fails part way through a pass."""

    def last_run(self, schedule: str, before: float) -> Mark | None:
        raise StoreError("store down")


def test_marks_taken_over_before_the_store_fails_part_way_are_published_in_that_pass() -> None:
    # Given an operator's run of one schedule, then a tick of another waiting for its previous
    # run (overlap "buffer_one"), in a store whose previous runs cannot be read
    marks = _RunsUnread()
    marks.mark("h", NOW, REQUESTED)
    marks.mark("g", NOW, BUFFERED)
    waits = Periodic("g", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "none",
                     10 * HOUR, "buffer_one")  # fmt: skip
    publisher = Publisher()
    firer = Periodics([hourly("none"), waits], marks, "t", publisher, clock=lambda: NOW + 60,
                      poll=POLL)  # fmt: skip
    firer.run_state = lambda job_id: "unclaimed"
    # When a worker takes the operator's run over, then fails to read the other's previous run
    firer.start()
    try:
        # Then the operator's run is published all the same, in that pass (taken over again
        # later, it would count as a worker's mark)
        assert wait_for(lambda: publisher.job_ids() == [job_id(NOW)], timeout=10)
        assert wait_for(lambda: marks.latest("h") == (NOW, PUBLISHED), timeout=10)
    finally:
        firer.close(5)


def test_a_mark_whose_job_was_claimed_is_recorded_published_not_published_again() -> None:
    marks = MemoryMarks()
    marks.mark("h", NOW, NOW + 0.1)  # its marker published it, then died
    publisher = Publisher()
    firer = Periodics([hourly("none")], marks, "t", publisher, clock=lambda: NOW + 10, poll=POLL)
    firer.run_state = lambda job_id: "running" if job_id == job_id_of(NOW) else "unclaimed"
    firer.start()
    try:
        assert wait_for(lambda: not marks.unpublished(NOW + 100), timeout=10)
    finally:
        firer.close(5)
    assert publisher.job_ids() == [] and marks.latest("h") == (NOW, PUBLISHED)


def test_a_tick_catch_up_none_left_out_is_never_published_by_whoever_takes_it_over() -> None:
    # Given the fleet down for 5 hours, catch_up "none", and the worker that marked the
    # latest missed tick (to count what was missed) killed before it set it missed
    marks = MemoryMarks()
    marks.mark("h", NOW - 5 * HOUR, NOW - 5 * HOUR)
    marks.published("h", NOW - 5 * HOUR, 0)
    dying = Periodics([hourly("none")], marks, "t", Publisher(), clock=lambda: NOW + 60)
    dying._settle = lambda ticks, state: None  # type: ignore[method-assign]  # killed here
    dying._look_back(hourly("none"), None, NOW + 60)
    assert marks.latest("h") == (NOW, UNPUBLISHED)
    # When another worker starts and takes its mark over
    publisher = Publisher()
    firer = Periodics([hourly("none")], marks, "t", publisher, clock=lambda: NOW + 70, poll=POLL)
    firer.start()
    try:
        assert wait_for(lambda: marks.latest("h") == (NOW, MISSED), timeout=10)
    finally:
        firer.close(5)
    # Then it sets it missed and publishes nothing
    assert publisher.job_ids() == []


def test_pauses_and_the_latest_mark_are_shared(opened: Callable[[], Marks], marks: Marks) -> None:
    # Given one worker's handle pausing a schedule and another resuming a second one
    marks.pause("h", True, NOW)
    opened().pause("g", False, NOW + 1)
    # Then every handle reads both, and the latest tick of a schedule with its state
    assert opened().pauses() == {"h": Pause(True, NOW), "g": Pause(False, NOW + 1)}
    marks.mark("h", NOW, NOW)
    marks.mark("h", NOW - HOUR, NOW)
    marks.published("h", NOW - HOUR, 0, SKIPPED)
    assert opened().latest("h") == (NOW, UNPUBLISHED) and marks.latest("g") is None
    marks.published("h", NOW, 0, SKIPPED)
    assert marks.latest("h") == (NOW, SKIPPED)


class _Reading(MemoryMarks):
    """Marks that count how often the pauses were read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def pauses(self) -> dict[str, Pause]:
        self.reads += 1
        return super().pauses()


def test_a_paused_schedule_fires_nothing_and_resumed_not_what_it_missed() -> None:
    # Given ticks every second, fired by two firers, paused after the first tick
    publisher = Publisher()
    clock = _Clock(NOW)
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="all")
    marks = _Reading()
    firers = [Periodics([every], marks, "t", publisher, clock=clock, poll=POLL) for _ in range(2)]
    for firer in firers:
        firer.start()
    try:
        clock.now += 1
        assert wait_for(lambda: len(publisher.job_ids()) == 1, timeout=10)
        marks.pause("s", True, clock.now)
        # When three ticks fall while it is paused (each firer reads the pauses at each)
        for _ in range(3):
            reads = marks.reads
            clock.now += 1
            assert wait_for(lambda r=reads: marks.reads >= r + 2, timeout=10)
        # And it is resumed and one more falls
        marks.pause("s", False, clock.now)
        clock.now += 1
        assert wait_for(lambda: len(publisher.job_ids()) == 2, timeout=10)
    finally:
        for firer in firers:
            firer.close(5)
    # Then only the ticks before the pause and after the resume fired
    assert publisher.job_ids() == [every.job_id(NOW + 1), every.job_id(NOW + 5)]


class _PausesUnread(_Reading):
    """Marks whose pauses cannot be read while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def pauses(self) -> dict[str, Pause]:
        pauses = super().pauses()  # (counted either way)
        if self.failing:
            raise StoreError("store down")
        return pauses


def test_a_tick_whose_pauses_could_not_be_read_fires_once_they_can_not_as_paused_before() -> None:
    # Given ticks every second, paused: the tick that falls is read as paused, not fired
    publisher, clock, marks = Publisher(), _Clock(NOW), _PausesUnread()
    every = Periodic("s", "demo.echo", Ticks(ZoneInfo("UTC"), every=1), catch_up="all")
    marks.pause("s", True, NOW)
    firer = Periodics([every], marks, "t", publisher, clock=clock, poll=POLL)
    firer.start()
    try:
        reads = marks.reads
        clock.now += 1
        assert wait_for(lambda: marks.reads > reads, timeout=10)
        # When it is resumed, and the next tick falls while the pauses cannot be read
        marks.pause("s", False, NOW + 1.5)
        marks.failing = True
        reads = marks.reads
        clock.now += 1
        assert wait_for(lambda: marks.reads > reads + 1, timeout=10)
        assert publisher.job_ids() == []
        # Then that tick is fired once they can be read, not left out as paused by the last
        # read that answered
        marks.failing = False
        assert wait_for(lambda: publisher.job_ids() == [every.job_id(NOW + 2)], timeout=10)
    finally:
        firer.close(5)


def test_a_worker_started_after_a_resume_catches_up_nothing_of_the_pause(
    opened: Callable[[], Marks], marks: Marks
) -> None:
    # Given the tick at NOW fired, the schedule paused for three ticks, then resumed
    marks.mark("h", NOW, NOW)
    marks.published("h", NOW, 0)
    marks.pause("h", True, NOW + 1)
    marks.pause("h", False, NOW + 3.5 * HOUR)
    # When a worker starts before the next tick, catch_up "all"
    publisher = Publisher()
    firer = Periodics([hourly("all")], opened(), "t", publisher, clock=lambda: NOW + 3.6 * HOUR)
    firer.start()
    firer.close(5)
    # Then the ticks that fell while it was paused are not fired
    assert publisher.job_ids() == [] and marks.last("h") == NOW


def test_an_operators_mark_is_published_once_unmeasured(
    opened: Callable[[], Marks], marks: Marks
) -> None:
    # Given a run an operator asked for: a mark unpublished, marked at REQUESTED
    marks.mark("h", NOW - 3 * HOUR, REQUESTED)
    # When three workers run
    publisher = Publisher()
    late: list[float] = []
    firers = [
        Periodics([hourly("none")], opened(), "t", publisher, clock=lambda: NOW - 3 * HOUR + 60,
                  on_late=lambda name, seconds: late.append(seconds))
        for _ in range(3)
    ]  # fmt: skip
    # Then one publishes it, and its lateness is not measured (it was asked for now)
    assert _run(firers, publisher, 1) == [job_id(NOW - 3 * HOUR)]
    assert marks.latest("h") == (NOW - 3 * HOUR, PUBLISHED) and late == []
