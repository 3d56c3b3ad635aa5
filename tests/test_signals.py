"""How the ``workerpool`` command records SIGTERM and SIGINT (``workerpool.worker.signals``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

# Run in a process of its own: on a handler that deadlocks, its main thread hangs for good.
_SIGNAL_WHILE_THE_LOCK_IS_HELD = textwrap.dedent(
    """
    import signal
    from workerpool.worker.signals import Signals

    signals = Signals()
    signals.install()
    # As Event.wait holds it for an instant each time round, on the main thread
    with signals.stop._cond:
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, on this thread
    assert signals.stop.wait(5), "the first signal did not set stop"
    assert signals.first == signal.SIGTERM and signals.at > 0
    with signals.hurry._cond:
        signal.raise_signal(signal.SIGINT)
    assert signals.hurry.wait(5), "the second signal did not set hurry"
    assert signals.first == signal.SIGTERM  # the first one still counts
    """
)


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by a Python of its own with ``args``, its output read back."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60
    )


def test_a_signal_that_comes_while_the_main_thread_holds_an_events_lock_still_stops() -> None:
    # Given a process whose main thread holds the lock of the Event a signal sets (as
    # Event.wait does each time round), when SIGTERM then SIGINT come at that instant
    done = _run(_SIGNAL_WHILE_THE_LOCK_IS_HELD)
    # Then the first sets stop and the second hurry, and nothing hangs
    assert done.returncode == 0, done.stderr


# Run in a process of its own: it installs the command's handlers (or, with an argument, a
# SIGTERM handler of its own, which exits 3).
_FORKED_FROM_A_SLOT_THREAD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from workerpool.worker.signals import Signals

    Signals().install()
    if sys.argv[1:]:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(3))
    forked = []

    def fork() -> None:  # as a job forks (a multiprocessing pool), on a slot thread
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            os._exit(0)
        forked.append(pid)

    thread = threading.Thread(target=fork)
    thread.start()
    thread.join()
    _, status = os.waitpid(forked[0], 0)
    print(os.waitstatus_to_exitcode(status))
    """
)


def test_a_child_forked_without_exec_ends_on_sigterm() -> None:
    # Given the command's handlers, when a thread forks a child that gets SIGTERM
    done = _run(_FORKED_FROM_A_SLOT_THREAD)
    # Then the child ended by it, as Python's default would have it (not 30 s later)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(-signal.SIGTERM)]


def test_a_childs_own_handler_is_left_to_it() -> None:
    # Given a SIGTERM handler of the application's own, when a thread forks a child that
    # gets SIGTERM
    done = _run(_FORKED_FROM_A_SLOT_THREAD, "own handler")
    # Then the child's handler, inherited, still handled it
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3"]
