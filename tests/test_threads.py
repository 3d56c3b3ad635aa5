"""Every background thread survives an unexpected exception, says so in ``healthy`` while it
cannot do its work, and carries on (pure logic: fakes for Pub/Sub, no emulator)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from google.api_core import exceptions as gexc

from tests.support import http_get, wait_for
from workerpool.registry import Registry
from workerpool.telemetry.health import HealthServer
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker import settlement
from workerpool.worker.acks import Acknowledger
from workerpool.worker.delivery import Delivery
from workerpool.worker.lease import Leaser
from workerpool.worker.processor import Processor, ProcessorSettings
from workerpool.worker.puller import Puller
from workerpool.worker.timers import Timers


class _FlakyClient:
    """acknowledge/modify_ack_deadline fail with the queued errors first, then succeed."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.acked: list[str] = []
        self.modacked: list[str] = []

    def _maybe_fail(self) -> None:
        if self.errors:
            raise self.errors.pop(0)

    def acknowledge(self, request: Any, **options: Any) -> None:
        self._maybe_fail()
        self.acked.extend(request.ack_ids)

    def modify_ack_deadline(self, request: Any, **options: Any) -> None:
        self._maybe_fail()
        self.modacked.extend(request.ack_ids)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("a bug"), ValueError("Cannot invoke RPC on closed channel!"),
     gexc.PermissionDenied("no")],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_the_ack_thread_survives_a_failed_request_and_sends_the_next(error: Exception) -> None:
    # Given an acknowledger whose first request fails with an error outside its retry list
    client = _FlakyClient(error)
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    try:
        # When two acks are sent one after the other
        first = acks.ack("a", confirm=True)
        assert first is not None and first.result(timeout=5) is False
        # Then it says so while it cannot send, and the next one goes through
        assert acks.healthy is False
        second = acks.ack("b", confirm=True)
        assert second is not None and second.result(timeout=5) is True
        assert acks.healthy is True and client.acked == ["b"]
    finally:
        assert acks.close(timeout=5)


