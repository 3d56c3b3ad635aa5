"""``demo.sleep`` whose key is blocked when it exhausts its attempts on an ordered
subscription, for the demo and the tests; load it with ``--jobs workerpool_jobs.demo_ordering``.
(Not an entry point: a worker that does not route these jobs needs no blocked-keys store.)
"""

from __future__ import annotations

from workerpool import JobContext, job

from . import demo


@job("demo.blocking_sleep", timeout=600, max_attempts=2, payload=demo.SleepRequest,
     ordered_exhausted="block")  # fmt: skip
def blocking_sleep(ctx: JobContext, request: demo.SleepRequest) -> None:
    """``demo.sleep``; its key stops at its second failure until an operator unblocks it."""
    demo.sleep(ctx, request)
