"""The worker's side of cancels: a job id cancelled never starts, and a run of one stops.

``Cancels`` knows which of the job ids this worker holds (admitted and not settled yet, run
or not) are cancelled: it reads the store for each pull's job ids as the pool admits them,
then for all it holds about once a second, on a thread of its own. A run about to start its
handler needs a read of its job id that began at most ``SEEN_WITHIN`` ago; ``cancel`` returns
only once that long has passed since it wrote, so a job cancelled before it starts (held for
a slot, say) never starts. The periodic read is almost always recent enough; when it is not
(a store slow to answer), the run waits for a read that begins after it asked, and one such
read serves every run waiting then. One read of the job ids' index each time, so a job costs
the store a share of a read, not a read of its own. Two middleware read what it knows:

- ``CancelGate``, before the claim: a job cancelled before it starts ends ``Cancelled``
  there, and takes no claim, slot or token (a claim its admission took is let go).
- ``CancelWatch``, the innermost of the defaults, around the handler: a run whose job id is
  cancelled while it runs sees ``ctx.cancelled`` (an async job's task is cancelled after a
  grace of ``CANCEL_GRACE``, to end on its own meanwhile) and ends ``Cancelled`` whatever
  its handler returned or raised; the idempotency middleware outside it then records its
  job id as done, so no redelivery runs it.

A store that cannot be read stops nothing: jobs run as if not cancelled, and the next look
tries again (a warning when it starts failing, and one when it recovers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from workerpool.control.store import SEEN_WITHIN, Cancel, CancelStore
from workerpool.stores import StoreError
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import job_id_of
from workerpool.worker.middleware import Ended, Middleware
from workerpool.worker.outcome import Cancelled, Outcome
from workerpool.worker.run import Run, Settled
from workerpool.worker.together import together

log = logging.getLogger(__name__)

# How often the job ids held here are looked up: a running job sees its cancel within this
# and one read of the store.
POLL_INTERVAL = 1.0
# How long an ``async def`` handler told to stop may take to end on its own (it may await
# ``ctx.cancelled``) before its task is cancelled.
CANCEL_GRACE = 0.5


class Cancels:
    def __init__(
        self,
        store: CancelStore,
        *,
        interval: float = POLL_INTERVAL,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._interval = interval
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()  # admitted, not settled: deliveries by job id
        self._running: dict[str, set[Run]] = {}
        self._known: dict[str, Cancel] = {}  # the cancelled among those two
        # When the last read that looked each of those two up began (``monotonic``).
        self._read_at: dict[str, float] = {}
        self._stopped: dict[Run, Cancel] = {}  # runs told to stop, until they end
        self._failing = False
        # Reads for runs about to start: those asking since the last began, and how many
        # began and ended (a run waits for the first that began after it asked).
        self._starting: set[str] = set()
        self._begun = self._ended = 0
        self._fresh = threading.Condition(threading.Lock())
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="workerpool-cancels", daemon=True)
        self._thread.start()

    def admitted(self, job_ids: Sequence[str]) -> None:
        with self._lock:
            self._held.update(job_ids)
        self._look(job_ids)

    def settled(self, job_ids: list[str]) -> None:
        """Deliveries of these job ids left the pool (a job id once a delivery)."""
        with self._lock:
            for job_id in job_ids:
                # A dict's own get and pop: a Counter's ``-=`` and ``del`` are Python methods.
                count = self._held.get(job_id, 0) - 1
                if count > 0:
                    self._held[job_id] = count
                    continue
                self._held.pop(job_id, None)
                if job_id not in self._running:
                    self._known.pop(job_id, None)
                    self._read_at.pop(job_id, None)

    def known(self, job_id: str) -> Cancel | None:
        return self._known.get(job_id)

    def begin(self, run: Run) -> Cancel | None:
        """The run's job id's cancel, read at most ``SEEN_WITHIN`` before this call; else
        the run is watched until ``end``."""
        job_id = run.job.job_id
        with self._lock:  # once, when a read recent enough has looked it up (most runs)
            read_at = self._read_at.get(job_id)
            if read_at is not None and self._monotonic() - read_at <= SEEN_WITHIN:
                return self._watch(job_id, run)
        self._read_fresh(job_id)
        with self._lock:
            return self._watch(job_id, run)

    def _watch(self, job_id: str, run: Run) -> Cancel | None:
        """(Under the lock.) The job id's cancel, or None, and then ``run`` is watched."""
        cancel = self._known.get(job_id)
        if cancel is None:
            runs = self._running.get(job_id)
            if runs is None:
                self._running[job_id] = {run}
            else:
                runs.add(run)
        return cancel

    def end(self, run: Run) -> Cancel | None:
        """The run's end: the cancel it was stopped for, if it was."""
        job_id = run.job.job_id
        with self._lock:
            runs = self._running.get(job_id)
            if runs is not None:
                runs.discard(run)
            if not runs:
                self._running.pop(job_id, None)
                if job_id not in self._held:  # settled while it ran (handed back, say)
                    self._known.pop(job_id, None)
                    self._read_at.pop(job_id, None)
            return self._stopped.pop(run, None) if self._stopped else None

    def _read_fresh(self, job_id: str) -> None:
        """Return once a read of the store that began after this call, and looked ``job_id``
        up, has ended: the caller reading it is a leader for all those asking meanwhile."""
        with self._fresh:
            self._starting.add(job_id)
            mine = self._begun + 1  # the next read to begin covers this job id
            while self._ended < mine:
                if self._begun == self._ended:  # none under way: lead the next
                    job_ids, self._starting = self._starting, set()
                    self._begun += 1
                    self._fresh.release()
                    try:
                        self._look(job_ids)
                    finally:
                        self._fresh.acquire()
                        self._ended += 1
                        self._fresh.notify_all()
                else:
                    self._fresh.wait()

    def _poll(self) -> None:
        while not self._closing.wait(self._interval):
            try:
                self._poll_once()
            except Exception:  # a bug, not an outage (``_look`` keeps those): read on
                log.exception("cancels not read")

    def _poll_once(self) -> None:
        with self._lock:
            job_ids = set(self._held) | set(self._running)
        if job_ids:
            self._look(job_ids)

    def _look(self, job_ids: Collection[str]) -> None:
        began = self._monotonic()
        try:
            found = self._store.find(job_ids, self._clock())
        except StoreError as exc:
            if not self._failing:
                log.warning("cancels not read (%s); jobs run as if not cancelled", exc)
            self._failing = True
            return
        if self._failing:
            log.warning("cancels read again")
            self._failing = False
        stopping: list[tuple[Run, Cancel]] = []
        with self._lock:
            held, running, read_at = self._held, self._running, self._read_at
            for job_id in job_ids:
                if job_id in held or job_id in running:
                    last = read_at.get(job_id)
                    if last is None or last < began:
                        read_at[job_id] = began
            for job_id, cancel in found.items():
                if job_id not in self._held and job_id not in self._running:
                    continue  # settled meanwhile
                self._known[job_id] = cancel
                for run in self._running.get(job_id, ()):
                    if run not in self._stopped:
                        self._stopped[run] = cancel
                        stopping.append((run, cancel))
        for run, cancel in stopping:
            log.info(
                "job %s (%s) cancelled while it runs%s", run.job.name, run.job.job_id,
                f": {cancel.reason}" if cancel.reason else "",
            )  # fmt: skip
            run.ctx.cancel_grace = CANCEL_GRACE  # first: read as the flag is set
            run.ctx.cancelled.set()

    def close(self, timeout: float) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._store.close()


