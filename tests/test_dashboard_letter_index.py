"""The Dead letters page's index, in-process: the first view waits for the first read within
its bound and is otherwise told there is no index yet (a failed first read is its error), the
next ones are served from the index, a stale one is read again in the background (the view not
waiting for it), a failed read keeps what was read before, and an action's records are
forgotten."""

from __future__ import annotations

import threading

import pytest

from tests.support import wait_for
from workerpool.dashboard.letter_index import LetterIndex
from workerpool.ops.dlq import FailureRecord


def _record(message_id: str) -> FailureRecord:
    return FailureRecord("ack-" + message_id, message_id, b"{}", {"failed_at": message_id})


class Subscription:
    """What each read returns, in turn; a read waits for ``go`` when it is given."""

    def __init__(self, *reads: list[str] | Exception) -> None:
        self.reads = list(reads)
        self.count = 0
        self.go: threading.Event | None = None
        self.done = threading.Event()

    def read(self) -> list[FailureRecord]:
        if self.go is not None:
            self.go.wait(30)
        found = self.reads[min(self.count, len(self.reads) - 1)]
        self.count += 1
        self.done.set()
        if isinstance(found, Exception):
            raise found
        return [_record(m) for m in found]


def _ids(index: LetterIndex) -> list[str]:
    snapshot = index.snapshot()
    assert snapshot is not None
    return [record.message_id for record in snapshot.records]


def test_views_are_served_from_the_index_and_a_stale_one_reads_again_behind_the_view() -> None:
    # Given an index over a subscription read once
    now = [0.0]
    sub = Subscription(["b", "a"], ["a", "b", "c"])
    index = LetterIndex(sub.read, 100, fresh=10.0, first_wait=30, clock=lambda: now[0])
    assert _ids(index) == ["a", "b"] and sub.count == 1
    # When views come within the freshness window: nothing is read
    now[0] = 10.0
    assert _ids(index) == ["a", "b"] and sub.count == 1
    # When one comes later: it is served what was read, while the subscription is read again
    sub.go, sub.done = threading.Event(), threading.Event()
    now[0] = 10.5
    assert _ids(index) == ["a", "b"]
    sub.go.set()
    assert sub.done.wait(30)
    # Then the next view shows what that read found
    assert wait_for(lambda: _ids(index) == ["a", "b", "c"], 30)
    assert sub.count == 2


def test_a_failed_read_keeps_the_index_and_an_action_s_records_are_forgotten() -> None:
    now = [0.0]
    sub = Subscription(["a", "b", "c"], RuntimeError("pubsub down"), ["a", "c", "d"])
    index = LetterIndex(sub.read, 3, first_wait=30, clock=lambda: now[0])
    assert _ids(index) == ["a", "b", "c"]
    snapshot = index.snapshot()
    assert snapshot is not None and not snapshot.complete  # 3: the limit
    # When an action took "b" off the subscription: the index forgets it at once
    with index.acting() as forget:
        forget({"b"})
    assert _ids(index) == ["a", "c"]
    # When a read again fails: the index stays as it was
    sub.done.clear()
    now[0] = 100.0
    assert _ids(index) == ["a", "c"]  # served at once; the read runs behind it
    assert sub.done.wait(30) and sub.count == 2
    assert _ids(index) == ["a", "c"]  # this view (stale still) starts the next read


def test_a_first_view_waits_for_the_first_read_within_its_bound() -> None:
    # Given an index warmed as the dashboard starts, its read not done yet
    sub = Subscription(["a"], ["a", "b"])
    sub.go = threading.Event()
    index = LetterIndex(sub.read, 100, first_wait=30)
    index.warm()
    # When a first view comes meanwhile, and the read then ends
    viewed: list[list[str]] = []
    view = threading.Thread(target=lambda: viewed.append(_ids(index)))
    view.start()
    sub.go.set()
    view.join(30)
    # Then the view got that read's records, and the subscription was read once
    assert viewed == [["a"]] and sub.count == 1


def test_a_first_view_past_its_bound_is_told_the_read_is_under_way() -> None:
    # Given an index whose first read is held (up to 30 s) by the test
    sub = Subscription(["a"])
    sub.go = threading.Event()
    index = LetterIndex(sub.read, 100, first_wait=0.01)
    # When views come while it is held: each is told there is no index yet, and one read runs
    assert index.snapshot() is None and index.snapshot() is None
    assert sub.count == 0
    # When the read ends: the next view shows what it found
    sub.go.set()
    assert sub.done.wait(30)
    assert wait_for(lambda: index.snapshot() is not None, 30)
    assert _ids(index) == ["a"] and sub.count == 1


def test_a_failed_first_read_is_the_view_s_error_and_the_next_view_reads_again() -> None:
    sub = Subscription(RuntimeError("pubsub down"), ["a"])
    index = LetterIndex(sub.read, 100, first_wait=30)
    with pytest.raises(RuntimeError, match="pubsub down"):
        index.snapshot()
    assert _ids(index) == ["a"] and sub.count == 2


def test_settling_waits_for_the_read_under_way() -> None:
    # Given a read under way (the dashboard starting), held until told to go on
    sub = Subscription(["a"])
    sub.go = threading.Event()
    index = LetterIndex(sub.read, 100)
    index.warm()
    assert wait_for(lambda: sub.count == 0 and not index.settle(0.01), 30)
    # When it ends: settling returns, the read done
    sub.go.set()
    assert index.settle(30) and sub.count == 1
