"""Scale a Cloud Run worker pool through its manual instance count (Cloud Run Admin API v2,
REST, with the ambient credentials: google-auth, already a dependency of the Pub/Sub client).

    GET   https://run.googleapis.com/v2/projects/P/locations/L/workerPools/W
          -> a WorkerPool: scaling.manualInstanceCount (absent when never set: 0)
    PATCH same URL ?updateMask=scaling.manualInstanceCount
          body {"scaling": {"manualInstanceCount": N}} -> a long-running Operation

Changing the count creates no revision. Cloud Run chooses which instances a lower count stops
and gives each 10 s (SIGTERM, then SIGKILL), so the actuator cannot spare the busy ones as a
Deployment's pod-deletion cost does. It raises the count at once; it lowers it only as far as
the jobs running across the fleet (the replicas' beats) still fit the replicas that remain,
whichever Cloud Run stops, and a stopped replica's drain hands its runs back to them. The rest
of a scale-in waits for a later decision, when those jobs have finished.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import google.auth
import requests
from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError
from google.auth.transport.requests import AuthorizedSession

from workerpool.autoscale.actuator import Actuator, Beat
from workerpool.errors import ActuatorError, ConfigError

RUN_API = "https://run.googleapis.com"
RUN_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
COUNT_FIELD = "scaling.manualInstanceCount"
_POOL_NAME = re.compile(r"projects/[^/]+/locations/[^/]+/workerPools/[^/]+")
# What an operator can do about a refusal, by HTTP status.
_HINTS = {
    403: "the autoscaler's identity needs run.workerpools.get and run.workerpools.update",
    404: "no such worker pool: check its project, region and name",
}


def _default_session() -> Any:
    try:
        credentials, _ = google.auth.default(scopes=[RUN_SCOPE])
    except DefaultCredentialsError as exc:
        raise ConfigError(f"Cloud Run actuator: no Google credentials: {exc}") from None
    return AuthorizedSession(credentials)  # type: ignore[no-untyped-call]


class CloudRunActuator(Actuator):
    """``worker_pool``: ``projects/P/locations/REGION/workerPools/NAME``. ``session``: a
    requests-like session (default: an AuthorizedSession on the ambient credentials)."""

    name = "cloud-run"

    def __init__(
        self,
        worker_pool: str,
        *,
        session: Any = None,
        endpoint: str = RUN_API,
        timeout: float = 10.0,
    ) -> None:
        if not _POOL_NAME.fullmatch(worker_pool):
            raise ConfigError(
                f"Cloud Run worker pool {worker_pool!r}: expected "
                "projects/PROJECT/locations/REGION/workerPools/NAME"
            )
        self.worker_pool = worker_pool
        self._url = f"{endpoint}/v2/{worker_pool}"
        self._timeout = timeout
        self._session = session or _default_session()

    def current(self) -> int:
        pool = self._call("GET", "read")
        return int(pool.get("scaling", {}).get("manualInstanceCount", 0))

    def scale(self, desired: int, beats: Sequence[Beat]) -> str:
        now = self.current()
        target, why = instances_to_keep(now, desired, beats)
        if target != now:
            body = {"scaling": {"manualInstanceCount": target}}
            self._call("PATCH", "update", params={"updateMask": COUNT_FIELD}, json=body)
        return f"Cloud Run worker pool {self.worker_pool.rsplit('/', 1)[1]}: {why}"

    def close(self) -> None:
        self._session.close()

    def _call(self, method: str, verb: str, **kwargs: Any) -> dict[str, Any]:
        """The API's JSON answer; any failure is one ActuatorError line (no chained trace)."""
        where = f"Cloud Run worker pool {self.worker_pool}: {verb}"
        try:
            response = self._session.request(method, self._url, timeout=self._timeout, **kwargs)
        except requests.Timeout:
            raise ActuatorError(f"{where}: no answer within {self._timeout:g} s") from None
        except requests.ConnectionError as exc:
            raise ActuatorError(f"{where}: cannot connect: {_unwrapped(exc)}") from None
        except (requests.RequestException, GoogleAuthError) as exc:
            raise ActuatorError(f"{where}: {type(exc).__name__}: {exc}") from None
        try:
            answer = response.json()
        except ValueError:  # not JSON: a proxy's error page
            answer = None
        if not isinstance(answer, dict):
            answer = {}
        error = answer.get("error")  # a refusal, or an operation that failed at once
        if response.status_code >= 400 or error:
            raise ActuatorError(f"{where}: {_refusal(response.status_code, error)}")
        return answer


def _unwrapped(exc: requests.ConnectionError) -> object:
    """The socket's error, from under urllib3's retry wrapper that requests passes on."""
    wrapped = exc.args[0] if exc.args else None
    return getattr(wrapped, "reason", None) or exc


def _refusal(status: int, error: Any) -> str:
    error = error if isinstance(error, dict) else {}
    code = error.get("code", status)
    # Split and joined again: a message over several lines (or none at all) stays one line.
    text = " ".join(f"{code} {error.get('status', '')} {error.get('message', '')}".split())
    hint = _HINTS.get(code)
    return text + (f" ({hint})" if hint else "")


def instances_to_keep(current: int, desired: int, beats: Sequence[Beat]) -> tuple[int, str]:
    """The instance count to set now, and a line saying why. Up: ``desired`` at once. Down:
    no lower than the jobs running across the fleet need, ``ceil(running / slots)`` (every beat
    counts, draining ones too: their runs come back to the rest)."""
    if desired == current:
        return current, f"{current} instances, unchanged"
    if desired > current:
        return desired, f"raised from {current} to {desired} instances"
    running = sum(beat.running for beat in beats)
    slots = min((beat.slots for beat in beats), default=1)
    needed = math.ceil(running / slots)
    target = min(current, max(desired, needed))
    if target == desired:
        return target, f"lowered from {current} to {target} instances"
    held = (
        f"not {desired}: {running} jobs running need {needed} replicas of {slots} slots "
        "(Cloud Run picks the instances it stops)"
    )
    if target == current:
        return current, f"kept {current} instances, {held}"
    return target, f"lowered from {current} to {target} instances, {held}"
