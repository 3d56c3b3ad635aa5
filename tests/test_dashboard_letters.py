"""What the Dead letters page shows of a record, in-process: a large payload is kept cut in the
index and shown as cut; a JSON one is shown indented; any bytes a publisher sent are shown."""

from __future__ import annotations

import json

import pytest

from workerpool.dashboard.letter_index import Snapshot
from workerpool.dashboard.letters import PREVIEW, Selection, letters, preview
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
