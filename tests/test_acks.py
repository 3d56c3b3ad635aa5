"""How acks are batched: an ack waits for others to share its request, and nothing that
waits for acks waits for that (pure logic: a recording client, no emulator)."""

from __future__ import annotations

from typing import Any

from tests.support import wait_for
from workerpool import constants as c
from workerpool.worker.acks import Acknowledger

# Longer than any wait of these tests: an ack still waiting for others would fail them.
_LONG_WINDOW = 60.0


class _RecordingClient:
    def __init__(self) -> None:
        self.acks: list[list[str]] = []
        self.modacks: list[list[str]] = []
        self.deadlines: dict[str, int] = {}  # by ack id

    def acknowledge(self, request: Any, **options: Any) -> None:
        self.acks.append(list(request.ack_ids))

    def modify_ack_deadline(self, request: Any, **options: Any) -> None:
        self.modacks.append(list(request.ack_ids))
        self.deadlines.update((a, request.ack_deadline_seconds) for a in request.ack_ids)


def test_acks_queued_within_the_window_share_one_request_and_a_flush_does_not_wait_for_it() -> None:
    # Given an acknowledger whose acks wait a minute for others
    client = _RecordingClient()
    acks = Acknowledger(client, "projects/p/subscriptions/s", ack_window=_LONG_WINDOW)
    acks.start()
    try:
        # When three acks are queued, then flushed
        for ack_id in ("a", "b", "c"):
            acks.ack(ack_id)
        flushed = acks.flush(timeout=5)
        # Then the flush sent them at once, in one request
        assert flushed is True
        assert client.acks == [["a", "b", "c"]]
    finally:
        assert acks.close(timeout=5)


def test_an_ack_whose_answer_is_awaited_goes_at_once_with_those_queued_before_it() -> None:
    # Given an acknowledger whose acks wait a minute for others, and an ack queued
    client = _RecordingClient()
    acks = Acknowledger(client, "projects/p/subscriptions/s", ack_window=_LONG_WINDOW)
    acks.start()
    try:
        acks.ack("a")
        # When an ack whose answer a run waits for (exactly-once) is queued
        confirmed = acks.ack("b", confirm=True)
        # Then its answer comes without waiting for the window, and both went in one request
        assert confirmed is not None and confirmed.result(timeout=5) is True
        assert client.acks == [["a", "b"]]
    finally:
        assert acks.close(timeout=5)


def test_a_change_of_deadlines_does_not_wait_for_the_ack_window() -> None:
    # Given an acknowledger whose acks wait a minute for others
    client = _RecordingClient()
    acks = Acknowledger(
        client, "projects/p/subscriptions/s", interval=0.001, ack_window=_LONG_WINDOW
    )
    acks.start()
    try:
        # When an ack is queued, then a nack
        acks.ack("a")
        acks.modack(["b"], 0)
        # Then the nack is sent while the ack still waits for others
        deadline_sent = wait_for(lambda: client.modacks == [["b"]], timeout=5)
        assert deadline_sent and client.acks == []
    finally:
        assert acks.close(timeout=5)
    assert client.acks == [["a"]]  # sent by the close's flush


def test_a_delay_that_is_no_number_of_seconds_asks_for_the_longest_deadline() -> None:
    # Given an acknowledger
    client = _RecordingClient()
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    try:
        # When messages are given back after no number of seconds (a middleware's bug)
        acks.modack(["a"], float("nan"))
        acks.modack(["b"], float("inf"))
        assert acks.flush(timeout=5)
    finally:
        assert acks.close(timeout=5)
    # Then each is sent, with the longest deadline Pub/Sub takes, not at once
    assert client.deadlines == {"a": c.MAX_ACK_DEADLINE_SECONDS, "b": c.MAX_ACK_DEADLINE_SECONDS}
