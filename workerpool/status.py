"""``workerpool status``: a subscription's settings, and its backlog where that can be known.

The settings come from the Pub/Sub admin API. The backlog (undelivered messages) and the age of
the oldest unacked message are Cloud Monitoring metrics
(``pubsub.googleapis.com/subscription/num_undelivered_messages`` and
``.../oldest_unacked_message_age``); the emulator has no Cloud Monitoring, and reading it
elsewhere is not implemented yet, so ``status`` says which of the two applies.
"""

from __future__ import annotations

import os
from typing import Any

from workerpool.admin import SubscriptionInfo, describe_subscription

EMULATOR_VARIABLE = "PUBSUB_EMULATOR_HOST"


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


def backlog_lines(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    environ = os.environ if env is None else env
    if environ.get(EMULATOR_VARIABLE):
        why = (
            f"unavailable on the emulator ({EMULATOR_VARIABLE} is set): it has no Cloud Monitoring"
        )
    else:
        why = (
            "not implemented yet (needs Cloud Monitoring: "
            "subscription/num_undelivered_messages, oldest_unacked_message_age)"
        )
    return [("backlog, oldest unacked age", why)]


def status_lines(subscriber: Any, subscription: str) -> list[str]:
    """``name: value`` lines; a missing subscription is a ConfigError."""
    pairs = settings_lines(describe_subscription(subscriber, subscription)) + backlog_lines()
    width = max(len(name) for name, _ in pairs)
    return [f"{name + ':':<{width + 1}} {value}" for name, value in pairs]
