"""The leading autoscaler's last decisions, kept beside its lease so a dashboard can show them
after the autoscaler (or the dashboard) restarts.

Each name (a subscription) keeps one record holding its last ``KEEP`` decisions as a JSON
list, newest last: a decision is written only when it differs from the last one logged, so
the record is rewritten at most once a round, and it never grows past ``KEEP``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Decisions kept per subscription: hours of a fleet that scales every few minutes.
KEEP = 200


@dataclass(frozen=True)
class Noted:
    """One decision: at ``at`` (wall time) the fleet had ``before`` replicas and the policy
    asked for ``after``, seeing ``signals``, for ``reason``; the actuator did ``action``."""

    at: float
    before: int
    after: int
    signals: str
    reason: str
    action: str


def appended(text: str | None, noted: Noted, keep: int = KEEP) -> str:
    """The stored list ``text`` (None: none yet) with ``noted`` added, cut to its last
    ``keep``."""
    entries: list[dict[str, object]] = [] if text is None else json.loads(text)
    entries.append(asdict(noted))
    return json.dumps(entries[-keep:])


def read(text: str | None) -> list[Noted]:
    """The decisions in the stored list ``text``, newest first."""
    return [] if text is None else [Noted(**entry) for entry in reversed(json.loads(text))]
