"""Publishing jobs by the message contract: JSON object data, ``job`` and ``job_id`` attributes.

A job with an ordering key is published in order with the key's others (the client has
message ordering on); a failed publish stops the client's key until it is resumed, which
``confirmed`` does before it raises, so the key's next publish can go out (and ``send`` does
for a publish the paused key refuses, where nobody waited for the failure).

Every message also carries the publisher's current trace context (``traceparent`` /
``tracestate``), so the job's span on the worker is a child of the span that published it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud.pubsub_v1.publisher.exceptions import PublishToPausedOrderingKeyException

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.schedule.when import not_before_text
from workerpool.telemetry.propagation import inject
from workerpool.worker.envelope import parse_json
from workerpool.worker.text import safe_text


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

    def __post_init__(self) -> None:
        # Checked here, before anything is published: a None would go out as the job (or
        # job id) "None", and a second such job would be acked as a duplicate of the first.
        _check_attribute("job", self.job, required=True)
        _check_attribute("job_id", self.job_id)
        if not isinstance(self.data, Mapping):
            raise TypeError(f"data must be a mapping, not {type(self.data).__name__}")

    def encode(self) -> tuple[bytes, dict[str, str]]:
        attributes = dict(self.attributes or {})
        attributes[c.ATTR_JOB] = self.job
        if self.job_id:
            attributes[c.ATTR_JOB_ID] = self.job_id
        if self.not_before:
            attributes[c.ATTR_NOT_BEFORE] = self.not_before
        inject(attributes)
        return json.dumps(self.data, separators=(",", ":")).encode(), attributes


def _check_attribute(name: str, value: object, *, required: bool = False) -> None:
    """TypeError or ValueError unless ``value`` can be the attribute ``name``: a string that
    Pub/Sub takes (UTF-8, at most 1024 bytes), not empty if ``required``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if required and not value:
        raise ValueError(f"{name} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{name} {safe_text(value)!r} is not valid UTF-8 text") from None
    if size > c.MAX_ATTRIBUTE_VALUE_BYTES:
        raise ValueError(f"{name} is {size} bytes; Pub/Sub takes {c.MAX_ATTRIBUTE_VALUE_BYTES}")


def publish(publisher: Any, topic: str, message: JobMessage, *, timeout: float = 60) -> str:
    """Publish one job and wait for its message id."""
    data, attributes = message.encode()
    future = send(publisher, topic, data, attributes, message.ordering_key)
    return confirmed(publisher, topic, message.ordering_key, future, timeout)


def send(
    publisher: Any, topic: str, data: bytes, attributes: Mapping[str, str], ordering_key: str
) -> Any:
    """Start publishing one message; its future (see ``confirmed``). One the client refuses
    at once because its ordering key is paused resumes the key and goes again: a publish of
    the key failed after its caller had stopped waiting for it (a timeout), so nobody had."""
    future = publisher.publish(topic, data, ordering_key=ordering_key, **attributes)
    if ordering_key and _refused_as_paused(future):
        with contextlib.suppress(RuntimeError):  # (resumed meanwhile by another caller)
            publisher.resume_publish(topic, ordering_key)
        future = publisher.publish(topic, data, ordering_key=ordering_key, **attributes)
    return future


def _refused_as_paused(future: Any) -> bool:
    return (
        future.done()
        and not future.cancelled()
        and isinstance(future.exception(), PublishToPausedOrderingKeyException)
    )


def confirmed(
    publisher: Any, topic: str, ordering_key: str, future: Any, timeout: float = 60
) -> str:
    """The message id ``future`` brings. If it failed, its ordering key is resumed first (the
    client pauses a key after a failed publish); a missing topic, or a message Pub/Sub
    refuses, is a ConfigError (the CLI's one line) rather than a gRPC traceback."""
    try:
        message_id: str = future.result(timeout=timeout)
    except Exception as exc:
        # (Not on a wait that timed out: the publish is still under way, and its key is not
        # paused; resuming it would raise and hide the timeout.)
        if ordering_key and not isinstance(exc, TimeoutError):
            # (Raises if the key is not paused: resumed already, by an earlier failure of
            # the messages sent with this one. The failure to report is this one's.)
            with contextlib.suppress(RuntimeError):
                publisher.resume_publish(topic, ordering_key)
        if isinstance(exc, gexc.NotFound):
            raise ConfigError(f"topic {topic} does not exist") from None
        if isinstance(exc, gexc.InvalidArgument):
            raise ConfigError(
                f"topic {topic}: Pub/Sub refused the message: {exc.message}"
            ) from None
        raise
    return message_id


