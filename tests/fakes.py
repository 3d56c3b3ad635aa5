"""Fakes for the project's own pure-logic tests (the data-path ones are the test kit's:
``workerpool.testing.fakes``)."""

from __future__ import annotations


class FakeClock:
    """A clock that tests advance instead of sleeping (wall-clock seconds by default)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
