"""What the Dead letters page shows of a record, in-process: a large payload is kept cut in the
index and shown as cut; a JSON one is shown indented; any bytes a publisher sent are shown."""

from __future__ import annotations

import json
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest

from workerpool.dashboard.letter_index import Snapshot
from workerpool.dashboard.letters import PREVIEW, DeadLetters, Selection, letters, preview
from workerpool.ops.dlq import FailureRecord


def _record(message_id: str, data: bytes) -> FailureRecord:
    return FailureRecord("ack-" + message_id, message_id, data, {"failed_at": message_id})


def test_a_large_payload_is_kept_and_shown_cut_a_small_one_whole() -> None:
    # Given a record with a 1 MB payload and one with a small JSON payload, as the index keeps them
    large = preview(_record("a", b"x" * 1_000_000))
    small = preview(_record("b", json.dumps({"order": 7}).encode()))
    # When a page shows them
    page = letters(Snapshot([large, small], True, 0.0), Selection(), 100)
    # Then the index held the first PREVIEW bytes and one more, and the page says it is cut
    assert len(large.data) == PREVIEW + 1
    shown = [letter.payload for letter in page.letters]
    assert shown[0] == "x" * PREVIEW + "... (cut: the payload is longer)"
    assert shown[1] == '{\n  "order": 7\n}'


@pytest.mark.parametrize(
    "data",
    [b'{"a": "\\ud800"}', b"[" * 1000 + b"]" * 1000, b"\xff\xfe{"],
    ids=["lone-surrogate", "nested-past-the-limit", "not-utf-8"],
)
def test_any_payload_is_shown_as_text_a_page_can_send(data: bytes) -> None:
    # Given a record whose payload is JSON no page can encode once parsed, JSON nested past
    # the parser's limit, or bytes that are not UTF-8 (any publisher's message may end here)
    page = letters(Snapshot([preview(_record("a", data))], True, 0.0), Selection(), 100)
    # When the page shows it, then it is text the response can encode
    [shown] = [letter.payload for letter in page.letters]
    shown.encode()
    assert shown


class _LargeRecords:
    """A dead-letter subscription of 3 pulls of 2 records of 1 MB each; it notes, at each
    pull, how much memory the process holds (``tracemalloc``)."""

    def __init__(self) -> None:
        self.pulls = 0
        self.held_at_pulls: list[int] = []

    def pull(self, request: dict[str, Any], timeout: float) -> Any:
        self.held_at_pulls.append(tracemalloc.get_traced_memory()[0])
        self.pulls += 1
        if self.pulls > 3:
            return SimpleNamespace(received_messages=[])
        received = []
        for i in range(2):
            message_id = f"m-{self.pulls}-{i}"
            message = SimpleNamespace(
                message_id=message_id, data=b"x" * 1_000_000,
                attributes={"failed_at": message_id}, publish_time=None,
            )  # fmt: skip
            received.append(SimpleNamespace(ack_id="ack-" + message_id, message=message))
        return SimpleNamespace(received_messages=received)

    def modify_ack_deadline(self, request: dict[str, Any]) -> None:
        pass


def test_a_read_keeps_each_payload_cut_as_it_is_pulled_never_all_of_them_whole() -> None:
    # Given a dead-letter subscription whose records are 1 MB each
    subscription = _LargeRecords()
    clients = SimpleNamespace(subscriber=subscription)
    # When the page's index reads it
    tracemalloc.start()
    try:
        records = DeadLetters("dlq", lambda: clients)._read()  # type: ignore[arg-type, return-value]
    finally:
        tracemalloc.stop()
    # Then it kept 6 records, each cut to the preview as soon as it was pulled: at its last
    # pull it held one pull's payloads (the 2 MB just read), not all three pulls' (6 MB)
    assert len(records) == 6 and all(len(r.data) == PREVIEW + 1 for r in records)
    assert subscription.held_at_pulls[-1] - subscription.held_at_pulls[0] < 3_000_000
