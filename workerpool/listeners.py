"""The processor's one observer hook: listeners hear how each delivery ended.

``Processor(listeners=[...])`` calls every listener once per delivery, right where the outcome
label is counted in ``Processor.stats``, so telemetry counts the same thing and never a second
way. A listener must be quick and must not raise (an exception is logged and ignored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Settled:
    """How one delivery ended: its outcome ``label`` (see ``constants.OUTCOME_LABELS``)."""

    label: str
    job: str
    job_id: str
    message_id: str
    attempt: int
    # Seconds from the start of its run to its settlement; None if it never ran (bad input).
    duration: float | None = None
    # Why it was dead-lettered (``error_type`` of the failure record), else "".
    error_type: str = ""

    @property
    def run_key(self) -> tuple[str, int]:
        """Tells runs apart: a redelivery of the same message has another attempt number."""
        return self.message_id, self.attempt


Listener = Callable[[Settled], None]
