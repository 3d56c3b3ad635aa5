"""The slot threads' queue: items taken once each, in order, by as few threads as keep up."""

from __future__ import annotations

import os
import threading
import time
import types
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support import wait_for
from workerpool.worker import handoff as handoff_module
from workerpool.worker.handoff import Handoff


def _takers(
    handoff: Handoff[int], count: int, run: Callable[[int], None]
) -> tuple[list[threading.Thread], list[tuple[int, int]]]:
    """``count`` threads taking items and running each through ``run`` until the queue
    closes; what each took, in the order taken."""
    taken: list[tuple[int, int]] = []
    lock = threading.Lock()

    def take() -> None:
        while (item := handoff.get()) is not None:
            with lock:
                taken.append((threading.get_ident(), item))
            run(item)

    threads = [threading.Thread(target=take, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, taken


def _spin(seconds: float) -> None:
    """Hold the GIL but for the interpreter's forced switches, as a run doing Python work."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _closed(handoff: Handoff[int], threads: list[threading.Thread]) -> None:
    handoff.close()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads)


def _all_run_together(count: int) -> None:
    """``count`` items put at once, each run waiting until all of them run together: the
    put wakes one thread, which takes the first item and waits, so only the watch can wake
    the others (the queue standing still is not looked at here)."""
    handoff: Handoff[int] = Handoff("t", still=60)
    handoff.start()
    together = threading.Barrier(count)
    passed: list[int] = []

    def run(item: int) -> None:
        together.wait(10)
        passed.append(item)

    threads, _ = _takers(handoff, count, run)
    handoff.put_many(range(count))
    assert wait_for(lambda: len(passed) == count, timeout=5)
    assert not together.broken
    _closed(handoff, threads)


def test_items_are_taken_once_each_in_order_and_close_lets_what_is_queued_be_taken() -> None:
    handoff: Handoff[int] = Handoff("t")
    handoff.start()
    handoff.put_many(range(100))
    handoff.put(100)
    threads, taken = _takers(handoff, 4, lambda item: None)
    assert wait_for(lambda: len(taken) == 101, timeout=5)
    handoff.put_many(range(101, 200))
    _closed(handoff, threads)
    assert sorted(item for _, item in taken) == list(range(200))
    for thread in {thread for thread, _ in taken}:  # oldest first
        mine = [item for taker, item in taken if taker == thread]
        assert mine == sorted(mine)


def test_take_all_empties_the_queue_at_once() -> None:
    handoff: Handoff[int] = Handoff("t")
    handoff.put_many([1, 2, 3])
    assert handoff.take_all() == [1, 2, 3]
    assert handoff.take_all() == []
    handoff.close()
    assert handoff.get() is None


def test_a_backlog_of_short_runs_is_taken_by_the_thread_already_taking_it() -> None:
    # queue.SimpleQueue wakes another waiting thread each time one takes an item and more
    # are left: here every one of the 16 would take some. (The queue standing still is not
    # looked at here. On a machine busy with other processes, the taker may be given no CPU
    # for a tick while the watch runs: the process looks idle, and the watch wakes a thread
    # or two more. Under the suite's load 3 threads took 900, 58 and 42 of the 1,000.)
    handoff: Handoff[int] = Handoff("t", still=60)
    handoff.start()
    threads, taken = _takers(handoff, 16, lambda item: _spin(0.00005))
    assert wait_for(lambda: handoff.idle == 16, timeout=5)
    for batch in range(1, 11):
        handoff.put_many(range((batch - 1) * 100, batch * 100))
        assert wait_for(lambda end=batch * 100: len(taken) == end, timeout=10)
    _closed(handoff, threads)
    takers = Counter(thread for thread, _ in taken)
    assert len(takers) <= 4 and max(takers.values()) >= 800, takers


def test_items_queued_behind_runs_waiting_on_io_each_get_a_thread_at_once() -> None:
    _all_run_together(8)


def test_items_queued_behind_runs_holding_the_gil_get_threads() -> None:
    # A put wakes one thread, which takes the first item; the process is busy, so the queue
    # standing still is what wakes threads for the others. The first two runs spin until
    # the third has started.
    handoff: Handoff[int] = Handoff("t")
    handoff.start()
    third_started = threading.Event()

    def run(item: int) -> None:
        if item == 2:
            third_started.set()
            return
        deadline = time.monotonic() + 10
        while not third_started.is_set() and time.monotonic() < deadline:
            _spin(0.001)

    threads, _ = _takers(handoff, 3, run)
    handoff.put_many(range(3))
    assert third_started.wait(5)
    _closed(handoff, threads)


def test_the_watch_survives_an_error_and_goes_on_looking(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its first reading of the CPU clock raises: the watch must still wake the threads the
    # runs waiting on I/O need (only it wakes them here).
    calls = 0

    def process_time() -> float:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return time.process_time()

    clock = types.SimpleNamespace(
        monotonic=time.monotonic, process_time=process_time, sleep=time.sleep
    )
    monkeypatch.setattr(handoff_module, "time", clock)
    _all_run_together(4)
    assert calls > 1


def test_a_watch_failing_at_every_look_pauses_twice_as_long_each_time_up_to_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a watch whose every look raises (its CPU clock, here), but its 20th, which looks
    # for two seconds (of its monotonic clock) first
    pauses: list[float] = []
    looks = 0
    now = 0.0
    handoff: Handoff[int] = Handoff("t")

    def process_time() -> float:
        nonlocal looks, now
        looks += 1
        if looks == 20:
            now += 2.0
        raise RuntimeError("a bug")

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 23:
            handoff.close()

    clock = types.SimpleNamespace(monotonic=lambda: now, process_time=process_time, sleep=sleep)
    monkeypatch.setattr(handoff_module, "time", clock)
    # When it runs until it has paused 23 times
    handoff.start()
    handoff._watch.join(5)
    # Then each pause doubled the last, from a tick, none over a second; and after the look
    # that went on for a while, they started from a tick again
    doubling = [min(handoff_module.TICK * 2**i, 1.0) for i in range(19)]
    assert pauses == doubling + doubling[:4]


def test_items_behind_a_run_given_no_cpu_do_not_each_get_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given runs that wait, the process idle meanwhile, but whose thread the OS says is
    # runnable (as one is while other processes have the machine's cores)
    looked = 0
    given_no_cpu = True

    def runnable(thread: int) -> bool:
        nonlocal looked
        looked += 1
        return given_no_cpu

    monkeypatch.setattr(handoff_module, "runnable", runnable)
    handoff: Handoff[int] = Handoff("t", still=60)  # (the queue standing still is not looked at)
    handoff.start()
    release = threading.Event()
    started: list[int] = []

    def run(item: int) -> None:
        started.append(item)
        release.wait(10)

    threads, _ = _takers(handoff, 4, run)
    assert wait_for(lambda: handoff.idle == 4, timeout=5)
    # When four items are put at once
    handoff.put_many(range(4))
    # Then while that thread is runnable, the watch looks and wakes no thread per item
    assert wait_for(lambda: looked >= 20, timeout=10)
    assert started == [0]
    # and once it is not (it waits on I/O), each item gets a thread
    given_no_cpu = False
    assert wait_for(lambda: len(started) == 4, timeout=5)
    release.set()
    _closed(handoff, threads)


def test_a_thread_runnable_is_told_from_one_waiting() -> None:
    # Given a thread waiting on an event, and this one, running
    waiting_id: list[int] = []
    go = threading.Event()

    def wait() -> None:
        waiting_id.append(threading.get_native_id())
        go.wait(10)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_for(lambda: bool(waiting_id), timeout=5)
    # Then the OS says this one runs and the other does not; one that is gone does not either
    assert handoff_module.runnable(threading.get_native_id())
    assert wait_for(lambda: not handoff_module.runnable(waiting_id[0]), timeout=5)
    go.set()
    waiter.join(5)
    # (join returns as the thread lets its Python state go, an instant before it exits)
    assert wait_for(lambda: not os.path.exists(f"/proc/self/task/{waiting_id[0]}"), timeout=5)
    assert not handoff_module.runnable(waiting_id[0])
