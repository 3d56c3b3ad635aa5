"""What a handler knows about the run it is in."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class JobContext:
    """Passed to every handler as its first argument.

    ``draining`` is set when the worker starts draining: finish soon or give up cleanly.
    ``cancelled`` is set at the drain deadline or when the job passes its own ``timeout``:
    stop now; the message will be redelivered (drain) or retried (timeout).
    """

    job: str
    job_id: str
    message_id: str
    delivery_attempt: int
    publish_time: datetime | None
    draining: threading.Event
    cancelled: threading.Event = field(default_factory=threading.Event)
    # The job's section of the config file (``[jobs."NAME"]``), empty if there is none.
    config: Mapping[str, Any] = field(default_factory=dict)
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = field(
        default_factory=lambda: logging.getLogger("workerpool.job")
    )

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return False early if the run is cancelled."""
        return not self.cancelled.wait(seconds)
