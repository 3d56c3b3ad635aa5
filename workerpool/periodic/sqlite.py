"""The marks of the worker processes of one host: a table in the idempotency store's file,
beside the schedule of delayed jobs. Each compare-and-set is one statement, and so is the
marking of a burst of ticks (one row each, inserted unless present, the rows inserted
returned); a burst's "published" and the forgetting of old marks are one transaction."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from workerpool.periodic.marks import (
    MISSED,
    PUBLISHED,
    SKIPPED,
    UNPUBLISHED,
    Mark,
    Marks,
    Pause,
    Tick,
)  # fmt: skip
from workerpool.stores.sqlite import connect, immediate, translated

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


# Rows of a burst per statement: within SQLite's limit of variables (32,766) at 4 a row.
_ROWS = 500


def _rows(count: int, width: int) -> str:
    """``count`` rows of ``width`` placeholders each, for a VALUES list."""
    return ", ".join(["(" + ", ".join("?" * width) + ")"] * count)


class SqliteMarks(Marks):
    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0) -> None:
        self._lock = threading.Lock()  # one connection: one statement at a time
        self._conn = connect(path, busy_timeout, _LABEL, lambda conn: conn.executescript(_SCHEMA))

    def _changed(self, sql: str, *args: object) -> bool:
        with self._lock, translated(_LABEL):
            return self._conn.execute(sql, args).rowcount == 1

    def mark_many(self, ticks: Sequence[Tick], now: float) -> list[bool]:
        won: set[Tick] = set()
        for start in range(0, len(ticks), _ROWS):
            chunk = ticks[start : start + _ROWS]
            values = [v for schedule, tick in chunk for v in (schedule, tick, now, UNPUBLISHED)]
            with self._lock, translated(_LABEL):
                rows = self._conn.execute(
                    "INSERT INTO periodic_ticks VALUES " + _rows(len(chunk), 4)
                    + " ON CONFLICT DO NOTHING RETURNING schedule, tick",
                    values,
                ).fetchall()  # fmt: skip
            won.update((schedule, float(tick)) for schedule, tick in rows)
        return [tick in won for tick in ticks]

    def take_over(self, mark: Mark, now: float) -> bool:
        return self._changed(
            "UPDATE periodic_ticks SET marked_at = ? "
            "WHERE schedule = ? AND tick = ? AND marked_at = ? AND published = ?",
            now, mark.schedule, mark.tick, mark.marked_at, UNPUBLISHED,
        )  # fmt: skip

    def published_many(
        self, ticks: Sequence[Tick], forget_before: Mapping[str, float], state: int = PUBLISHED
    ) -> None:
        forget = list(forget_before.items())
        with self._lock, translated(_LABEL), immediate(self._conn):
            for start in range(0, len(ticks), _ROWS):
                chunk = ticks[start : start + _ROWS]
                self._conn.execute(
                    "UPDATE periodic_ticks SET published = ? WHERE (schedule, tick) IN "
                    "(VALUES " + _rows(len(chunk), 2) + ")",
                    [state, *(v for tick in chunk for v in tick)],
                )  # fmt: skip
            for start in range(0, len(forget), _ROWS):
                chunk = forget[start : start + _ROWS]
                # The primary key finds each schedule's old marks.
                self._conn.execute(
                    "WITH f(schedule, before) AS (VALUES " + _rows(len(chunk), 2) + ") "
                    "DELETE FROM periodic_ticks WHERE rowid IN (SELECT t.rowid FROM f "
                    "JOIN periodic_ticks t ON t.schedule = f.schedule AND t.tick < f.before "
                    "WHERE t.published != ?)",
                    [*(v for item in chunk for v in item), UNPUBLISHED],
                )  # fmt: skip

    def last_run(self, schedule: str, before: float) -> Mark | None:
        with self._lock, translated(_LABEL):
            row = self._conn.execute(
                "SELECT tick, marked_at FROM periodic_ticks WHERE schedule = ? AND tick < ? "
                "AND published NOT IN (?, ?) ORDER BY tick DESC LIMIT 1",
                (schedule, before, SKIPPED, MISSED),
            ).fetchone()
        return None if row is None else Mark(schedule, float(row[0]), float(row[1]))

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

    def close(self) -> None:
        with self._lock:
            self._conn.close()
