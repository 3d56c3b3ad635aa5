"""What each page shows, read from the stores the fleet shares and from Pub/Sub: plain data,
no HTML (the templates render it, escaped)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from workerpool.batches.store import Batch
from workerpool.config import Settings
from workerpool.dashboard.schedules import fleet_schedules
from workerpool.dashboard.stores import Openers, opened
from workerpool.leadership import Noted
from workerpool.ops.keys import KeyState, key_states
from workerpool.ops.status import backlog_lines
from workerpool.periodic import Marks, Periodic
from workerpool.progress import Report
from workerpool.pubsub import subscription_path
from workerpool.schedule.store import Entry

# The chart's span: jobs done per minute over the last hour.
CHART_MINUTES = 60
# Rows a list shows at most.
LIMIT = 100


@dataclass(frozen=True)
class Replica:
    replica: str
    host: str
    subscription: str
    slots: int
    running: int
    held: int  # messages held and not started yet
    draining: bool
    beat_age: float  # seconds since its last beat

    @property
    def free(self) -> int:
        return max(0, self.slots - self.running)


@dataclass(frozen=True)
class BatchRow:
    batch: Batch
    pending_ids: list[str]

    @property
    def percent(self) -> int:
        settled = self.batch.done + self.batch.failed
        return round(100 * settled / self.batch.total) if self.batch.total else 100


@dataclass(frozen=True)
class PeriodicRow:
    name: str
    job: str
    next_tick: float
    last_tick: float | None  # None: never fired (or the store keeps no marks)
    paused: bool


class Fleet:
    """Reads the fleet ``settings`` describes: its subscriptions, the stores ``openers``
    open, and Cloud Monitoring (the backlog)."""

    def __init__(
        self,
        settings: Settings,
        openers: Openers,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.schedules = fleet_schedules(settings)
        self._openers = openers
        self._clock = clock

    def subscriptions(self) -> list[str]:
        return [
            subscription_path(pool.project, pool.subscription)
            for pool in self.settings.pool_settings()
            if pool.subscription
        ]

    def replicas(self) -> list[Replica]:
        now = self._clock()
        with opened(self._openers.heartbeats) as store:
            if store is None:
                return []
            beats = [beat for sub in self.subscriptions() for beat in store.live(sub, now)]
        return [
            Replica(b.replica, b.host, b.subscription, b.slots, b.running, b.waiting,
                    b.draining, now - b.at)
            for b in beats
        ]  # fmt: skip

    def backlog(self) -> dict[str, list[tuple[str, str]]]:
        """Each subscription's backlog and oldest unacked age (Cloud Monitoring), or why not."""
        return {sub: backlog_lines(sub) for sub in self.subscriptions()}

    def per_minute(self) -> dict[str, list[int] | None]:
        """Jobs done and runs failed in each of the last CHART_MINUTES minutes, oldest first,
        as the store counts them (None: it does not)."""
        last = int(self._clock() // 60)
        since = (last - CHART_MINUTES + 1) * 60
        with opened(self._openers.completions) as store:
            counts = {
                "done": None if store is None else store.completed_per_minute(since),
                "failed": None if store is None else store.failed_per_minute(since),
            }
        return {
            name: None if by_minute is None
            else [by_minute.get(m, 0) for m in range(last - CHART_MINUTES + 1, last + 1)]
            for name, by_minute in counts.items()
        }  # fmt: skip

    def decisions(self) -> dict[str, list[Noted]]:
        """Each subscription's last autoscaling decisions, newest first (empty where no
        autoscaler ran on this store)."""
        with opened(self._openers.leadership) as store:
            if store is None:
                return {}
            return {sub: store.decisions(sub)[:LIMIT] for sub in self.subscriptions()}

    def running(self) -> dict[str, list[Report] | int]:
        """The jobs running in the fleet, from the progress their runs write (a run shows
        once it has run about a second): the ``LIMIT`` oldest, and how many run."""
        with opened(self._openers.progress) as store:
            runs = [] if store is None else store.running(self._clock())
        return {"running": runs[:LIMIT], "running_total": len(runs)}

    def keys(self) -> list[KeyState]:
        if not self.settings.concurrency:
            return []
        with opened(self._openers.slots) as store:
            if store is None:
                return []
            return key_states(
                store, self.settings.concurrency, self._clock(), self.settings.concurrency_shards,
                most=LIMIT,
            )  # fmt: skip

    def batches(self) -> list[BatchRow]:
        with opened(self._openers.batches) as store:
            if store is None:
                return []
            return [
                BatchRow(b, store.pending_children(b.batch_id, LIMIT) if b.pending else [])
                for b in store.batches(LIMIT)
            ]

    def delayed(self) -> list[Entry]:
        with opened(self._openers.schedule) as store:
            return [] if store is None else store.entries(None, LIMIT)

    def periodic(self) -> list[PeriodicRow]:
        """The fleet's periodic schedules (``fleet_schedules``), each with its next tick and
        the last one the fleet fired."""
        now = self._clock()
        with opened(self._openers.marks if self.schedules else None) as marks:
            pauses = {} if marks is None else marks.pauses()
            return [
                _periodic(s, now, marks, s.name in pauses and pauses[s.name].paused)
                for s in self.schedules
            ]


def _periodic(schedule: Periodic, now: float, marks: Marks | None, paused: bool) -> PeriodicRow:
    last = None if marks is None else marks.last(schedule.name)
    return PeriodicRow(schedule.name, schedule.job, schedule.ticks.after(now), last, paused)
