"""What ``serve`` does to the worker's process once its pools run (in a process of its own:
it changes the interpreter's garbage collector for good)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import gc, json, sys
gc.set_threshold(*json.loads(sys.argv[1]))
from workerpool.assembly.service import collect_rarely
collect_rarely()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((700, 10, 10), (10_000, 10, 10)),
        ((50_000, 5, 5), (50_000, 5, 5)),
        ((0, 10, 10), (0, 10, 10)),
    ],
    ids=["python's default", "set higher already", "turned off"],
)
def test_the_worker_collects_young_objects_rarely_and_never_scans_what_it_made_to_start(
    before: tuple[int, int, int], after: tuple[int, int, int]
) -> None:
    # Given a process with these collector thresholds
    # When the worker has started its pools
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(before)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    seen = json.loads(done.stdout)
    # Then a young collection waits for 10,000 allocations unless it waited longer already
    # (or collection was off), the older generations keep theirs, and what exists now is
    # out of the collector's sight
    assert tuple(seen["threshold"]) == after
    assert seen["frozen"] > 1000
