"""Exceptions a handler raises to choose its outcome, configuration errors, and an autoscaler
actuator's failures."""

import math

from workerpool import constants as c


class JobError(Exception):
    """Base class of the errors a handler raises on purpose."""


class RetryableError(JobError):
    """The job failed for a reason that may pass: redeliver it later, with backoff."""


class RateLimitedError(RetryableError):
    """The upstream said "too many requests": slow the named limiter down and retry later."""

    def __init__(
        self, message: str, *, limiter: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.limiter = limiter
        self.retry_after = retry_after


class PermanentError(JobError):
    """The job can never succeed with this input: record the failure and ack."""

    def __init__(self, message: str, *, error_type: str = c.ERR_PERMANENT) -> None:
        super().__init__(message)
        self.error_type = error_type


class Defer(JobError):
    """Not now, and not a failure: redeliver later without counting toward ``max_attempts``
    (a shared resource is at its cap, say). ``delay`` in seconds, or None for the backoff.

    Each deferral still counts as a delivery for the subscription's own dead-letter policy; on
    the last one it allows, the message is published again as the same job and then acked.
    """

    def __init__(self, reason: str, *, delay: float | None = None) -> None:
        if delay is not None and not math.isfinite(delay):
            raise ValueError(f"Defer's delay must be a finite number of seconds, not {delay!r}")
        super().__init__(reason)
        self.delay = delay


class ConfigError(Exception):
    """Bad configuration; the CLI prints it as one line and exits with code 2."""


class ActuatorError(Exception):
    """An autoscaler's actuator could not read or change the fleet (refused, not found, the API
    down or silent). The message is one line naming the resource and the API's answer; the
    autoscaler logs it and tries again at its next decision."""
