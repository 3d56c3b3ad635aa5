"""Publishing jobs by the message contract: JSON object data, ``job`` and ``job_id`` attributes.

A job with an ordering key is published in order with the key's others (the client has
message ordering on); a failed publish stops the client's key until it is resumed, which
``confirmed`` does before it raises, so the key's next publish can go out.

Every message also carries the publisher's current trace context (``traceparent`` /
``tracestate``), so the job's span on the worker is a child of the span that published it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
    # On an ordered subscription, jobs with the same key run one at a time, in publish order.
    ordering_key: str = ""

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
    future = send(publisher, topic, data, attributes, message.ordering_key)
    return confirmed(publisher, topic, message.ordering_key, future, timeout)


def send(
    publisher: Any, topic: str, data: bytes, attributes: Mapping[str, str], ordering_key: str
) -> Any:
    """Start publishing one message; its future (see ``confirmed``)."""
    return publisher.publish(topic, data, ordering_key=ordering_key, **attributes)


def confirmed(publisher: Any, topic: str, ordering_key: str, future: Any, timeout: float) -> str:
    """The message id ``future`` brings; if it failed, its ordering key is resumed first."""
    try:
        message_id: str = future.result(timeout=timeout)
    except Exception:
        if ordering_key:
            publisher.resume_publish(topic, ordering_key)
        raise
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
    ordering_key: str = "",
    project: str | None = None,
    publisher: Any = None,
    timeout: float = 60,
) -> str:
    """Publish one job and wait for its message id: ``workerpool.publish``.

    ``not_before`` (a timezone-aware time, or a delay from now, up to 365 days) delays the
    job: a worker keeps it in its store's schedule, not in a pool, until then.

    ``ordering_key``: on an ordered subscription, the jobs of one key run one at a time, in
    the order they were published (the README's "Ordered subscriptions").

    ``topic`` is a topic name in ``project`` (default: ``GOOGLE_CLOUD_PROJECT``) or a full
    ``projects/P/topics/T`` path. The current OpenTelemetry context is injected, so the job's
    span on the worker is a child of the caller's span. ``publisher`` defaults to one
    ``PublisherClient`` shared by the process (``PUBSUB_EMULATOR_HOST`` is honoured).
    """
    topic = topic_of(topic, project)
    try:
        when = "" if not_before is None else not_before_text(not_before)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    message = JobMessage(job, dict(data or {}), job_id, attributes, when, ordering_key)
    return publish(publisher or _publisher(), topic, message, timeout=timeout)


def topic_of(topic: str, project: str | None) -> str:
    """``topic``'s full path: a name in ``project`` (default ``GOOGLE_CLOUD_PROJECT``), or
    a ``projects/P/topics/T`` path as it is."""
    if topic.startswith("projects/"):
        return topic
    project = project or os.environ.get("GOOGLE_CLOUD_PROJECT", "")
    if not project:
        raise ConfigError(f"topic {topic!r}: give a project or a projects/P/topics/T path")
    return f"projects/{project}/topics/{topic}"


def publish_batch(
    topic: str,
    jobs: Iterable[JobMessage],
    *,
    on_complete: str,
    deadline: timedelta = timedelta(hours=1),
    batch_id: str | None = None,
    project: str | None = None,
    store: str | None = None,
    publisher: Any = None,
) -> str:
    """Publish ``jobs`` as one batch and return its id: ``workerpool.publish_batch``.

    Every child needs a job id (its batch counts it by that id, once). When each child has a
    final outcome (done, or dead-lettered), one job ``on_complete`` runs, job id
    ``batch:<id>:complete``, with the batch's totals; at ``deadline`` whatever is still open
    is finalized the same way (``finalized_by = "deadline"``). The batch record lives in the
    workers' store: ``store`` (a URL), else the one ``workerpool run`` would use (the config
    file, ``WORKERPOOL_IDEMPOTENCY_STORE``). The batch opens only once every child is
    published, so children that finish fast cannot complete it early; a publisher that dies
    mid-way leaves it to its deadline."""
    from workerpool.batches import batch_opener
    from workerpool.batches.store import DEADLINE_JOB, deadline_job_id, deliver
    from workerpool.config import load_settings
    from workerpool.schedule import schedule_opener

    topic = topic_of(topic, project)
    children = list(jobs)
    missing = [m.job for m in children if not m.job_id]
    if missing:
        raise ConfigError(f"every child of a batch needs a job id ({missing[0]} has none)")
    url = load_settings(None, {"idempotency_store": store}).idempotency_store
    open_batches, open_schedule = batch_opener(url), schedule_opener(url)
    if open_batches is None or open_schedule is None:
        raise ConfigError(f"idempotency_store {url}: keeps no batches (use SQLite or Firestore)")
    batch_id = batch_id or uuid.uuid4().hex
    due = datetime.now(UTC) + deadline
    batches, schedule = open_batches(), open_schedule()
    publisher = publisher or _publisher()
    try:
        trace: dict[str, str] = {}
        inject(trace)  # the completion's span links to the span this batch is published in
        batches.create(
            batch_id, topic, on_complete, [m.job_id for m in children], due.timestamp(),
            trace=trace.get(c.ATTR_TRACEPARENT, ""),
        )  # fmt: skip
        net = JobMessage(
            DEADLINE_JOB, {"batch_id": batch_id}, deadline_job_id(batch_id),
            not_before=not_before_text(due),
        )  # fmt: skip
        stamped = [
            dataclasses.replace(m, attributes={**(m.attributes or {}), c.ATTR_BATCH_ID: batch_id})
            for m in children
        ]
        for _ in publish_many(publisher, topic, [net, *stamped]):
            pass
        deliver(batches.commit(batch_id), batches, schedule)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        batches.close()
        schedule.close()
    return batch_id


def publish_many(publisher: Any, topic: str, messages: Iterable[JobMessage]) -> Iterator[str]:
    """Publish in the client's batches; yield message ids in order as they are confirmed."""
    futures = []
    for message in messages:
        data, attributes = message.encode()
        futures.append((message, send(publisher, topic, data, attributes, message.ordering_key)))
    for message, future in futures:
        yield confirmed(publisher, topic, message.ordering_key, future, 60)


def read_jsonl(lines: Iterable[str], source: str) -> list[JobMessage]:
    """Parse ``{"job": ..., "job_id": ..., "data": {...}, "ordering_key": ...}`` lines (only
    ``job`` is required); a bad line is a ConfigError."""
    messages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("data", {}), dict):
                raise ValueError("expected an object with an object 'data'")
            key = str(entry.get("ordering_key", ""))
            job_id = str(entry.get("job_id", ""))
            messages.append(
                JobMessage(str(entry["job"]), entry.get("data", {}), job_id, ordering_key=key)
            )
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{source}:{number}: {exc}") from exc
    return messages
