"""The fault-injection proxy: each mode against a local echo server, then a worker through it."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.faults import FaultProxy, Mode
from tests.support import wait_for
from workerpool import JobContext
from workerpool.registry import Registry
from workerpool.testing.pubsub import PubSubResources


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass  # reset by the proxy: that is what the tests do


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


@pytest.fixture
def echo() -> Iterator[str]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(2)


@pytest.fixture
def proxy(echo: str) -> Iterator[FaultProxy]:
    with FaultProxy(echo) as p:
        yield p


def connect(proxy: FaultProxy, timeout: float = 2.0) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=timeout)


def receive(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def closed_by_proxy(sock: socket.socket) -> bool:
    """Reading sees the connection end (EOF or reset) within a second, past any echo."""
    sock.settimeout(1.0)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def reset_at_once(proxy: FaultProxy) -> bool:
    """A new connection ends at once: the reset may even beat connect() itself."""
    try:
        sock = connect(proxy)
    except ConnectionError:
        return True
    with sock:
        return closed_by_proxy(sock)


def roundtrip(proxy: FaultProxy, payload: bytes) -> bytes:
    """Send ``payload``, half-close, read the echo to EOF (which needs the half-close passed)."""
    with connect(proxy, timeout=5) as sock:

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        echoed = receive(sock, len(payload) + 1)
        sender.join()
        return echoed


def test_pass_forwards_many_concurrent_connections_both_ways(proxy: FaultProxy) -> None:
    payloads = [os.urandom(256 * 1024) for _ in range(40)]
    with ThreadPoolExecutor(max_workers=40) as pool:
        echoed = list(pool.map(lambda p: roundtrip(proxy, p), payloads))
    assert echoed == payloads
    total = sum(map(len, payloads))
    assert wait_for(lambda: proxy.stats.open == 0, timeout=2), proxy.stats
    stats = proxy.stats
    assert (stats.accepted, stats.bytes_up, stats.bytes_down) == (40, total, total)
    assert (stats.cut, stats.dropped, stats.upstream_failed) == (0, 0, 0)


def test_stall_holds_everything_until_forward(proxy: FaultProxy) -> None:
    old = connect(proxy)
    old.sendall(b"before")
    assert receive(old, 6) == b"before"
    proxy.stall()
    assert proxy.mode is Mode.STALL
    before = proxy.stats
    old.sendall(b"during")
    new = connect(proxy)  # accepted, but stalled too
    new.sendall(b"new")
    old.settimeout(0.3)
    new.settimeout(0.3)
    with pytest.raises(TimeoutError):
        old.recv(10)
    with pytest.raises(TimeoutError):
        new.recv(10)
    stalled = proxy.stats
    assert (stalled.bytes_up, stalled.bytes_down) == (before.bytes_up, before.bytes_down)
    assert stalled.open == 2 and stalled.cut == 0
    proxy.forward()
    old.settimeout(2)
    new.settimeout(2)
    assert receive(old, 6) == b"during"
    assert receive(new, 3) == b"new"
    old.close()
    new.close()


def test_drop_resets_open_and_new_connections_until_forward(proxy: FaultProxy) -> None:
    old = connect(proxy)
    old.sendall(b"x")
    assert receive(old, 1) == b"x"
    proxy.drop()
    assert closed_by_proxy(old)
    for _ in range(3):
        assert reset_at_once(proxy)
    stats = proxy.stats
    assert (stats.cut, stats.dropped, stats.open) == (1, 3, 0)
    proxy.forward()
    assert roundtrip(proxy, b"back") == b"back"
    old.close()


def test_cut_resets_open_connections_then_passes_new_ones(proxy: FaultProxy) -> None:
    socks = [connect(proxy) for _ in range(5)]
    for sock in socks:
        sock.sendall(b"hi")
        assert receive(sock, 2) == b"hi"
    proxy.cut()
    assert proxy.mode is Mode.PASS
    assert all(closed_by_proxy(sock) for sock in socks)
    assert (proxy.stats.cut, proxy.stats.open) == (5, 0)
    assert roundtrip(proxy, b"again") == b"again"
    for sock in socks:
        sock.close()


def test_unreachable_target_resets_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        target = unused.getsockname()  # bound, not listening: connections are refused
        with FaultProxy(target) as proxy:
            assert reset_at_once(proxy)
            assert wait_for(lambda: proxy.stats.upstream_failed == 1, timeout=1)


def test_close_joins_within_a_second_with_connections_open_and_stalled(echo: str) -> None:
    proxy = FaultProxy(echo)
    socks = [connect(proxy) for _ in range(20)]
    for sock in socks:
        sock.sendall(b"y")
    proxy.stall()
    started = time.monotonic()
    proxy.close()
    assert time.monotonic() - started < 1.0
    assert not proxy._thread.is_alive()
    assert all(closed_by_proxy(sock) for sock in socks)
    proxy.close()  # idempotent
    with pytest.raises(RuntimeError):
        proxy.cut()
    for sock in socks:
        sock.close()


def test_a_worker_survives_a_stall_then_a_cut_and_runs_every_job_once(
    pubsub_resources: PubSubResources, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker pulling through the proxy, and 40 jobs of 0.1 s
    pubsub_resources.provision()
    jobs, runs, lock = Registry(), Counter[str](), threading.Lock()

    @jobs.job("t.work")
    def work(ctx: JobContext, payload: dict[str, Any]) -> None:
        time.sleep(0.1)
        with lock:
            runs[ctx.job_id] += 1

    expected = {f"job-{i}": 1 for i in range(40)}
    with FaultProxy(pubsub_resources.host) as proxy:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", proxy.address)
        with pubsub_resources.worker(jobs, max_outstanding=4) as worker:
            pubsub_resources.publish_many("t.work", [(job_id, {}) for job_id in expected])
            assert wait_for(lambda: sum(runs.values()) >= 8, timeout=30), runs
            # When the proxy stalls for 3 s, then cuts every connection
            proxy.stall()
            stalled, ran_before = proxy.stats, sum(runs.values())
            time.sleep(3)
            during, ran_during = proxy.stats, sum(runs.values()) - ran_before
            proxy.cut()
            cut_at = time.monotonic()
            # Then the worker keeps running and every job completes exactly once
            assert wait_for(lambda: worker.processor.stats["done"] >= 40, timeout=60), (
                dict(worker.processor.stats),
                proxy.stats,
            )
            recovered = time.monotonic() - cut_at
            assert wait_for(worker.healthy, timeout=10)
            time.sleep(1)  # room for a second run to show up
            stats = dict(worker.processor.stats)
        after = proxy.stats
    print(
        f"{ran_before} jobs ran before the stall, {ran_during} during it; the other "
        f"{40 - ran_before - ran_during} within {recovered:.1f}s of the cut; worker {stats}; "
        f"proxy {after}"
    )
    assert (during.bytes_up, during.bytes_down) == (stalled.bytes_up, stalled.bytes_down)
    assert after.cut >= 1 and after.accepted > stalled.accepted  # it reconnected
    assert after.bytes_down > during.bytes_down
    assert dict(runs) == expected
    assert stats.get("dead_lettered", 0) == 0 and stats["done"] == 40
