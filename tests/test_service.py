"""What ``serve`` does to the worker's process once its pools run (in a process of its own:
it changes the interpreter's garbage collector for good)."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from typing import Any

import pytest

# The worker's modules imported once, then each case in a process forked from that one.
_PROBE = """
import gc, json, os, sys
from workerpool.assembly.service import collect_rarely
for before in json.loads(sys.argv[1]):
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        gc.set_threshold(*before)
        collect_rarely()
        seen = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
        os.write(write, json.dumps(seen).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        print(answer.read())
    assert os.waitpid(child, 0)[1] == 0
"""

CASES = {
    "python's default": ((700, 10, 10), (50_000, 10, 10)),
    "set higher already": ((80_000, 5, 5), (80_000, 5, 5)),
    "turned off": ((0, 10, 10), (0, 10, 10)),
}


@cache
def _seen() -> dict[str, dict[str, Any]]:
    """What each case's process had once the worker started, by case."""
    befores = [before for before, _ in CASES.values()]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(befores)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return dict(zip(CASES, map(json.loads, done.stdout.splitlines()), strict=True))


@pytest.mark.parametrize("case", CASES)
def test_the_worker_collects_young_objects_rarely_and_never_scans_what_it_made_to_start(
    case: str,
) -> None:
    # Given a process with these collector thresholds
    # When the worker has started its pools
    seen, (_, after) = _seen()[case], CASES[case]
    # Then a young collection waits for 50,000 allocations unless it waited longer already
    # (or collection was off), the older generations keep theirs, and what exists now is
    # out of the collector's sight
    assert tuple(seen["threshold"]) == after
    assert seen["frozen"] > 1000
