"""``workerpool status``: a subscription's settings, its backlog where that can be known, and
the fleet's concurrency keys (limit, holders, waiters) where limits are declared.

The settings come from the Pub/Sub admin API. The backlog (undelivered messages) and the age of
the oldest unacked message are Cloud Monitoring metrics
(``pubsub.googleapis.com/subscription/num_undelivered_messages`` and
``.../oldest_unacked_message_age``), read over Monitoring's REST API with the ambient
credentials (google-auth, already a dependency of the Pub/Sub client). The emulator has no Cloud
Monitoring, and any failure to read it (no credentials, no permission, no network) is reported
as a line saying why, never as a traceback: the settings are still worth showing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from workerpool.ops.keys import ShardState, Shares, key_states
from workerpool.ops.monitoring import (
    EMULATOR_VARIABLE,
    OLDEST_UNACKED_AGE,
    UNDELIVERED,
    latest,
    monitoring_session,
)
from workerpool.pubsub import SubscriptionInfo, describe_subscription
from workerpool.slots.store import SlotStore


def _seconds(value: float) -> str:
    if value and value % 86400 == 0:
        return f"{value / 86400:g}d"
    return f"{value:g}s"


def settings_lines(info: SubscriptionInfo) -> list[tuple[str, str]]:
    retry = (
        f"backoff {_seconds(info.min_backoff)} .. {_seconds(info.max_backoff)}"
        if info.has_retry_policy
        else "none (immediate redelivery; workerpool delays with modify_ack_deadline)"
    )
    dead_letter = (
        f"{info.dead_letter_topic} after {info.max_delivery_attempts} delivery attempts"
        if info.dead_letter_topic
        else "none"
    )
    return [
        ("subscription", info.name),
        ("topic", info.topic),
        ("ack deadline", _seconds(info.ack_deadline_seconds)),
        ("retry policy", retry),
        ("dead-letter policy", dead_letter),
        ("filter", info.filter or "none"),
        ("exactly-once delivery", "enabled" if info.exactly_once else "disabled"),
        ("message retention", _seconds(info.retention_seconds) if info.retention_seconds else "-"),
    ]


_BACKLOG_LINES = (
    ("backlog", UNDELIVERED, "{:.0f} messages"),
    ("oldest unacked age", OLDEST_UNACKED_AGE, "{:.0f}s"),
)


def backlog_lines(
    subscription: str, env: dict[str, str] | None = None, session: Any = None
) -> list[tuple[str, str]]:
    environ = os.environ if env is None else env
    if environ.get(EMULATOR_VARIABLE):
        why = (
            f"unavailable on the emulator ({EMULATOR_VARIABLE} is set): it has no Cloud Monitoring"
        )
        return [("backlog, oldest unacked age", why)]
    _, project, _, subscription_id = subscription.split("/")
    lines = []
    try:
        session = session or monitoring_session()
        for label, metric, shape in _BACKLOG_LINES:
            value = latest(session, project, subscription_id, metric)
            lines.append(
                (label, "no data in the last 10 minutes" if value is None else shape.format(value))
            )
    except Exception as exc:  # credentials, permission, network: say why, keep the settings
        return [("backlog, oldest unacked age", f"Cloud Monitoring unavailable: {exc}")]
    return lines


def slot_lines(
    store: SlotStore, limits: Mapping[str, int], shards: Mapping[str, int] | None = None
) -> list[tuple[str, str]]:
    """Each declared key's limit, holders, waiters and deferred jobs; a pattern ("partner:*")
    shows every key of it that has a record; a split key (``shards``: by entry), a line for
    each shard under its own."""
    lines = []
    for state in key_states(store, limits, time.time(), shards):
        if not state.in_use:
            lines.append((f"concurrency {state.key}", f"limit {state.limit} each, no key in use"))
            continue
        holders = ", ".join(f"{h.name} (token {h.token}, {h.held_for:.0f}s)" for h in state.holders)
        hold = f", mean hold {state.hold:.1f}s" if state.hold else ""
        split = f"; in {len(state.shards)} shards" if state.shards else ""
        lines.append((
            f"concurrency {state.key}",
            f"limit {state.limit}, {len(state.holders)} held{': ' + holders if holders else ''}; "
            f"{state.waiters} replicas waiting, {state.deferred} jobs deferred{hold}"
            f"{_shares(state.shares)}{split}",
        ))  # fmt: skip
        lines.extend((f"  shard #{shard.index}", _shard(shard)) for shard in state.shards)
    return lines


def _shard(shard: ShardState) -> str:
    """A shard's part of its key's limit (and what the key's record counts it for, while its
    shares shrink to a lowered part) and its replicas' shares."""
    counted = f" (counts for {shard.counted})" if shard.counted != shard.part else ""
    return f"part {shard.part}{counted}{_shares(shard.shares) or '; no shares'}"


def _shares(shares: Shares) -> str:
    """Shares of a key leased in bulk: each replica's (slots held, slots its runs want)."""
    if not shares:
        return ""
    listed = ", ".join(
        f"{replica} {share.granted} (wants {share.want}, token {share.token})"
        for replica, share in shares
    )
    return f"; {sum(share.granted for _, share in shares)} in shares: {listed}"


def status_lines(
    subscriber: Any, subscription: str, slots: list[tuple[str, str]] | None = None
) -> list[str]:
    """``name: value`` lines (``slots``: from ``slot_lines``); a missing subscription is a
    ConfigError."""
    info = describe_subscription(subscriber, subscription)
    pairs = settings_lines(info) + backlog_lines(info.name) + (slots or [])
    width = max(len(name) for name, _ in pairs)
    return [f"{name + ':':<{width + 1}} {value}" for name, value in pairs]
