"""The Dead letters page's side of failure records: which records a filter or a selection
takes, a page of them cut from the index (``letter_index``), and replaying or deleting them
(``workerpool.ops.dlq`` does the reading and the republishing, as for ``workerpool dlq``)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from workerpool.dashboard.letter_index import LetterIndex, Snapshot, key
from workerpool.ops.dlq import FailureRecord, Replayer, peek
from workerpool.pubsub import Clients

ACTIONS = ("replay", "delete")
# Records one read of the subscription for the index takes at most: with more than this, the
# rest are not seen (the page says so). The index keeps each in the dashboard's memory, its
# payload cut to PREVIEW bytes (a payload may be up to 10 MB): 20,000 records of large payloads
# take some 60 MB.
SCAN = 20_000
PREVIEW = 2048


@dataclass(frozen=True)
class Selection:
    """Records of ``job`` and ``error_type`` (either empty: any), and, when ``ids`` is given,
    only those (by message id)."""

    job: str = ""
    error_type: str = ""
    ids: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, values: Mapping[str, Any], ids: list[str]) -> Selection:
        return cls(str(values.get("job", "")), str(values.get("error_type", "")), frozenset(ids))

    def __call__(self, record: FailureRecord) -> bool:
        return (
            (not self.job or record.job == self.job)
            and (not self.error_type or record.error_type == self.error_type)
            and (not self.ids or record.message_id in self.ids)
        )

    def describe(self) -> str:
        if self.ids:
            return f"the {len(self.ids)} selected record(s)"
        parts = [f"job {self.job}" if self.job else "", f"error type {self.error_type}"
                 if self.error_type else ""]  # fmt: skip
        wanted = " and ".join(p for p in parts if p)
        return f"every record of {wanted}" if wanted else "every record"


@dataclass(frozen=True)
class Letter:
    """A record as the page shows it: the payload as text (pretty JSON where it is JSON)."""

    record: FailureRecord
    payload: str


@dataclass(frozen=True)
class Page:
    """Records ``first`` to ``first + len(letters) - 1`` (from 1) of the ``matching`` ones, in
    the order they failed; ``after``: the cursor of the next page ("" on the last)."""

    letters: list[Letter]
    first: int
    matching: int
    after: str
    scanned_all: bool  # False: the subscription held more than SCAN records when read
    read_at: float  # when the records shown were read from the subscription (time.time)

    @property
    def read_ago(self) -> float:
        return max(0.0, time.time() - self.read_at)


class DeadLetters:
    """The dead letters of ``subscription``: pages of them from an index read now and then,
    and actions on the subscription itself. ``clients`` gives the Pub/Sub clients."""

    def __init__(self, subscription: str, clients: Callable[[], Clients]) -> None:
        self.subscription = subscription
        self._clients = clients
        self.index = LetterIndex(self._read, SCAN)
        self.read_so_far = 0  # records the read under way (or the last one) has pulled

    def _read(self) -> list[FailureRecord]:
        self.read_so_far = 0
        return peek(
            self._clients().subscriber, self.subscription, limit=SCAN, progress=self._progress,
            keep=preview,
        )  # fmt: skip

    def _progress(self, count: int) -> None:
        self.read_so_far = count

    def page(self, selection: Selection, limit: int, after: str = "") -> Page | int:
        """A page of the index; while its first read is under way, how many records that
        read has pulled so far."""
        snapshot = self.index.snapshot()
        if snapshot is None:
            return self.read_so_far
        return letters(snapshot, selection, limit, after)

    def apply(self, action: str, selection: Selection) -> Counter[str]:
        """Replay or delete the selected records, as the subscription holds them now; how
        many of each outcome. The index forgets those taken off the subscription."""
        clients = self._clients()
        replayer = Replayer(clients.subscriber, clients.publisher, self.subscription)
        with self.index.acting() as forget:
            results = list(
                replayer.replay(match=selection)
                if action == "replay"
                else replayer.delete(match=selection)
            )
            forget({r.record.message_id for r in results if r.status in ("replayed", "deleted")})
        return Counter(result.status for result in results)


def letters(snapshot: Snapshot, selection: Selection, limit: int, after: str = "") -> Page:
    """The ``limit`` records of ``snapshot`` matching ``selection`` that failed after the
    cursor ``after`` (the last one a page showed: its failure time and message id), oldest
    first: the order is the records' own, so paging shows each record once while new ones
    fail."""
    records = [record for record in snapshot.records if selection(record)]
    cursor = _cursor(after) if after else None
    rest = [record for record in records if key(record) > cursor] if cursor else records
    shown = rest[:limit]
    return Page(
        [Letter(record, _text(record.data)) for record in shown],
        len(records) - len(rest) + 1,
        len(records),
        "|".join(key(shown[-1])) if len(rest) > limit else "",
        snapshot.complete,
        snapshot.at,
    )


def _cursor(after: str) -> tuple[str, str]:
    failed_at, _, message_id = after.rpartition("|")
    return failed_at, message_id


def preview(record: FailureRecord) -> FailureRecord:
    """The record as the index keeps it: its payload's first PREVIEW bytes, and one more when
    there were more (the page says it is cut)."""
    return (
        replace(record, data=record.data[: PREVIEW + 1]) if len(record.data) > PREVIEW else record
    )


def _text(data: bytes) -> str:
    if len(data) > PREVIEW:
        return data[:PREVIEW].decode(errors="replace") + "... (cut: the payload is longer)"
    text = data.decode(errors="replace")
    try:
        shown = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):  # any publisher's bytes: nested past the limit too
        return text
    # A lone surrogate escaped in valid JSON ("\ud800") decodes to text no page can encode.
    return shown.encode(errors="replace").decode()
