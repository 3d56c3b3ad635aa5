"""How the ``workerpool`` command records SIGTERM and SIGINT (``workerpool.worker.signals``)."""

from __future__ import annotations

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


def test_a_signal_that_comes_while_the_main_thread_holds_an_events_lock_still_stops() -> None:
    # Given a process whose main thread holds the lock of the Event a signal sets (as
    # Event.wait does each time round), when SIGTERM then SIGINT come at that instant
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_THE_LOCK_IS_HELD],
        capture_output=True,
        text=True,
        timeout=30,
    )
    # Then the first sets stop and the second hurry, and nothing hangs
    assert done.returncode == 0, done.stderr
