"""A job that fences its writes, for worker processes started with ``--jobs
tests.fencing_jobs`` and ``FENCED_RESOURCE`` naming the resource's SQLite file: it writes
"begin" with its claim's fencing token, works (a call that never looks at ``ctx.cancelled``),
then writes "end" (``tests.fenced_resource``).
"""

from __future__ import annotations

import os
import time

from tests.fenced_resource import KEY, RESOURCE_ENV, FencedResource
from workerpool import JobContext, job


@job("fencing.write", timeout=600, concurrency=KEY)
def fenced_write(ctx: JobContext, payload: dict[str, float]) -> None:
    assert ctx.fencing_token is not None, "run with an idempotency store"
    resource = FencedResource(os.environ[RESOURCE_ENV])
    if not resource.write(ctx.fencing_token, "begin"):
        return  # a newer holder runs the job: nothing left to do here
    time.sleep(payload["seconds"])
    resource.write(ctx.fencing_token, "end")  # refused if a newer holder wrote meanwhile