class _HangingAcks(_FlakyClient):
    """acknowledge hangs until ``release`` is set (a stalled call); modify_ack_deadline
    answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.acking, self.release = threading.Event(), threading.Event()

    def acknowledge(self, request: Any, **options: Any) -> None:
        self.acking.set()
        self.release.wait(30)
        super().acknowledge(request, **options)


def test_lease_extensions_go_out_while_an_ack_request_hangs() -> None:
    # Given an acknowledger whose ack request hangs (its retries of timeouts take 41 s)
    client = _HangingAcks()
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    try:
        acks.ack("done")
        assert client.acking.wait(10)
        # When a running message's lease is extended meanwhile
        acks.extend([make_delivery(b"{}", {}, message_id="long")], 30)
        # Then the extension goes out while the ack still hangs: the lease does not lapse
        assert wait_for(lambda: client.modacked == ["ack-long"], timeout=10)
        assert client.acked == [] and not client.release.is_set()
    finally:
        client.release.set()
        assert acks.close(timeout=5)
    assert client.acked == ["done"]


class _RetriedExtension(_FlakyClient):
    """The first extension times out once the test says so (``go``), and is retried."""

    def __init__(self) -> None:
        super().__init__()
        self.extending, self.go = threading.Event(), threading.Event()
        self.deadlines: list[tuple[str, int]] = []

    def modify_ack_deadline(self, request: Any, **options: Any) -> None:
        if request.ack_deadline_seconds == 60 and not self.extending.is_set():
            self.extending.set()
            self.go.wait(30)
            raise gexc.DeadlineExceeded("slow")
        self.deadlines.extend((a, request.ack_deadline_seconds) for a in request.ack_ids)


def test_a_nack_sent_while_an_extension_is_retried_stays_the_last_word() -> None:
    # Given an extension of a running message whose first try is slow and then times out
    client = _RetriedExtension()
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    delivery = make_delivery(b"{}", {}, message_id="x")
    try:
        acks.extend([delivery], 60)
        assert client.extending.wait(10)
        # When its run fails meanwhile, and its message is nacked
        assert delivery.take()
        acks.modack([delivery.ack_id], 0)
        client.go.set()
        assert acks.flush(timeout=10)
    finally:
        client.go.set()
        acks.close(timeout=5)
    # Then the nack went out after the extension: the message comes back, not re-leased
    assert client.deadlines[-1] == ("ack-x", 0)


def test_health_follows_the_last_request_whichever_thread_sent_it() -> None:
    # Given a nack refused once, then only acks (short jobs: nothing else to send)
    client = _FlakyClient(gexc.PermissionDenied("no"))
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    try:
        acks.modack(["back"], 0)
        assert acks.flush(timeout=5) and acks.healthy is False
        # When acks go through again, Then the worker is healthy again (a thread that has
        # nothing to send keeps no failure of its own for good)
        done = acks.ack("done", confirm=True)
        assert done is not None and done.result(timeout=5) is True
        assert acks.healthy is True
    finally:
        acks.close(timeout=5)


class _Deadlines(_FlakyClient):
    def __init__(self) -> None:
        super().__init__()
        self.deadlines: list[tuple[str, int]] = []

    def modify_ack_deadline(self, request: Any, **options: Any) -> None:
        self.deadlines.extend((a, request.ack_deadline_seconds) for a in request.ack_ids)


def test_a_delay_under_a_second_is_a_deadline_of_one_second_not_a_redelivery_at_once() -> None:
    client = _Deadlines()
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    acks.start()
    try:
        for ack_id, seconds in (("soon", 0.3), ("now", 0.0), ("later", 4.6)):
            acks.modack([ack_id], seconds)
        assert acks.flush(timeout=5)
    finally:
        acks.close(timeout=5)
    assert sorted(client.deadlines) == [("later", 5), ("now", 0), ("soon", 1)]


def test_the_ack_thread_survives_a_bug_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an acknowledger whose batch handling breaks once
    client = _FlakyClient()
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.001)
    real, calls = acks._send, {"n": 0}

    def broken_once(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("bug")
        real(*args)

    monkeypatch.setattr(acks, "_send", broken_once)
    acks.start()
    try:
        # When two acks are sent
        first = acks.ack("a", confirm=True)
        assert first is not None and first.result(timeout=5) is False
        second = acks.ack("b", confirm=True)
        # Then the first is answered (not taken), nothing hangs, and the second is sent
        assert second is not None and second.result(timeout=5) is True
        assert client.acked == ["b"] and acks.flush(timeout=5)
    finally:
        acks.close(timeout=5)


def test_a_retried_transient_failure_reports_only_the_ids_that_failed() -> None:
    # Given an exactly-once subscription that refuses "b" for good and "c" transiently, then
    # fails the retry of "c" with an outage
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo(reason="EXACTLY_ONCE_ACKID_FAILURE")
    info.metadata.update({"b": "PERMANENT_FAILURE_INVALID_ACK_ID", "c": "TRANSIENT_FAILURE_X"})
    client = _FlakyClient(
        gexc.InvalidArgument("partly", details=[info]), *[gexc.ServiceUnavailable("down")] * 4
    )
    acks = Acknowledger(client, "projects/p/subscriptions/s", interval=0.01)
    acks.start()
    try:
        futures = {ack_id: acks.ack(ack_id, confirm=True) for ack_id in "abc"}
        results = {a: f.result(timeout=10) for a, f in futures.items() if f is not None}
    finally:
        acks.close(timeout=5)
    # Then "a", which went through in the first request, is reported as taken
    assert results == {"a": True, "b": False, "c": False}


def test_the_leaser_survives_an_exception_and_keeps_extending() -> None:
    # Given a leaser whose acks raise on its first periodic extension, then recover
    class Breaks(FakeAcks):
        calls = 0

        def extend(self, deliveries: list[Delivery], seconds: float) -> None:
            self.calls += 1
            if self.calls == 2:  # the first is the extension at receipt
                raise RuntimeError("bug")
            super().extend(deliveries, seconds)

    acks = Breaks()
    leaser = Leaser(acks, extension=0.03)  # extends every 10 ms
    leaser.add([make_delivery(b"{}", {})])
    leaser.start()
    try:
        # Then it keeps extending the held message, and is healthy again
        assert wait_for(lambda: acks.calls >= 4, timeout=10, interval=0.005)
        assert wait_for(lambda: leaser.healthy, timeout=10, interval=0.005)
    finally:
        leaser.stop(timeout=5)


@pytest.mark.parametrize(("granted", "at_receipt"), [(0, True), (10, True), (60, False)])
def test_the_leaser_extends_at_receipt_only_a_deadline_its_first_pass_could_miss(
    granted: float, at_receipt: bool
) -> None:
    # Given a leaser extending to 30 s every 10 s, on a subscription whose own ack deadline
    # is ``granted`` seconds (0: not known)
    acks = FakeAcks()
    leaser = Leaser(acks, extension=30, granted=granted)
    # When it is given a message just pulled
    leaser.add([make_delivery(b"{}", {})])
    # Then it extends it at once only if the first periodic pass, up to 10 s away, could
    # come after the message's deadline (under 20 s)
    assert acks.extended == ([("ack-m-1", 30)] if at_receipt else [])


def test_the_leaser_says_it_is_unhealthy_while_extensions_fail() -> None:
    class Fails(FakeAcks):
        def extend(self, deliveries: list[Delivery], seconds: float) -> None:
            if deliveries and self.extended:
                raise RuntimeError("bug")
            super().extend(deliveries, seconds)

    leaser = Leaser(Fails(), extension=0.03)
    leaser.add([make_delivery(b"{}", {})])
    leaser.start()
    try:
        assert wait_for(lambda: not leaser.healthy, timeout=10, interval=0.005)
        assert leaser._thread is not None and leaser._thread.is_alive()
    finally:
        leaser.stop(timeout=5)


def test_the_timer_thread_survives_a_failing_callback() -> None:
    timers = Timers()
    timers.start()
    fired = threading.Event()
    try:

        def broken() -> None:
            raise RuntimeError("bug")

        timers.call_after(0.01, broken)
        timers.call_after(0.02, fired.set)
        assert fired.wait(5)
    finally:
        timers.close(timeout=5)


def test_timers_fire_in_order_and_cancelled_ones_never_fire() -> None:
    timers = Timers()
    timers.start()
    order: list[int] = []
    try:
        # Given 3,000 timers cancelled well before they are due, and three that are not
        cancelled = [timers.call_after(60, lambda: order.append(-1)) for _ in range(3000)]
        for timer in cancelled:
            timer.cancel()
        now = time.monotonic()  # one base: a slow registration cannot reorder their times
        for i in (3, 1, 2):
            timers.call_at(now + 0.05 * i, lambda i=i: order.append(i))  # type: ignore[misc]
        # Then the three fire in order of their times, and the cancelled ones are swept out
        # of the heap by later scheduling instead of being kept until they are due
        assert wait_for(lambda: len(order) == 3, timeout=10, interval=0.005)
        assert order == [1, 2, 3]
        for _ in range(1024):
            timers.call_after(60, lambda: None).cancel()
        assert len(timers._heap) < 1024
    finally:
        timers.close(timeout=5)


def test_the_pull_loop_survives_any_exception_and_reports_it_unhealthy() -> None:
    # Given a pull loop whose client fails with errors of every kind, then answers
    class Pool:
        def wait_for_room(self, timeout: float, *, startable: bool = False) -> int:
            return 1

        def admit(self, deliveries: list[object]) -> None:
            raise AssertionError("nothing was published")

    class Client:
        def __init__(self) -> None:
            self.errors: list[BaseException] = [
                RuntimeError("bug"), gexc.PermissionDenied("no"), ValueError("closed channel")
            ]  # fmt: skip

        def pull(self, **kwargs: Any) -> Any:
            if self.errors:
                raise self.errors.pop(0)

            return SimpleNamespace(received_messages=[])

    client = Client()
    puller = Puller(client, "projects/p/subscriptions/s", Pool(), max_backoff=0.01)  # type: ignore[arg-type]
    puller.start()
    try:
        # Then it keeps pulling, and is healthy again once a pull answers
        assert wait_for(
            lambda: not client.errors and puller.healthy.is_set(), timeout=10, interval=0.005
        )
    finally:
        puller.stop(timeout=5)


def test_the_health_server_survives_a_failing_check() -> None:
    # Given a health server whose liveness check raises once, then answers
    calls = {"n": 0}

    def healthy() -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in a check")
        return True

    server = HealthServer(0, healthy=healthy, ready=lambda: False, host="127.0.0.1").start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        # Then the failing check is a 500, and the server keeps answering
        assert http_get(url + "/healthz")[0] == 500
        assert http_get(url + "/healthz")[0] == 200
        assert http_get(url + "/readyz")[0] == 503
    finally:
        server.stop()


def test_an_exactly_once_ack_that_is_never_answered_is_counted_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an exactly-once subscription whose ack confirmation never comes
    class Silent(FakeAcks):
        def ack(self, ack_id: str, *, confirm: bool = False) -> Future[bool] | None:
            super().ack(ack_id)
            return Future()  # never resolved

    monkeypatch.setattr(settlement, "_ACK_CONFIRM_TIMEOUT", 0.05)
    jobs = Registry()
    jobs.job("t.ok")(lambda ctx, payload: None)
    processor = Processor(
        jobs, Silent(), FakeLeaser(), FakeDeadLetters(), (), ProcessorSettings(exactly_once=True)
    )
    # When a job succeeds, Then its outcome is counted as ack_failed instead of raising
    processor.process(make_delivery(b"{}", {"job": "t.ok"}))
    assert processor.stats == {"ack_failed": 1}
