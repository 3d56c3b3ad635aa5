"""Overlap "buffer_one" across workers, in process: a tick waiting for the previous run is
published by one worker while another looks at it, and two waiting ticks are looked at in
any order; never are two runs of the schedule published to run at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from zoneinfo import ZoneInfo

from tests.support import wait_for
from tests.test_periodic_firing import HOUR, NOW, Counted, Publisher, job_id
from workerpool.periodic import Mark, MemoryMarks, Periodic, Ticks
from workerpool.periodic.firing import Periodics
from workerpool.periodic.marks import BUFFERED, REQUESTED, SKIPPED


class _Interleaved(MemoryMarks):
    """Marks on which another worker acts right after this one reads the last run before
    ``at`` (``meanwhile``, once, if given), and whose unpublished marks come latest tick
    first."""

    def __init__(
        self, at: float = 0.0, meanwhile: Callable[[MemoryMarks], None] | None = None
    ) -> None:
        super().__init__()
        self._at = at
        self._meanwhile: Callable[[MemoryMarks], None] | None = meanwhile

    def last_run(self, schedule: str, before: float) -> Mark | None:
        found = super().last_run(schedule, before)
        if before == self._at and self._meanwhile is not None:
            meanwhile, self._meanwhile = self._meanwhile, None
            meanwhile(self)
        return found

    def unpublished(self, marked_before: float) -> list[Mark]:
        return sorted(super().unpublished(marked_before), key=lambda m: -m.tick)


def _waiting(marks: MemoryMarks, *ticks: float) -> None:
    """The tick an hour ago ran (published), and ``ticks`` wait for the run before them."""
    marks.mark("h", NOW - HOUR, NOW - HOUR)
    marks.published("h", NOW - HOUR, 0)
    for tick in ticks:
        marks.mark("h", tick, NOW)
        assert marks.take_over(Mark("h", tick, NOW), BUFFERED)


def _firer(marks: MemoryMarks, at: float, publisher: Publisher, counts: Counted) -> Periodics:
    """A worker's firer of the hourly "buffer_one" schedule, at ``at``: only the tick an
    hour ago has run, and it has ended."""
    schedule = Periodic("h", "demo.echo", Ticks(ZoneInfo("UTC"), every=3600), {}, "latest",
                        10 * HOUR, "buffer_one")  # fmt: skip
    firer = Periodics([schedule], marks, "t", publisher, clock=lambda: at, on_ticks=counts)
    ended = job_id(NOW - HOUR)
    firer.run_state = lambda job: "ended" if job == ended else "unclaimed"
    return firer


def _published(marks: MemoryMarks, ticks: Sequence[float], at: float) -> None:
    """Another worker takes the waiting ``ticks`` over and publishes them."""
    for tick in ticks:
        assert marks.take_over(Mark("h", tick, BUFFERED), at)
    marks.published_many([("h", tick) for tick in ticks], {"h": 0})


def test_a_tick_due_as_the_waiting_one_is_published_elsewhere_is_skipped() -> None:
    # Given the tick on the hour waiting for the one before it (ended now), and a worker
    # marking the next tick; another worker publishes the waiting one just after the first
    # read it as waiting
    at = NOW + HOUR + 1
    marks = _Interleaved(NOW + HOUR, lambda m: _published(m, [NOW], at))
    _waiting(marks, NOW)
    publisher, counts = Publisher(), Counted()
    firer = _firer(marks, at, publisher, counts)
    # When the next tick comes due (caught up at start)
    firer.start()
    assert wait_for(lambda: marks.last("h") == NOW + HOUR and not marks.unpublished(at + 9), 10)
    firer.close(5)
    # Then it is skipped (it fell while the one on the hour waited), not published to run
    # beside that one
    assert publisher.job_ids() == []
    assert marks.latest("h") == (NOW + HOUR, SKIPPED)
    assert counts.totals() == {"skipped": 1}


def test_of_two_waiting_ticks_only_the_earlier_is_published_whatever_the_order() -> None:
    # Given two ticks waiting (the second marked while the first was being set waiting),
    # the run before them ended, and a worker that looks at the later one first
    at = NOW + HOUR + 10
    marks = _Interleaved()
    _waiting(marks, NOW, NOW + HOUR)
    publisher, counts = Publisher(), Counted()
    firer = _firer(marks, at, publisher, counts)
    # When it takes waiting ticks over
    firer.start()
    assert wait_for(lambda: publisher.job_ids() != [], 10)
    firer.close(5)
    # Then only the earlier is published; the later waits for its run to end
    assert publisher.job_ids() == [job_id(NOW)]
    assert marks.unpublished(REQUESTED) == [Mark("h", NOW + HOUR, BUFFERED)]
