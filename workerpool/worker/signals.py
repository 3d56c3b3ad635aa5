"""SIGTERM and SIGINT for the ``workerpool`` command, from the first line it runs.

Started as ``python -m workerpool`` or as the ``workerpool`` script, the process imports this
package first, a second or more of imports before any command runs (measured: 1-2 s on a
busy 2-core host), and a signal's default action meanwhile kills it (exit -15, or a
KeyboardInterrupt traceback). So the package's ``__init__`` holds them from its first line:
recorded, not acted on. A command that drains (``run``, ``autoscale``) takes the record over
and stops as soon as it can; any other gets Python's defaults back, and a signal that came
meanwhile acts then. An application that merely imports workerpool keeps its own handlers.

Standard library only: it runs before anything else is imported.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT)
# Python's own handling of those.
_DEFAULTS = ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))


class Signals:
    """Signal handlers only record; a thread of its own sets ``stop`` at the first signal and
    ``hurry`` at the second (the second skips the drain's wait), and the main thread acts.

    A handler runs on the main thread between two of its bytecodes, and the main thread may
    hold the lock of the very Event the handler would set: ``Event.wait`` takes it each time
    round, and a lock is not reentrant. A worker whose SIGTERM came at that instant hung for
    good in the handler's ``Event.set``. So the handler only assigns and puts into a
    ``SimpleQueue``, whose put is reentrant."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self.at = 0.0  # monotonic time of the first signal: the drain's deadline counts from it
        self.first = 0  # which signal that was
        self._arrived: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None

    def install(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch, name="workerpool-signals", daemon=True
            )
            self._watcher.start()
        for signum in HANDLED:
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Python's default handling again; a signal recorded meanwhile acts now."""
        for signum, default in _DEFAULTS:
            signal.signal(signum, default)
        if self.first:
            signal.raise_signal(self.first)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.first:
            self.at = time.monotonic()
            self.first = signum
        self._arrived.put(signum)

    def _watch(self) -> None:
        while True:
            self._arrived.get()
            (self.hurry if self.stop.is_set() else self.stop).set()


def _defaults_in_a_forked_child() -> None:
    """A child forked without exec (a job's ``multiprocessing`` pool, say) has no watcher
    thread: a signal its handlers record there never acts. A pool's ``terminate()``, which
    sends its busy workers SIGTERM, waited for good. Such a child gets Python's defaults."""
    for signum, default in _DEFAULTS:
        if isinstance(getattr(signal.getsignal(signum), "__self__", None), Signals):
            signal.signal(signum, default)


if hasattr(os, "register_at_fork"):  # (not on Windows, which never forks)
    os.register_at_fork(after_in_child=_defaults_in_a_forked_child)

_held: Signals | None = None


def hold_if_command() -> None:
    """Record SIGTERM and SIGINT from now on if this process is the ``workerpool`` command."""
    global _held
    if _held is None and _is_command() and threading.current_thread() is threading.main_thread():
        _held = Signals()
        _held.install()


def held() -> Signals | None:
    """The signals held since the process started (None if it is not the command)."""
    return _held


def release() -> None:
    """For a command that does not drain: Python's defaults again (a held signal acts now)."""
    global _held
    if _held is not None:
        signals, _held = _held, None
        signals.restore()


def _is_command() -> bool:
    # While ``python -m workerpool`` imports the package, sys.argv[0] is "-m" and the module
    # follows "-m" in the original command line; the script keeps its own name.
    argv = sys.orig_argv
    module = next((argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "-m"), None)
    if sys.argv and sys.argv[0] == "-m":
        return module == "workerpool"
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "workerpool"
