"""Calls made together in a round of one thread (the pure logic; the emulator suites run it
under every recorded batch of completions)."""

from __future__ import annotations

import logging
import threading

import pytest

from workerpool.worker.together import one_round, together


def test_outside_a_round_the_call_is_made_at_once() -> None:
    calls: list[list[int]] = []
    together(calls.append, 1)
    assert calls == [[1]]


def test_a_round_makes_each_call_once_with_its_items_in_order() -> None:
    evens: list[list[int]] = []
    odds: list[list[int]] = []
    with one_round():
        for i in range(6):
            together(evens.append if i % 2 == 0 else odds.append, i)
        assert evens == odds == []  # queued until the round ends
    assert evens == [[0, 2, 4]]
    assert odds == [[1, 3, 5]]


def test_a_round_inside_a_round_leaves_the_calls_to_the_outer_one() -> None:
    made: list[list[str]] = []
    with one_round():
        with one_round():
            together(made.append, "inner")
        assert made == []
        together(made.append, "outer")
    assert made == [["inner", "outer"]]


def test_a_call_that_raises_is_logged_and_the_rounds_other_calls_are_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made: list[list[str]] = []

    def broken(items: list[str]) -> None:
        raise RuntimeError("a bug")

    with caplog.at_level(logging.ERROR), one_round():
        together(broken, "x")
        together(made.append, "y")
    assert made == [["y"]]
    assert "broken of 1 items failed" in caplog.text
    together(made.append, "after")  # the round is over: at once
    assert made == [["y"], ["after"]]


def test_a_round_is_the_threads_own() -> None:
    made: list[list[str]] = []
    with one_round():
        thread = threading.Thread(target=lambda: together(made.append, "t"))
        thread.start()
        thread.join()
        assert made == [["t"]]  # made at once on the other thread
        together(made.append, "u")
    assert made == [["t"], ["u"]]
