"""The probe: how many messages wait while the fleet is at zero, each given back at once
(a fake subscription here; on the emulator in tests/test_autoscale_emulator.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from google.api_core.exceptions import DeadlineExceeded, ServiceUnavailable

from workerpool.autoscale.probe import Probe

SUB = "projects/p/subscriptions/jobs"


class FakeSubscriber:
    """A subscription as a probe sees it: ``waiting`` messages, ``per_pull`` at most per pull
    (the emulator's 100), none pulled again while held."""

    def __init__(self, waiting: int, per_pull: int = 100, fail: int | None = None) -> None:
        self.waiting, self.per_pull, self.fail = waiting, per_pull, fail
        self.held = 0
        self.asked: list[int] = []
        self.given_back: list[list[str]] = []

    def pull(self, request: dict[str, Any], timeout: float, retry: None) -> Any:
        self.asked.append(request["max_messages"])
        if self.fail is not None and len(self.asked) > self.fail:
            raise ServiceUnavailable("pull refused")
        seen = min(self.per_pull, request["max_messages"], self.waiting - self.held)
        if not seen:
            raise DeadlineExceeded("no message before the deadline")
        ids = [f"ack-{self.held + i}" for i in range(seen)]
        self.held += seen
        received = [
            SimpleNamespace(ack_id=i, message=SimpleNamespace(ordering_key="")) for i in ids
        ]
        return SimpleNamespace(received_messages=received)

    def modify_ack_deadline(self, request: dict[str, Any], timeout: float) -> None:
        assert request["ack_deadline_seconds"] == 0
        self.given_back.append(request["ack_ids"])
        self.held = 0


def test_a_probe_pulls_until_it_has_its_limit_or_sees_no_more_and_gives_all_back_at_once() -> None:
    # 300 waiting, 100 a pull: three pulls see them, a fourth sees none; one give-back
    many = FakeSubscriber(300)
    assert Probe(many, SUB).count(1000) == 300
    assert many.asked == [1000, 900, 800, 700]
    assert [len(ids) for ids in many.given_back] == [300] and many.held == 0
    # ... no more than its limit (nor Pub/Sub's 1000 a pull)
    capped = FakeSubscriber(300)
    assert Probe(capped, SUB).count(120) == 120 and capped.asked == [120, 20]
    assert Probe(FakeSubscriber(5000, per_pull=5000), SUB).count(2000) == 1000
    # ... an empty subscription: nothing to give back
    empty = FakeSubscriber(0)
    assert Probe(empty, SUB).count(1000) == 0 and empty.given_back == []


def test_a_failed_probe_says_nothing_but_what_it_saw_before_a_failure_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = Probe(FakeSubscriber(300, fail=0), SUB)
    assert down.count(1000) is None and down.count(1000) is None
    assert sum("probe pull" in r.getMessage() for r in caplog.records) == 1  # once an outage
    halfway = FakeSubscriber(300, fail=1)
    assert Probe(halfway, SUB).count(1000) == 100
    assert [len(ids) for ids in halfway.given_back] == [100]
