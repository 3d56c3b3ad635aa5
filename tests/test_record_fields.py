"""Records the fleet shares in a store, as a worker reads them in a rolling deploy: one
written by a later workerpool, with a field this one does not know, reads as this one's."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import pytest

from tests.fakes import make_beat
from workerpool.batches.store import Tally
from workerpool.heartbeats import store as heartbeats
from workerpool.leadership import store as leadership
from workerpool.progress import store as progress
from workerpool.stores import known_fields

REPORT = progress.Report(
    key="r1/job-1", job="demo.sleep", job_id="job-1", replica="r1", started=10.0, done=3.0,
    total=None, note="page 3", at=12.0, until=42.0,
)  # fmt: skip
LEASE = leadership.Lease(holder="r1", token=7, until=99.5)

RECORDS: list[tuple[object, Callable[[str], Any]]] = [
    (make_beat("r1", running=2), heartbeats.decode),
    (LEASE, leadership.decode),
    (REPORT, progress.decode),
]


@pytest.mark.parametrize(("record", "decode"), RECORDS, ids=["beat", "lease", "progress"])
def test_a_record_with_a_field_added_by_a_later_release_reads_as_this_ones(
    record: Any, decode: Callable[[str], Any]
) -> None:
    # Given the record's text as a later workerpool writes it, with one field more
    text = json.dumps({**asdict(record), "added_later": {"any": "value"}})
    # When this release reads it, it is the record it wrote
    assert decode(text) == record


def test_a_tally_with_a_field_added_by_a_later_release_reads_as_this_ones() -> None:
    tally = Tally(total=5, done=2, failed=1)
    assert known_fields(Tally, {**asdict(tally), "cancelled": 1}) == tally


def test_a_record_missing_a_field_this_release_needs_is_still_an_error() -> None:
    # (An earlier release's record lacks nothing this one needs; a field gone missing is a
    # bug or a foreign writer, and must not read as a record with a hole in it.)
    text = json.dumps({"holder": "r1", "token": 7})
    with pytest.raises(TypeError, match="until"):
        leadership.decode(text)
