"""Fresh copies of messages that the subscription's dead-letter policy would otherwise take.

Pub/Sub counts every delivery of a message, and once the policy's ``max_delivery_attempts``
are used it forwards the message, raw, to the dead-letter topic. A job that waits its turn is
not failing, but each wait is a delivery: a deferral for want of a concurrency slot, a copy
that came back while the first still runs, a drain. A key with a long line used up 20
deliveries in 30 s on the emulator, and its job never ran. So on a message's last delivery a
wait publishes a fresh copy to the topic, then acks the message: the copy goes by the same job
id (the idempotency store keeps the job's completion, its failures and its place in a key's
line by job id), and its ``not_before`` keeps the wait's delay.

A copy names the message it copies (``copy_of``): claims are taken under that first message's
id, so a copy that arrives while the job still runs from it, or while its claim is being let
go, waits as a redelivery of that message would, never acked as a duplicate (the job's only
live message may be this copy now). A copy published and then not acked (a lost ack) is such
a redelivery too. A topic's every subscription receives the copy: it names the one it was made
for (``copy_for``), and workers of the others ack it unrun; other consumers of the topic see
it as a duplicate.

A drain waits for copies no later than its deadline, since the platform's kill follows it, and
starts none in its last second; at the deadline there is no time to wait for a publish at
all: what is still held then is nacked, and on its last delivery the policy's forward is the
backstop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from workerpool import constants as c
from workerpool.publishing import send
from workerpool.schedule.when import MAX_AHEAD, not_before_text, parse_not_before
from workerpool.worker.delivery import Delivery
from workerpool.worker.envelope import copy_attributes, first_message_id

log = logging.getLogger(__name__)

_LONGEST = MAX_AHEAD.total_seconds()  # the furthest not_before a worker takes
# A copy published after its message was nacked would be both a copy and, the delivery being
# the last, a forward to the dead-letter topic (a publish cannot be called back): close to a
# drain's deadline none is started.
_LAST_START = 1.0
# How often a wait for copies looks whether a drain has set a deadline meanwhile.
_LOOK_AGAIN = 0.1


class Renewer:
    def __init__(
        self,
        publisher: Any,
        topic: str,
        subscription: str,
        max_deliveries: int,
        *,
        timeout: float = 10.0,
    ) -> None:
        """``max_deliveries``: the subscription's ``max_delivery_attempts`` (0: no policy,
        nothing is ever renewed); ``timeout``: how long a renewal waits for its copies."""
        self._publisher = publisher
        self._topic = topic
        self._subscription = subscription
        self._max_deliveries = max_deliveries
        self._timeout = timeout
        self._deadline = math.inf  # a drain's: see ``stop_by``

    def ours(self, attributes: Mapping[str, str]) -> bool:
        """False for a copy made for another subscription of the topic (a copy carries
        both attributes: a message with only one of them is taken as it is)."""
        made_for = attributes.get(c.ATTR_COPY_FOR)
        return (
            made_for is None or made_for == self._subscription or c.ATTR_COPY_OF not in attributes
        )

    def last(self, delivery_attempt: int) -> bool:
        """Whether a message on this delivery is forwarded by the policy if it comes back."""
        return 0 < self._max_deliveries <= delivery_attempt

    def stop_by(self, deadline: float) -> None:
        """A drain ends at the monotonic ``deadline``, and the platform's kill follows: from
        now on no copy is waited for beyond it, those already waited for included, and in its
        last ``_LAST_START`` seconds none is published (nor waited for)."""
        self._deadline = deadline

    def renew(self, copies: Sequence[tuple[Delivery, float]]) -> list[bool]:
        """Publish a copy of each delivery, not to run for its number of seconds; whether
        each was published (within the timeout for all together, and a drain's deadline)."""
        started = time.monotonic()
        if self._deadline - started < _LAST_START:
            log.warning(
                "%d messages not renewed: the drain ends in %.1f s",
                len(copies), max(0.0, self._deadline - started),
            )  # fmt: skip
            return [False] * len(copies)
        futures = [self._publish(delivery, after) for delivery, after in copies]
        published = []
        for (delivery, _), future in zip(copies, futures, strict=True):
            try:
                if isinstance(future, Exception):
                    raise future
                copy_id = self._wait(future, started)
            except Exception as exc:  # nacked instead: the policy's forward is the backstop
                # (A failed publish pauses its key in the client: the key's next publish resumes
                # it, ``publishing.send``.)
                log.warning("message %s not renewed: %r", delivery.message_id, exc)
                published.append(False)
            else:
                log.info(
                    "message %s renewed as %s: its delivery %s was the last the "
                    "subscription's dead-letter policy allows",
                    delivery.message_id, copy_id, delivery.delivery_attempt,
                )  # fmt: skip
                published.append(True)
        return published

    def _wait(self, future: Future[str], started: float) -> str:
        """The copy's message id, once published; raises ``TimeoutError`` when the timeout
        or the drain's deadline (which may be set meanwhile) comes first."""
        while True:
            left = min(started + self._timeout, self._deadline) - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(left, _LOOK_AGAIN)))
            except TimeoutError:
                if future.done():  # the publish itself failed so (a socket's timeout)
                    raise
                if left <= _LOOK_AGAIN:
                    raise TimeoutError("Pub/Sub did not confirm it in time") from None

    def _publish(self, delivery: Delivery, after: float) -> Future[str] | Exception:
        """The copy's future, or what refused it at once (an attribute too many, say): a
        renewal never raises, since its message must still be nacked."""
        try:
            # With its key: on an ordered subscription the copy is owed in its place.
            future: Future[str] = send(
                self._publisher, self._topic, delivery.data, self._attributes(delivery, after),
                delivery.ordering_key,
            )  # fmt: skip
        except Exception as exc:
            return exc
        return future

    def _attributes(self, delivery: Delivery, after: float) -> dict[str, str]:
        attributes = copy_attributes(delivery)
        attributes[c.ATTR_COPY_OF] = first_message_id(delivery.attributes, delivery.message_id)
        attributes[c.ATTR_COPY_FOR] = self._subscription
        after = min(after, _LONGEST)
        own = attributes.get(c.ATTR_NOT_BEFORE)
        if after > 0 and not (own and _due_after(own, time.time() + after)):
            attributes[c.ATTR_NOT_BEFORE] = not_before_text(timedelta(seconds=after))
        if c.ATTR_JOB_ID not in attributes or len(attributes) > c.MAX_ATTRIBUTES:
            raise ValueError(
                f"no room for a copy's {len(attributes) - len(delivery.attributes)} attributes"
                f" beside the message's {len(delivery.attributes)} ({c.MAX_ATTRIBUTES} at most)"
            )
        return attributes


def _due_after(not_before: str, when: float) -> bool:
    """Whether the message's own ``not_before`` is later than ``when`` (an invalid one is
    kept as it is: the copy is rejected for it, as the message would have been)."""
    try:
        return parse_not_before(not_before) > when
    except ValueError:
        return True
