"""Reading failure records (``workerpool.worker.failures`` writes them): look at them, and
replay them where they came from.

``peek`` pulls records and gives them back (``modify_ack_deadline(0)``) without consuming them;
they are held until the listing ends, so each is seen once. Each call is one pass over the
records published before it began (see ``_Puller.pull``). ``replay`` republishes each record
to its ``source_topic`` with the failure attributes stripped (``job``, ``job_id``, the trace
context and any other original attribute kept) and acks it only once Pub/Sub has confirmed the
republish; records it skips (``--job``, ``--dry-run``) are given back at the end. ``delete``
acks the records it matches without republishing them (the dashboard's delete).

Records forwarded by the subscription's own dead-letter policy (a worker crashed before it
could write one) carry Pub/Sub's ``CloudPubSubDeadLetter*`` attributes instead: they are listed
with error type ``max_delivery_attempts`` and replayed to the topic of their source subscription.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.api_core import exceptions as gexc

from workerpool import constants as c
from workerpool.publishing import confirm_all
from workerpool.pubsub import subscription_path

log = logging.getLogger(__name__)

# An idle pull ends at its deadline (the emulator answers just before it): keep it short.
_PULL_TIMEOUT = 2.0
_PUBLISH_TIMEOUT = 60.0
_BATCH = 100
# How long a pulled record is kept from other readers while a pass holds it (renewed).
_LEASE = 60.0

# Which records a call takes, beyond ``job``: the dashboard's filters and selections.
Match = Callable[["FailureRecord"], bool]


@dataclass(frozen=True)
class FailureRecord:
    ack_id: str
    message_id: str
    data: bytes
    attributes: dict[str, str]
    publish_time: datetime | None = None

    @property
    def job(self) -> str:
        return self.attributes.get(c.ATTR_JOB, "")

    @property
    def job_id(self) -> str:
        return self.attributes.get(c.ATTR_JOB_ID, "")

    @property
    def forwarded_by_policy(self) -> bool:
        """Forwarded by Pub/Sub's dead-letter policy, not written by a worker: the attributes
        Pub/Sub sets as it forwards (a worker's record never carries them). Its other
        attributes are its publisher's, any of ours among them included."""
        return c.ATTR_PUBSUB_DELIVERY_COUNT in self.attributes

    def _written(self, key: str) -> str:
        """A failure attribute a worker wrote (one forwarded by Pub/Sub has none: those it
        carries are its publisher's)."""
        return "" if self.forwarded_by_policy else self.attributes.get(key, "")

    @property
    def error_type(self) -> str:
        if self.forwarded_by_policy:
            return c.ERR_DELIVERY_LIMIT
        return self.attributes.get(c.ATTR_ERROR_TYPE, "")

    @property
    def error_message(self) -> str:
        return self._written(c.ATTR_ERROR_MESSAGE)

    @property
    def attempts(self) -> str:
        return self._written(c.ATTR_DELIVERY_ATTEMPT) or self.attributes.get(
            c.ATTR_PUBSUB_DELIVERY_COUNT, ""
        )

    @property
    def failed_at(self) -> str:
        failed = self._written(c.ATTR_FAILED_AT)
        if not failed and self.publish_time is not None:
            failed = self.publish_time.isoformat(timespec="milliseconds")
        return failed

    def replay_attributes(self) -> dict[str, str]:
        """The original attributes: failure attributes (ours and Pub/Sub's) stripped, and a
        copy's marks (the replay is a message of its own, for whichever subscription now, and
        may be scheduled again)."""
        return {
            key: value
            for key, value in self.attributes.items()
            if key not in c.FAILURE_ATTRIBUTES
            and key not in (c.ATTR_COPY_OF, c.ATTR_COPY_FOR, c.ATTR_FIRED_AT)
            and not key.startswith(c.ATTR_PUBSUB_DEAD_LETTER_PREFIX)
        }


def _record(received: Any) -> FailureRecord:
    message = received.message
    return FailureRecord(
        ack_id=received.ack_id,
        message_id=message.message_id,
        data=bytes(message.data),
        attributes=dict(message.attributes),
        publish_time=message.publish_time,
    )


@dataclass
class _Puller:
    """Pulls, once each, the records published before it was made (one pass over the
    subscription), holding what is not consumed until ``release``. What it pulls is kept
    from other readers for ``_LEASE`` seconds, and what it holds for as long as the pass
    goes on: a subscription's own ack deadline (10 s at least) is shorter than a pass over a
    large one, and a record coming back would be pulled again."""

    subscriber: Any
    subscription: str
    held: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    began: datetime = field(default_factory=lambda: datetime.now(UTC))
    renew_at: float = field(default_factory=lambda: time.monotonic() + _LEASE / 2)

    def pull(self, count: int) -> list[FailureRecord] | None:
        """Records not seen before; None once a pull brings none. A pull that brings only
        records published since the pass began (a replayed job failing again), or seen
        already (one whose lease could not be renewed in time), ends the pass: otherwise a
        replay would replay its own jobs' new failures, and a stream of new failures would
        keep it going. Such a record is held, and left for the next pass."""
        self._renew()
        try:
            response = self.subscriber.pull(
                request={"subscription": self.subscription, "max_messages": count},
                timeout=_PULL_TIMEOUT,
            )
        except gexc.DeadlineExceeded:
            return None
        received = [_record(message) for message in response.received_messages]
        self._lease([record.ack_id for record in received], _LEASE)
        fresh = []
        for record in received:
            if record.message_id in self.seen or self._since_began(record):
                self.hold(record)
            else:
                self.seen.add(record.message_id)
                fresh.append(record)
        return fresh or None

    def _since_began(self, record: FailureRecord) -> bool:
        return record.publish_time is not None and record.publish_time >= self.began

    def hold(self, record: FailureRecord) -> None:
        self.held.append(record.ack_id)
        self._renew()

    def _renew(self) -> None:
        """Renew the held records' lease once half of it has passed."""
        if time.monotonic() >= self.renew_at:
            self._lease(self.held, _LEASE)
            self.renew_at = time.monotonic() + _LEASE / 2

    def release(self) -> None:
        """Give back every held record at once (ack deadline 0)."""
        self._lease(self.held, 0)
        self.held.clear()

    def _lease(self, ack_ids: list[str], seconds: float) -> None:
        for start in range(0, len(ack_ids), 1000):
            self.subscriber.modify_ack_deadline(
                request={
                    "subscription": self.subscription,
                    "ack_ids": ack_ids[start : start + 1000],
                    "ack_deadline_seconds": int(seconds),
                }
            )


def _wanted(record: FailureRecord, job: str | None, match: Match | None) -> bool:
    return (job is None or record.job == job) and (match is None or match(record))


def peek(
    subscriber: Any,
    subscription: str,
    *,
    limit: int = 100,
    job: str | None = None,
    match: Match | None = None,
    progress: Callable[[int], None] | None = None,
    keep: Callable[[FailureRecord], FailureRecord] = lambda record: record,
) -> list[FailureRecord]:
    """Up to ``limit`` records (of ``job`` only, and that ``match``, if given), left on the
    subscription; ``progress`` is told how many it has after each pull. Each is kept as
    ``keep`` makes it, as it is pulled (a reader that keeps a part of each never holds the
    whole of them all)."""
    puller = _Puller(subscriber, subscription)
    records: list[FailureRecord] = []
    try:
        while len(records) < limit:
            batch = puller.pull(_BATCH)
            if batch is None:
                break
            for record in batch:
                puller.hold(record)
                if _wanted(record, job, match) and len(records) < limit:
                    records.append(keep(record))
            if progress is not None:
                progress(len(records))
    finally:
        puller.release()
    return records


@dataclass(frozen=True)
class Replayed:
    """What ``replay`` did with one record: ``replayed``, ``would_replay`` or ``failed``
    (``delete``: ``deleted``)."""

    record: FailureRecord
    status: str
    topic: str = ""
    detail: str = ""


class Replayer:
    """Republishes failure records to where they came from."""

    def __init__(self, subscriber: Any, publisher: Any, subscription: str) -> None:
        self._subscriber = subscriber
        self._publisher = publisher
        self._subscription = subscription
        self._topics: dict[str, str] = {}  # source subscription -> its topic

    def replay(
        self,
        *,
        job: str | None = None,
        match: Match | None = None,
        limit: int | None = None,
        dry_run: bool = False,
    ) -> Iterator[Replayed]:
        """Yield one ``Replayed`` per matching record, as each is done."""
        puller = _Puller(self._subscriber, self._subscription)
        try:
            for chosen in _choose(puller, job, match, limit):
                yield from self._batch(chosen, puller, dry_run)
        finally:
            puller.release()

    def delete(
        self, *, job: str | None = None, match: Match | None = None, limit: int | None = None
    ) -> Iterator[Replayed]:
        """Ack the matching records without republishing them (status ``deleted``): they are
        gone for good."""
        puller = _Puller(self._subscriber, self._subscription)
        try:
            for chosen in _choose(puller, job, match, limit):
                if chosen:
                    self._subscriber.acknowledge(
                        request={
                            "subscription": self._subscription,
                            "ack_ids": [record.ack_id for record in chosen],
                        }
                    )
                yield from (Replayed(record, "deleted") for record in chosen)
        finally:
            puller.release()

    def _batch(
        self, records: list[FailureRecord], puller: _Puller, dry_run: bool
    ) -> Iterator[Replayed]:
        sent = []
        for record in records:
            topic = self.source_topic(record)
            if not topic:
                puller.hold(record)
                yield Replayed(record, "failed", detail="no source_topic to replay to")
            elif c.ATTR_DATA_CUT in record.attributes and not record.forwarded_by_policy:
                puller.hold(record)  # the record is all that is left of the job: kept
                yield Replayed(record, "failed", detail=(
                    f"its data was cut to fit the record ({len(record.data)} of "
                    f"{record.attributes[c.ATTR_DATA_CUT]} bytes): not replayed"
                ))  # fmt: skip
            elif dry_run:
                puller.hold(record)
                yield Replayed(record, "would_replay", topic)
            else:
                future = self._publisher.publish(topic, record.data, **record.replay_attributes())
                sent.append((record, topic, future))
        waits = [(topic, "", future) for _, topic, future in sent]
        results = confirm_all(self._publisher, waits, _PUBLISH_TIMEOUT)
        for (record, topic, _), result in zip(sent, results, strict=True):
            if isinstance(result, Exception):  # not confirmed: keep the record
                puller.hold(record)
                yield Replayed(record, "failed", topic, f"publish failed: {result}")
                continue
            # Acked only now that the republish is confirmed: a lost ack means a second copy,
            # which the job id's idempotency record turns into a duplicate, never a loss.
            self._subscriber.acknowledge(
                request={"subscription": self._subscription, "ack_ids": [record.ack_id]}
            )
            yield Replayed(record, "replayed", topic)

    def source_topic(self, record: FailureRecord) -> str:
        """The topic a record came from: the one its worker wrote, or for one Pub/Sub
        forwarded, the topic of the subscription Pub/Sub names (never a ``source_topic``
        its publisher set: the replay would go wherever that says)."""
        if not record.forwarded_by_policy:
            return record.attributes.get(c.ATTR_SOURCE_TOPIC, "")
        source = record.attributes.get(c.ATTR_PUBSUB_SOURCE_SUBSCRIPTION, "")
        if not source:
            return ""
        path = subscription_path(record.attributes.get(c.ATTR_PUBSUB_SOURCE_PROJECT, ""), source)
        if path not in self._topics:
            try:
                sub = self._subscriber.get_subscription(request={"subscription": path}, timeout=30)
                self._topics[path] = sub.topic
            except gexc.GoogleAPICallError as exc:
                log.warning("cannot read %s to find the record's topic: %s", path, exc)
                self._topics[path] = ""
        return self._topics[path]


def _choose(
    puller: _Puller, job: str | None, match: Match | None, limit: int | None
) -> Iterator[list[FailureRecord]]:
    """The matching records, a pulled batch at a time, ``limit`` at most; the others are held
    to be given back."""
    count = 0
    while limit is None or count < limit:
        batch = puller.pull(_BATCH)
        if batch is None:
            break
        chosen: list[FailureRecord] = []
        for record in batch:
            if _wanted(record, job, match) and (limit is None or count + len(chosen) < limit):
                chosen.append(record)
            else:
                puller.hold(record)
        count += len(chosen)
        yield chosen


def table(records: list[FailureRecord], *, width: int = 60) -> list[str]:
    """Rows for ``dlq list``: job, job_id, error_type, error_message, attempts, failed_at."""
    header = ("JOB", "JOB_ID", "ERROR_TYPE", "ERROR_MESSAGE", "ATTEMPTS", "FAILED_AT")
    rows = [header] + [
        (
            r.job or "-",
            r.job_id or "-",
            r.error_type or "-",
            _shorten(r.error_message, width) or "-",
            r.attempts or "-",
            r.failed_at or "-",
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