class CancelGate(Middleware):
    """Ends a run whose job id is cancelled before it takes anything (see the module)."""

    def __init__(self, cancels: Cancels) -> None:
        self.cancels = cancels

    def start(self) -> None:
        self.cancels.start()

    def admitted(self, deliveries: Sequence[Delivery]) -> None:
        self.cancels.admitted([job_id_of(delivery) for delivery in deliveries])

    def before(self, run: Run) -> Outcome | None:
        cancel = self.cancels.known(run.job.job_id)
        return None if cancel is None else Cancelled(cancel.reason)

    def settled(self, event: Settled) -> None:
        together(self.cancels.settled, event.job_id)

    def close(self, timeout: float) -> None:
        self.cancels.close(timeout)


class CancelWatch(Middleware):
    """Stops a run whose job id is cancelled while it runs (see the module)."""

    def __init__(self, cancels: Cancels) -> None:
        self._cancels = cancels

    def before(self, run: Run) -> Outcome | None:
        cancel = self._cancels.begin(run)
        # Cancelled while it waited for a slot or a token: it ends here, never begun.
        return None if cancel is None else Cancelled(cancel.reason)

    def after(self, run: Run, ended: Ended) -> Ended:
        stopped = self._cancels.end(run)
        if stopped is None or isinstance(ended, BaseException):
            return ended
        return Cancelled(stopped.reason)
