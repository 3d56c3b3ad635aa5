"""A subscription's backlog from Cloud Monitoring: undelivered messages and the age of the
oldest unacked one, read over Monitoring's REST API with the ambient credentials (google-auth,
already a dependency of the Pub/Sub client). The figures lag by one to three minutes, and the
emulator has no Monitoring at all: ``workerpool status`` shows them, the autoscaler takes them
as one signal among faster ones.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

EMULATOR_VARIABLE = "PUBSUB_EMULATOR_HOST"
MONITORING_URL = "https://monitoring.googleapis.com/v3/projects/{project}/timeSeries"
MONITORING_SCOPE = "https://www.googleapis.com/auth/monitoring.read"
UNDELIVERED = "num_undelivered_messages"
OLDEST_UNACKED_AGE = "oldest_unacked_message_age"


def monitoring_session() -> Any:
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    credentials, _ = google.auth.default(scopes=[MONITORING_SCOPE])
    return AuthorizedSession(credentials)  # type: ignore[no-untyped-call]


def latest(session: Any, project: str, subscription_id: str, metric: str) -> float | None:
    """The newest point of the subscription's ``metric`` in the last 10 minutes, if any."""
    point = latest_point(session, project, subscription_id, metric)
    return None if point is None else point.value


@dataclass(frozen=True)
class Point:
    value: float
    at: float | None  # when it was taken, POSIX seconds (None: the answer did not say)


def latest_point(session: Any, project: str, subscription_id: str, metric: str) -> Point | None:
    """The newest point of the subscription's ``metric`` in the last 10 minutes, if any, with
    the time it was taken: a backlog counted minutes ago says less the more was done since."""
    now = datetime.now(UTC)
    params = {
        "filter": (
            f'metric.type = "pubsub.googleapis.com/subscription/{metric}" AND '
            f'resource.labels.subscription_id = "{subscription_id}"'
        ),
        "interval.startTime": (now - timedelta(minutes=10)).isoformat().replace("+00:00", "Z"),
        "interval.endTime": now.isoformat().replace("+00:00", "Z"),
    }
    response = session.get(MONITORING_URL.format(project=project), params=params, timeout=10)
    response.raise_for_status()
    series = response.json().get("timeSeries", [])
    if not series or not series[0].get("points"):
        return None
    point = series[0]["points"][0]  # points come newest first
    value = point["value"]
    taken = point.get("interval", {}).get("endTime")
    return Point(
        float(value.get("int64Value", value.get("doubleValue", 0))),
        None if taken is None else datetime.fromisoformat(taken).timestamp(),
    )


@dataclass(frozen=True)
class Backlog:
    undelivered: float | None
    oldest_age: float | None
    at: float | None = None  # when the undelivered count was taken (POSIX seconds)


class BacklogReader:
    """The backlog, read at most once per ``every`` seconds (Monitoring's points are a minute
    apart: reading more often only costs quota); None while Monitoring cannot answer, which
    is logged once, with why."""

    def __init__(
        self,
        subscription: str,
        *,
        session: Any = None,
        every: float = 30.0,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _, self._project, _, self._subscription_id = subscription.split("/")
        self._session = session
        self._every = every
        self._clock = clock
        self._emulated = bool((os.environ if env is None else env).get(EMULATOR_VARIABLE))
        self._read_at: float | None = None
        self._last: Backlog | None = None
        self._failing = False

    def read(self) -> Backlog | None:
        if self._emulated:
            return None
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self._every:
            return self._last
        self._read_at = now
        try:
            self._session = self._session or monitoring_session()
            undelivered, age = self._latest(UNDELIVERED), self._latest(OLDEST_UNACKED_AGE)
            self._last = Backlog(
                None if undelivered is None else undelivered.value,
                None if age is None else age.value,
                None if undelivered is None else undelivered.at,
            )
        except Exception as exc:  # credentials, permission, network: the faster signals remain
            if not self._failing:
                log.warning("Cloud Monitoring unavailable (%s): backlog from heartbeats only", exc)
            self._failing, self._last = True, None
            return None
        self._failing = False
        return self._last

    def _latest(self, metric: str) -> Point | None:
        return latest_point(self._session, self._project, self._subscription_id, metric)
