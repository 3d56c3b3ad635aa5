"""The example jobs on the Pub/Sub emulator, with workerpool's pytest fixtures (loaded by
itself: workerpool registers its plugin with pytest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import reports_jobs

from workerpool.testing import PubSubResources, wait_settled


def test_reports_are_built_announced_and_a_bad_one_recorded(
    pubsub_resources: PubSubResources, worker: Callable[..., Any]
) -> None:
    # Given two reports to build, one that does not exist, and an announcement
    pubsub_resources.publish(
        "reports.build", {"report": "daily", "day": "2026-02-01"}, job_id="r-1"
    )
    pubsub_resources.publish(
        "reports.build", {"report": "weekly", "day": "2026-02-01"}, job_id="r-2"
    )
    pubsub_resources.publish(
        "reports.build", {"report": "yearly", "day": "2026-02-01"}, job_id="r-3"
    )
    pubsub_resources.publish("reports.announce", {"report": "daily"}, job_id="a-1")
    # When a worker runs the example's jobs with its config
    running = worker(
        jobs=["reports_jobs"], max_outstanding=4, job_config={"reports.build": {"bucket": "b"}}
    )
    stats = wait_settled(running, 4)
    # Then three were done, and the unknown report is on the dead-letter topic
    assert stats == {"done": 3, "dead_lettered": 1}
    [record] = pubsub_resources.dead_letters(expected=1)
    assert record.attributes["error_type"] == "reports.unknown"
    assert {"gs://b/daily/2026-02-01.csv", "gs://b/weekly/2026-02-01.csv"} <= set(
        reports_jobs.BUILT
    )
    assert "daily" in reports_jobs.ANNOUNCED
