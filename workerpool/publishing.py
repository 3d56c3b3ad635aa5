"""Publishing jobs by the message contract: JSON object data, ``job`` and ``job_id`` attributes.

Every message also carries the publisher's current trace context (``traceparent`` /
``tracestate``), so the job's span on the worker is a child of the span that published it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.schedule.when import not_before_text
from workerpool.telemetry.propagation import inject


@dataclass(frozen=True)
class JobMessage:
    job: str
    data: Mapping[str, Any]
    job_id: str = ""
    attributes: Mapping[str, str] | None = None
    # The not_before attribute (``schedule.not_before_text``): not to start before then.
    not_before: str = ""

    def encode(self) -> tuple[bytes, dict[str, str]]:
        attributes = dict(self.attributes or {})
        attributes[c.ATTR_JOB] = self.job
        if self.job_id:
            attributes[c.ATTR_JOB_ID] = self.job_id
        if self.not_before:
            attributes[c.ATTR_NOT_BEFORE] = self.not_before
        inject(attributes)
        return json.dumps(self.data, separators=(",", ":")).encode(), attributes


def publish(publisher: Any, topic: str, message: JobMessage, *, timeout: float = 60) -> str:
    """Publish one job and wait for its message id."""
    data, attributes = message.encode()
    message_id: str = publisher.publish(topic, data, **attributes).result(timeout=timeout)
    return message_id


_default_publisher: Any = None
_default_lock = threading.Lock()


def _publisher() -> Any:
    global _default_publisher
    with _default_lock:
        if _default_publisher is None:
            from workerpool.worker.clients import publisher_client

            _default_publisher = publisher_client()
        return _default_publisher


def publish_job(
    topic: str,
    job: str,
    data: Mapping[str, Any] | None = None,
    *,
    job_id: str = "",
    attributes: Mapping[str, str] | None = None,
    not_before: datetime | timedelta | None = None,
    project: str | None = None,
    publisher: Any = None,
    timeout: float = 60,
) -> str:
    """Publish one job and wait for its message id: ``workerpool.publish``.

    ``not_before`` (a timezone-aware time, or a delay from now, up to 365 days) delays the
    job: a worker keeps it in its store's schedule, not in a pool, until then.

    ``topic`` is a topic name in ``project`` (default: ``GOOGLE_CLOUD_PROJECT``) or a full
    ``projects/P/topics/T`` path. The current OpenTelemetry context is injected, so the job's
    span on the worker is a child of the caller's span. ``publisher`` defaults to one
    ``PublisherClient`` shared by the process (``PUBSUB_EMULATOR_HOST`` is honoured).
    """
    if not topic.startswith("projects/"):
        project = project or os.environ.get("GOOGLE_CLOUD_PROJECT", "")
        if not project:
            raise ConfigError(f"topic {topic!r}: give a project or a projects/P/topics/T path")
        topic = f"projects/{project}/topics/{topic}"
    try:
        when = "" if not_before is None else not_before_text(not_before)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    message = JobMessage(job, dict(data or {}), job_id, attributes, when)
    return publish(publisher or _publisher(), topic, message, timeout=timeout)


def publish_many(publisher: Any, topic: str, messages: Iterable[JobMessage]) -> Iterator[str]:
    """Publish in the client's batches; yield message ids in order as they are confirmed."""
    futures = []
    for message in messages:
        data, attributes = message.encode()
        futures.append(publisher.publish(topic, data, **attributes))
    for future in futures:
        yield future.result(timeout=60)


def read_jsonl(lines: Iterable[str], source: str) -> list[JobMessage]:
    """Parse ``{"job": ..., "job_id": ..., "data": {...}}`` lines; a bad line is a ConfigError."""
    messages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("data", {}), dict):
                raise ValueError("expected an object with an object 'data'")
            messages.append(
                JobMessage(str(entry["job"]), entry.get("data", {}), str(entry.get("job_id", "")))
            )
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{source}:{number}: {exc}") from exc
    return messages
