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


def letters(subscriber: Any, subscription: str, selection: Selection, limit: int) -> list[Letter]:
    return [
        Letter(record, _text(record.data))
        for record in peek(subscriber, subscription, limit=limit, match=selection)
    ]


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
