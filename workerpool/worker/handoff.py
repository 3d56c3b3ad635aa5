"""The slot threads' queue, handing its items to as few threads as keep up with them.

A thread that finds the queue empty waits on a lock of its own; waiting threads are woken
newest first, so the threads that keep running are the ones that ran last. A put wakes one
thread, unless one woken already is on its way. More are woken only by the watch, which
looks every ``tick`` while items and waiting threads are both there:

- if the process used less than half a CPU since it last looked, every thread woken had
  arrived, the watch looked in time (nothing held it up), and the thread that took the last
  item is not runnable (waiting for a CPU another process has), the threads that took the
  last items wait on I/O, not on the GIL: it wakes a thread for each item;
- else, once the process has used ``still`` of CPU with no item taken (a run holds the GIL),
  it wakes more, twice as many each time, until the queue empties.

``queue.SimpleQueue`` wakes the next waiting thread whenever one takes an item and more are
left. Under a backlog of short jobs that kept every slot thread awake, each wanting the GIL
to run a job the thread before it could have run in less time than the hand-off took; and
with two cores free, each voluntary drop of the GIL (a SQLite call, a write, a lock held by
another) then went to yet another slot thread. Measured at N = 100 with no-op jobs: slot
threads were put on a CPU 2.3-4.7 times a job that way, against 0.04-0.15 here. How long
runs take cannot tell the two apart: a run held up by threads taking the GIL in turn takes
long too, and waking more threads for it holds it up more. Time the process was given no CPU
(another process's turn, a container's CPU limit) counts as neither. On a machine whose cores
are busy with other processes, the watch may be given a CPU in time while the thread running
the last item is not: read from the process's CPU alone, no-op runs beside the emulator
looked like runs waiting on I/O, and up to 112 threads were woken for them in 6 of 11 bench
runs (measured), which then took items in turn.

``get`` is for threads other than the main one: an exception raised while it waits (a
signal's) would leave the thread counted as waiting.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

# How often the watch looks while items and waiting threads are both there.
TICK = 0.001
# The longest the watch pauses after failing again and again (a bug): each pause doubles,
# from a tick, so that one raising at every look writes a few lines a second, not a thousand.
_MOST_PAUSE = 1.0


def runnable(thread: int) -> bool:
    """Whether the thread of this process with native id ``thread`` is running or waiting for
    a CPU, as Linux says (``/proc``); False where it cannot be read (no such thread, no
    ``/proc``). Read only when the watch would wake a thread per item."""
    try:
        with open(f"/proc/self/task/{thread}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    # "tid (name) state ...": the name may hold spaces and parentheses of its own
    after_name = fields.rfind(b")")
    return fields[after_name + 2 : after_name + 3] == b"R"


class Handoff(Generic[T]):
    def __init__(self, name: str, *, tick: float = TICK, still: float | None = None) -> None:
        """``still``: how much CPU the process may use with no item taken before the watch
        wakes more threads (by default, twice the interpreter's switch interval: a thread
        waiting for the GIL may wait that long for two others in turn)."""
        self._mutex = threading.Lock()
        self._filled = threading.Condition(self._mutex)  # the watch waits on it, parked
        self._items: collections.deque[T] = collections.deque()
        self._idle: list[threading.Lock] = []  # each waiting thread's own lock, newest last
        self._on_the_way = 0  # woken, and not yet back at the queue
        self._taken = 0  # items taken so far: the watch sees the queue move by it
        self._last_taker = 0  # the native id of the thread that took the last item (0: none)
        self._emptied = 0  # times the last item was taken
        self._closed = False
        self._watch_parked = False  # waiting for items and idle threads both, not looking
        self._tick = tick
        self._still = max(tick, 2 * sys.getswitchinterval()) if still is None else still
        self._own = threading.local()
        self._watch = threading.Thread(target=self._watch_loop, name=f"{name}-handoff", daemon=True)

    @property
    def idle(self) -> int:
        """Threads waiting for an item."""
        return len(self._idle)

    def start(self) -> None:
        self._watch.start()

    def put(self, item: T) -> None:
        self.put_many((item,))

    def put_many(self, items: Iterable[T]) -> None:
        with self._mutex:
            queued = len(self._items)
            self._items.extend(items)
            if len(self._items) == queued:
                return
            if not self._on_the_way:
                self._wake(1)
            if self._idle and self._watch_parked:
                self._filled.notify()

    def get(self) -> T | None:
        """The oldest item, waiting for one; None once closed and empty."""
        me: tuple[threading.Lock, int] | None = getattr(self._own, "me", None)
        if me is None:
            me = self._own.me = (threading.Lock(), threading.get_native_id())
            me[0].acquire()  # held but while another thread wakes this one
        lock, native_id = me
        with self._mutex:
            while True:
                if self._items:
                    self._taken += 1
                    self._last_taker = native_id
                    item = self._items.popleft()
                    if not self._items:
                        self._emptied += 1
                    return item
                if self._closed:
                    return None
                self._idle.append(lock)
                self._mutex.release()
                try:
                    lock.acquire()
                finally:
                    self._mutex.acquire()
                    self._on_the_way -= 1

    def take_all(self) -> list[T]:
        """Every item queued, at once."""
        with self._mutex:
            items = list(self._items)
            self._items.clear()
            self._taken += len(items)
            self._emptied += 1
            return items

    def close(self) -> None:
        """Every thread's ``get`` returns None once the queue is empty; the watch ends."""
        with self._mutex:
            self._closed = True
            self._wake(len(self._idle))
            self._filled.notify()

    def _wake(self, count: int) -> None:
        """(Under the mutex.) Wake up to ``count`` waiting threads, newest first."""
        for _ in range(min(count, len(self._idle))):
            self._on_the_way += 1
            self._idle.pop().release()

    def _watch_loop(self) -> None:
        pause = self._tick
        while not self._closed:
            looked_since = time.monotonic()
            try:
                self._look_until_closed()
            except Exception:  # a bug: without the watch, items may wait behind held runs
                if time.monotonic() - looked_since > _MOST_PAUSE:
                    pause = self._tick  # it had looked well for a while: not failing again
                log.exception("%s failed; it looks again in %g s", self._watch.name, pause)
                time.sleep(pause)
                pause = min(2 * pause, max(_MOST_PAUSE, self._tick))

    def _look_until_closed(self) -> None:
        with self._mutex:
            while not self._closed:
                # Threads to wake while the queue stands still: twice as many each time.
                more, emptied = 1, self._emptied
                taken, still_since = self._taken, time.process_time()
                while self._items and self._idle and not self._closed:
                    arrived = not self._on_the_way
                    since, cpu = time.monotonic(), time.process_time()
                    self._filled.wait(self._tick)
                    now, used = time.monotonic(), time.process_time()
                    if self._taken != taken:
                        taken, still_since = self._taken, used
                    if self._emptied != emptied:
                        more, emptied = 1, self._emptied
                    waiting = len(self._items) - self._on_the_way
                    looked = now - since
                    waits_on_io = (
                        arrived
                        and not self._on_the_way
                        and looked < 2 * self._tick
                        and used - cpu < looked / 2
                        and not runnable(self._last_taker)
                    )
                    if waiting <= 0:
                        continue
                    if waits_on_io:
                        self._wake(waiting)
                    elif used - still_since >= self._still:
                        self._wake(min(more, waiting))
                        still_since, more = used, more * 2
                if not self._closed:
                    self._watch_parked = True
                    self._filled.wait()
                    self._watch_parked = False
