"""The marks of the worker processes of one host: a table in the idempotency store's file,
beside the schedule of delayed jobs. Each compare-and-set is one statement."""

from __future__ import annotations

import os
import threading

from workerpool.periodic.marks import MISSED, PUBLISHED, SKIPPED, UNPUBLISHED, Mark, Marks, Pause
from workerpool.stores.sqlite import connect, translated

_LABEL = "periodic ticks"
# ``published`` holds a mark's state (workerpool.periodic.marks): 0 no, 1 yes, 2 skipped,
# 3 missed.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS periodic_ticks (
    schedule TEXT NOT NULL, tick REAL NOT NULL, marked_at REAL NOT NULL,
    published INTEGER NOT NULL, PRIMARY KEY (schedule, tick)
);
CREATE INDEX IF NOT EXISTS periodic_unpublished ON periodic_ticks (published, marked_at);
CREATE TABLE IF NOT EXISTS periodic_paused (
    schedule TEXT PRIMARY KEY, paused INTEGER NOT NULL, since REAL NOT NULL
);
"""


class SqliteMarks(Marks):
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one statement at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.executescript(_SCHEMA))

    def _changed(self, sql: str, *args: object) -> bool:
        with self._lock, translated(_LABEL):
            return self._conn.execute(sql, args).rowcount == 1

    def mark(self, schedule: str, tick: float, now: float) -> bool:
        return self._changed(
            "INSERT OR IGNORE INTO periodic_ticks VALUES (?, ?, ?, ?)",
            schedule, tick, now, UNPUBLISHED,
        )  # fmt: skip

    def take_over(self, mark: Mark, now: float) -> bool:
        return self._changed(
            "UPDATE periodic_ticks SET marked_at = ? "
            "WHERE schedule = ? AND tick = ? AND marked_at = ? AND published = ?",
            now, mark.schedule, mark.tick, mark.marked_at, UNPUBLISHED,
        )  # fmt: skip

    def published(
        self, schedule: str, tick: float, forget_before: float, state: int = PUBLISHED
    ) -> None:
        self._changed(
            "UPDATE periodic_ticks SET published = ? WHERE schedule = ? AND tick = ?",
            state, schedule, tick,
        )  # fmt: skip
        self._changed(
            "DELETE FROM periodic_ticks WHERE schedule = ? AND tick < ? AND published != ?",
            schedule, forget_before, UNPUBLISHED,
        )  # fmt: skip

    def last_run(self, schedule: str, before: float) -> float | None:
        return self._max(
            "SELECT MAX(tick) FROM periodic_ticks WHERE schedule = ? AND tick < ? "
            "AND published NOT IN (?, ?)",
            schedule, before, SKIPPED, MISSED,
        )  # fmt: skip

    def unpublished(self, marked_before: float) -> list[Mark]:
        with self._lock, translated(_LABEL):
            rows = self._conn.execute(
                "SELECT schedule, tick, marked_at FROM periodic_ticks "
                "WHERE published = ? AND marked_at < ?",
                (UNPUBLISHED, marked_before),
            ).fetchall()
        return [Mark(schedule, float(tick), float(at)) for schedule, tick, at in rows]

    def latest(self, schedule: str) -> tuple[float, int] | None:
        with self._lock, translated(_LABEL):
            row = self._conn.execute(
                "SELECT tick, published FROM periodic_ticks WHERE schedule = ? "
                "ORDER BY tick DESC LIMIT 1",
                (schedule,),
            ).fetchone()
        return None if row is None else (float(row[0]), int(row[1]))

    def pause(self, schedule: str, paused: bool, now: float) -> None:
        self._changed("INSERT OR REPLACE INTO periodic_paused VALUES (?, ?, ?)",
                      schedule, int(paused), now)  # fmt: skip

    def pauses(self) -> dict[str, Pause]:
        with self._lock, translated(_LABEL):
            rows = self._conn.execute("SELECT schedule, paused, since FROM periodic_paused")
            return {name: Pause(bool(paused), float(since)) for name, paused, since in rows}

    def _max(self, sql: str, *args: object) -> float | None:
        with self._lock, translated(_LABEL):
            (tick,) = self._conn.execute(sql, args).fetchone()
        return None if tick is None else float(tick)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