def confirm_all(
    publisher: Any,
    sent: Sequence[tuple[str, str, Any]],
    timeout: float,
    *,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[str | Exception]:
    """What each of the publishes ``sent`` brought, its message id or its error; each is
    ``(topic, ordering key, future)``, or the exception ``send`` raised in the future's place.
    Each wait lasts until ``timeout`` after the last answer (a refusal too): a Pub/Sub that
    answers no more holds the caller ``timeout`` in all, not ``timeout`` for each message,
    and one that answers slowly is waited for."""
    until = monotonic() + timeout
    results: list[str | Exception] = []
    for topic, ordering_key, future in sent:
        if isinstance(future, Exception):
            results.append(future)
            continue
        try:
            wait = max(0.0, until - monotonic())
            results.append(confirmed(publisher, topic, ordering_key, future, wait))
        except TimeoutError as exc:
            results.append(exc)
            continue
        except Exception as exc:  # an answer all the same: Pub/Sub refused it
            results.append(exc)
        until = monotonic() + timeout
    return results


_default_publisher: Any = None
_default_lock = threading.Lock()


def _publisher() -> Any:
    global _default_publisher
    with _default_lock:
        if _default_publisher is None:
            from workerpool.pubsub import publisher_client

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
    message = JobMessage(job, {} if data is None else data, job_id, attributes, when, ordering_key)
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
    mid-way leaves it to its deadline. Raises ``ConfigError``, having published and recorded
    nothing, for a missing topic (``publisher`` answers ``get_topic`` as well as ``publish``),
    a store no worker sees (``memory://``), a ``batch_id`` too long for Pub/Sub, and one that
    names another batch (other children, topic or ``on_complete``); the same batch again is
    accepted and changes nothing, and hands over its completion if it is final and that was
    never done."""
    from workerpool.batches import batch_opener
    from workerpool.batches.store import DEADLINE_JOB, deadline_job_id, deliver
    from workerpool.config import load_settings
    from workerpool.pubsub import require_topic
    from workerpool.schedule import schedule_opener
    from workerpool.stores import require_shared

    topic = topic_of(topic, project)
    children = list(jobs)
    missing = [m.job for m in children if not m.job_id]
    if missing:
        raise ConfigError(f"every child of a batch needs a job id ({missing[0]} has none)")
    _check_attribute("on_complete", on_complete, required=True)
    now = datetime.now(UTC)
    try:
        net_due = not_before_text(deadline, now)  # (refuses one it cannot honour)
    except ValueError as exc:
        raise ConfigError(f"batch deadline: {exc}") from None
    url = load_settings(None, {"idempotency_store": store}).idempotency_store
    open_batches, open_schedule = batch_opener(url), schedule_opener(url)
    if open_batches is None or open_schedule is None:
        raise ConfigError(f"idempotency_store {url}: keeps no batches (use SQLite or Firestore)")
    require_shared(url, "batches")
    batch_id = batch_id or uuid.uuid4().hex
    due = now + deadline
    publisher = publisher or _publisher()
    require_topic(publisher, topic)  # before the batch is recorded: none is left half-made
    try:  # made before the batch is recorded: a batch id too long for them records nothing
        net = JobMessage(
            DEADLINE_JOB, {"batch_id": batch_id}, deadline_job_id(batch_id),
            not_before=net_due,
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(f"batch_id: {exc}") from None
    stamped = [
        dataclasses.replace(m, attributes={**(m.attributes or {}), c.ATTR_BATCH_ID: batch_id})
        for m in children
    ]
    batches, schedule = open_batches(), open_schedule()
    try:
        trace: dict[str, str] = {}
        inject(trace)  # the completion's span links to the span this batch is published in
        batches.create(
            batch_id, topic, on_complete, [m.job_id for m in children], due.timestamp(),
            trace=trace.get(c.ATTR_TRACEPARENT, ""),
        )  # fmt: skip
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
        yield confirmed(publisher, topic, message.ordering_key, future)


# What a line of ``publish --file`` may hold, with the JSON type each field must have.
_LINE_FIELDS = {
    "job": (str, "a string"),
    "job_id": (str, "a string"),
    "data": (dict, "an object"),
    "ordering_key": (str, "a string"),
}


def read_jsonl(lines: Iterable[bytes], source: str) -> list[JobMessage]:
    """Parse ``{"job": ..., "job_id": ..., "data": {...}, "ordering_key": ...}`` lines of UTF-8
    JSON (only ``job`` is required); a bad line is a ConfigError naming the line and what is
    wrong with it."""
    messages = []
    for number, line in enumerate(lines, 1):
        try:
            if line.strip():
                messages.append(_job_line(parse_json(line)))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}:{number}: not UTF-8: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}:{number}: {exc}") from None
        except RecursionError:
            raise ConfigError(f"{source}:{number}: JSON nested too deeply to parse") from None
    return messages


def _job_line(entry: Any) -> JobMessage:
    if not isinstance(entry, dict):
        raise ValueError(
            f'expected an object {{"job", "job_id", "data", "ordering_key"}}, not '
            f"{_json_type(entry)}"
        )
    for name in entry:
        if name not in _LINE_FIELDS:
            raise ValueError(
                f"unknown field {safe_text(name)!r} (a line has job, job_id, data, ordering_key)"
            )
    for name, (kind, described) in _LINE_FIELDS.items():
        if name in entry and not isinstance(entry[name], kind):
            raise ValueError(f"field {name!r} is {_json_type(entry[name])}, not {described}")
    if "job" not in entry:
        raise ValueError("field 'job' is missing")
    return JobMessage(
        entry["job"], entry.get("data", {}), entry.get("job_id", ""),
        ordering_key=entry.get("ordering_key", ""),
    )  # fmt: skip


# JSON's name for what json.loads made (bool before int: a bool is an int in Python).
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (type(None), "null"), (bool, "a boolean"), (int, "a number"), (float, "a number"),
    (str, "a string"), (list, "an array"), (dict, "an object"),
)  # fmt: skip


def _json_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))
