"""Exceptions a handler raises to choose its outcome, and configuration errors."""


class JobError(Exception):
    """Base class of the errors a handler raises on purpose."""


class RetryableError(JobError):
    """The job failed for a reason that may pass: redeliver it later, with backoff."""


class PermanentError(JobError):
    """The job can never succeed with this input: record the failure and ack."""

    def __init__(self, message: str, *, error_type: str = "permanent_error") -> None:
        super().__init__(message)
        self.error_type = error_type


class ConfigError(Exception):
    """Bad configuration; the CLI prints it as one line and exits with code 2."""
