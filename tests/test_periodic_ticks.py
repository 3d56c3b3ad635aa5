"""The tick calculation across daylight-saving transitions (2027) and fixed offsets."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from workerpool.periodic import Ticks, cron_expression

NEW_YORK = ZoneInfo("America/New_York")  # 2027-03-14 02:00 -> 03:00; 2027-11-07 02:00 -> 01:00
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")  # +11 -> +10:30 on 04-04, back on 10-03 (30 min)
KOLKATA = ZoneInfo("Asia/Kolkata")  # +05:30 all year


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def iso(ticks: list[float]) -> list[str]:
    return [datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S") for t in ticks]


def cron(zone: ZoneInfo, text: str) -> Ticks:
    return Ticks(zone, cron_expression(text))


@pytest.mark.parametrize(
    ("zone", "text", "start", "end", "expected"),
    [
        # Given 02:30 daily in New York, when 02:30 is skipped on 03-14, then it fires at 03:00.
        (NEW_YORK, "30 2 * * *", "2027-03-13T00:00", "2027-03-15T12:00",
         ["2027-03-13T07:30:00", "2027-03-14T07:00:00", "2027-03-15T06:30:00"]),
        # Given 01:30 daily, when 01:30 happens twice on 11-07, then it fires once (EDT).
        (NEW_YORK, "30 1 * * *", "2027-11-06T00:00", "2027-11-08T12:00",
         ["2027-11-06T05:30:00", "2027-11-07T05:30:00", "2027-11-08T06:30:00"]),
        # The same with six fields, seconds first (a zero second however written).
        (NEW_YORK, "0 30 1 * * *", "2027-11-06T00:00", "2027-11-08T12:00",
         ["2027-11-06T05:30:00", "2027-11-07T05:30:00", "2027-11-08T06:30:00"]),
        (NEW_YORK, "00 30 1 * * *", "2027-11-06T00:00", "2027-11-08T12:00",
         ["2027-11-06T05:30:00", "2027-11-07T05:30:00", "2027-11-08T06:30:00"]),
        # Hourly keeps to the clock as it runs: no 02:00 in spring, 01:00 twice in autumn.
        (NEW_YORK, "0 * * * *", "2027-03-14T05:30", "2027-03-14T08:30",
         ["2027-03-14T06:00:00", "2027-03-14T07:00:00", "2027-03-14T08:00:00"]),
        (NEW_YORK, "0 * * * *", "2027-11-07T04:30", "2027-11-07T07:30",
         ["2027-11-07T05:00:00", "2027-11-07T06:00:00", "2027-11-07T07:00:00"]),
        # Lord Howe, fall-back by 30 minutes: 01:45 exists twice and fires once.
        (LORD_HOWE, "45 1 * * *", "2027-04-03T00:00", "2027-04-04T23:00",
         ["2027-04-03T14:45:00", "2027-04-04T15:15:00"]),
        # Spring-forward by 30 minutes: 02:15 does not exist and fires at 02:30 (+11).
        (LORD_HOWE, "15 2 * * *", "2027-10-02T00:00", "2027-10-03T23:00",
         ["2027-10-02T15:30:00", "2027-10-03T15:15:00"]),
        # Hourly across the 30-minute fall-back: each local hour once, 90 minutes apart.
        (LORD_HOWE, "0 * * * *", "2027-04-03T12:30", "2027-04-03T16:45",
         ["2027-04-03T13:00:00", "2027-04-03T14:00:00", "2027-04-03T15:30:00",
          "2027-04-03T16:30:00"]),
        # Kolkata: daily 02:00 is 20:30 UTC the day before; hourly on the half hour in UTC.
        (KOLKATA, "0 2 * * *", "2027-03-13T00:00", "2027-03-15T00:00",
         ["2027-03-13T20:30:00", "2027-03-14T20:30:00"]),
        (KOLKATA, "0 * * * *", "2027-11-07T00:00", "2027-11-07T02:00",
         ["2027-11-07T00:30:00", "2027-11-07T01:30:00"]),
    ],
)  # fmt: skip
def test_cron_ticks_across_transitions(
    zone: ZoneInfo, text: str, start: str, end: str, expected: list[str]
) -> None:
    assert iso(cron(zone, text).between(utc(start), utc(end), 100)) == expected


@pytest.mark.parametrize("zone", [NEW_YORK, LORD_HOWE, KOLKATA])
@pytest.mark.parametrize("day", ["2027-03-14", "2027-04-04", "2027-10-03", "2027-11-07"])
def test_every_minute_cron_ticks_each_real_minute(zone: ZoneInfo, day: str) -> None:
    # Given "* * * * *", when a transition falls in the window, then a tick fires every 60 s.
    start = utc(f"{day}T00:00") - 86400 / 2
    ticks = cron(zone, "* * * * *").between(start, start + 86400, 5000)
    assert len(ticks) == 1440
    assert {b - a for a, b in itertools.pairwise(ticks)} == {60.0}


@pytest.mark.parametrize("zone", [NEW_YORK, LORD_HOWE, KOLKATA])
def test_every_interval_ignores_the_timezone(zone: ZoneInfo) -> None:
    # Given every 15 minutes, then ticks fall on multiples of 900 s from the epoch.
    ticks = Ticks(zone, every=900).between(utc("2027-11-07T04:50"), utc("2027-11-07T07:00"), 100)
    assert iso(ticks)[:2] == ["2027-11-07T05:00:00", "2027-11-07T05:15:00"]
    assert len(ticks) == 9 and all(t % 900 == 0 for t in ticks)


def test_seconds_field_and_every_second() -> None:
    start = utc("2027-11-07T05:59:58")
    six = cron(NEW_YORK, "*/2 * * * * *").between(start, start + 6, 100)
    assert iso(six) == ["2027-11-07T06:00:00", "2027-11-07T06:00:02", "2027-11-07T06:00:04"]
    assert Ticks(UTC_ZONE, every=1).between(start, start + 3, 100) == [
        start + 1, start + 2, start + 3
    ]  # fmt: skip


UTC_ZONE = ZoneInfo("UTC")


def test_after_inside_the_repeated_hour_is_after() -> None:
    # Given 01:30 daily, when asked at 01:10 EST (after 01:30 EDT fired), then the next day.
    assert iso([cron(NEW_YORK, "30 1 * * *").after(utc("2027-11-07T06:10"))]) == [
        "2027-11-08T06:30:00"
    ]


def test_between_keeps_the_latest() -> None:
    ticks = Ticks(UTC_ZONE, every=60).between(0, 600, 3)
    assert ticks == [480.0, 540.0, 600.0]
    assert cron(UTC_ZONE, "* * * * *").between(0, 600, 3) == ticks


@pytest.mark.parametrize("text", ["* * * *", "61 * * * *", "* * * * * * *", "x * * * *"])
def test_bad_cron_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cron"):
        cron_expression(text)
