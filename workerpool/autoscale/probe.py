"""Is a message waiting? Asked while no replica runs, when nobody else could know.

A probe pulls at most one message and gives it back at once (``modify_ack_deadline(0)``), so
it is the very next one any worker pulls. It sees a single message within a pull's time, on
the emulator and on Pub/Sub alike, where Cloud Monitoring's backlog is minutes late and cannot
wake a fleet from zero. What it costs: each probe that finds a message is one delivery of it,
which the subscription's dead-letter policy counts (the worker counts failed runs per job id,
so ``max_attempts`` is not touched); a fleet wakes on the first probe that finds one, so a
message sees one or two of them.
"""

from __future__ import annotations

import logging
from typing import Any

from google.api_core import exceptions as gexc

log = logging.getLogger(__name__)


class Probe:
    def __init__(self, subscriber: Any, subscription: str, *, timeout: float = 1.0) -> None:
        self._subscriber = subscriber
        self._subscription = subscription
        self._timeout = timeout
        self._failing = False

    def waiting(self) -> bool | None:
        """True if a message waits, False if none came within the timeout, None if the pull
        failed (logged once per outage)."""
        try:
            # The emulator answers an empty subscription just before the deadline, Pub/Sub
            # at once or at the deadline: either way a probe costs ``timeout`` at most.
            response = self._subscriber.pull(
                request={"subscription": self._subscription, "max_messages": 1},
                timeout=self._timeout,
                retry=None,
            )
        except gexc.DeadlineExceeded:
            return self._answered(False)
        except Exception as exc:
            if not self._failing:
                log.warning("probe pull of %s failed: %s", self._subscription, exc)
            self._failing = True
            return None
        ack_ids = [received.ack_id for received in response.received_messages]
        if ack_ids:
            try:
                self._subscriber.modify_ack_deadline(
                    request={
                        "subscription": self._subscription,
                        "ack_ids": ack_ids,
                        "ack_deadline_seconds": 0,
                    },
                    timeout=self._timeout,
                )
            except Exception as exc:  # it comes back when its ack deadline passes instead
                log.warning("probe could not give back the message it saw: %s", exc)
        return self._answered(bool(ack_ids))

    def _answered(self, waiting: bool) -> bool:
        if self._failing:
            log.info("probe pull of %s answers again", self._subscription)
        self._failing = False
        return waiting
