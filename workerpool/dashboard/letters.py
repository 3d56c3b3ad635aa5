"""The Dead letters page's side of failure records: which records a filter or a selection
takes, and replaying or deleting them (``workerpool.ops.dlq`` does the reading and the
republishing, as for ``workerpool dlq``)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workerpool.ops.dlq import FailureRecord, Replayer, peek

ACTIONS = ("replay", "delete")
# Records one page view reads at most. Pub/Sub pull cannot seek or sort, so each view pulls the
# subscription through (holding what it pulled, so nothing comes twice, then giving it all
# back), sorts what matches and shows the page after the cursor: with more records than this,
# the rest are not seen (the page says so).
SCAN = 10_000


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
    scanned_all: bool  # False: the subscription holds more than SCAN records matching


def letters(
    subscriber: Any, subscription: str, selection: Selection, limit: int, after: str = ""
) -> Page:
    """The ``limit`` records matching ``selection`` that failed after the cursor ``after``
    (the last one a page showed: its failure time and message id), oldest first: the order
    is the records' own, so paging shows each record once while new ones fail."""
    records = sorted(peek(subscriber, subscription, limit=SCAN, match=selection), key=_key)
    rest = [record for record in records if _key(record) > _cursor(after)] if after else records
    shown = rest[:limit]
    return Page(
        [Letter(record, _text(record.data)) for record in shown],
        len(records) - len(rest) + 1,
        len(records),
        "|".join(_key(shown[-1])) if len(rest) > limit else "",
        len(records) < SCAN,
    )


def _key(record: FailureRecord) -> tuple[str, str]:
    return record.failed_at, record.message_id


def _cursor(after: str) -> tuple[str, str]:
    failed_at, _, message_id = after.rpartition("|")
    return failed_at, message_id


def apply(
    subscriber: Any, publisher: Any, subscription: str, action: str, selection: Selection
) -> Counter[str]:
    """Replay or delete the selected records; how many of each outcome."""
    replayer = Replayer(subscriber, publisher, subscription)
    results = (
        replayer.replay(match=selection) if action == "replay" else replayer.delete(match=selection)
    )
    return Counter(result.status for result in results)


def _text(data: bytes) -> str:
    text = data.decode(errors="replace")
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text
