"""How many messages wait? Asked while the fleet is at zero, when nobody else could know.

A probe pulls up to ``limit`` messages within ``timeout`` and gives every one back at once
(``modify_ack_deadline(0)``; one of an ordering key by a lease of a second, which keeps the
key's order on the emulator too). It sees a single message within a pull's time, on the emulator
and on Pub/Sub alike, where Cloud Monitoring's backlog is minutes late and cannot wake a fleet
from zero; and it says how many at least wait (a pull may bring fewer than there are, never
more), so a fleet can wake straight to the size a burst needs rather than growing into it one
cold start at a time. A probe that finds fewer than ``limit`` may cost its whole ``timeout``:
the pull that finds no more can wait for its deadline (the emulator answers it at once while
the probe holds the rest, and an empty subscription just before the deadline).

What it costs: a probe is one delivery of every message it touches, which the subscription's
dead-letter policy counts (the worker counts failed runs per job id, so ``max_attempts`` is
not touched). Giving a message back is a nack (a keyed one's lease of a second lapses
instead): without a retry policy it can be pulled again at once; with one, Pub/Sub redelivers
it after the policy's minimum backoff (about a replica's cold start with ``workerpool
provision``'s 10 s). ``SignalReader`` probes only while the fleet
is at zero, and not again while the replicas it woke are starting, so a message sees one probe
per wake-up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from google.api_core import exceptions as gexc

from workerpool import constants as c

log = logging.getLogger(__name__)

# Pub/Sub's most messages per pull (and per modify_ack_deadline well within its request size).
MOST_PER_PULL = 1000


class Probe:
    def __init__(
        self,
        subscriber: Any,
        subscription: str,
        *,
        timeout: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._subscriber = subscriber
        self._subscription = subscription
        self._timeout = timeout
        self._clock = clock
        self._failing = False

    def count(self, limit: int) -> int | None:
        """How many messages (``limit`` at most) are seen waiting within ``timeout`` seconds,
        all given back; None if the first pull failed (logged once per outage).

        A pull may bring fewer than wait (the emulator brings 100 at most, Pub/Sub what it has
        at hand), so the probe pulls again, holding what it saw so that each pull brings new
        messages, until it has ``limit``, a pull brings none, or the time is spent."""
        limit = max(1, min(limit, MOST_PER_PULL))
        deadline = self._clock() + self._timeout
        seen: list[Any] = []
        while len(seen) < limit:
            try:
                got = self._pull(limit - len(seen), max(0.0, deadline - self._clock()))
            except Exception as exc:
                if seen:  # seen already: the count stands, and they are given back below
                    break
                if not self._failing:
                    log.warning("probe pull of %s failed: %s", self._subscription, exc)
                self._failing = True
                return None
            if not got:
                break
            seen += got
        # A message of an ordering key goes back by a short lease that lapses, as the
        # worker gives one back: the emulator puts a nacked one after its key's messages
        # not delivered yet, and the key would then run out of order.
        self._give_back([r.ack_id for r in seen if not r.message.ordering_key], 0)
        self._give_back([r.ack_id for r in seen if r.message.ordering_key],
                        math.ceil(c.ORDERED_GIVE_BACK_SECONDS))  # fmt: skip
        if self._failing:
            log.info("probe pull of %s answers again", self._subscription)
        self._failing = False
        return len(seen)

    def _pull(self, most: int, timeout: float) -> list[Any]:
        """One pull's received messages; none if the deadline passed first."""
        if timeout <= 0:
            return []
        try:
            # The emulator answers an empty subscription just before the deadline, Pub/Sub
            # at once or at the deadline: either way a probe costs ``timeout`` at most.
            response = self._subscriber.pull(
                request={"subscription": self._subscription, "max_messages": most},
                timeout=timeout,
                retry=None,
            )
        except gexc.DeadlineExceeded:
            return []
        return list(response.received_messages)

    def _give_back(self, ack_ids: list[str], seconds: int) -> None:
        if not ack_ids:
            return
        try:
            self._subscriber.modify_ack_deadline(
                request={
                    "subscription": self._subscription,
                    "ack_ids": ack_ids,
                    "ack_deadline_seconds": seconds,
                },
                timeout=self._timeout,
            )
        except Exception as exc:  # they come back when their ack deadline passes instead
            log.warning("probe could not give back the %d messages it saw: %s", len(ack_ids), exc)
