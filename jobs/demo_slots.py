"""``demo.sleep`` under fleet-wide concurrency limits, for the demo and the tests; load it
with ``--jobs workerpool_jobs.demo_slots`` and declare its keys' limits, e.g.
``--concurrency demo-slots=3 --concurrency 'tenant:*=1'``. (Not an entry point: a worker that
does not route these jobs needs no limits for them.)
"""

from __future__ import annotations

from dataclasses import dataclass

from workerpool import JobContext, job

from . import demo


@dataclass
class TenantSleepRequest(demo.SleepRequest):
    tenant: str = ""


@job("demo.slot_sleep", timeout=600, payload=demo.SleepRequest, concurrency="demo-slots")
def slot_sleep(ctx: JobContext, request: demo.SleepRequest) -> None:
    """``demo.sleep`` holding one of the fleet's "demo-slots" slots."""
    demo.sleep(ctx, request)


@job("demo.tenant_sleep", timeout=600, payload=TenantSleepRequest, concurrency="tenant:{tenant}")
def tenant_sleep(ctx: JobContext, request: TenantSleepRequest) -> None:
    """``demo.sleep`` holding a slot of its own tenant's key."""
    demo.sleep(ctx, request)


@job("demo.flaky_slot_sleep", timeout=600, max_attempts=3, payload=demo.SleepRequest,
     concurrency="demo-slots")  # fmt: skip
def flaky_slot_sleep(ctx: JobContext, request: demo.SleepRequest) -> None:
    """``demo.slot_sleep`` with only 3 attempts, for failures counted apart from deferrals."""
    demo.sleep(ctx, request)
