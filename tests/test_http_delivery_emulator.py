"""Rate limits are not concurrency limits: 50 slots against an upstream allowing 20 req/s."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import jobs.http_delivery  # noqa: F401  (registers http.delivery)
from tests.support import PubSubEnv, wait_for
from workerpool.ratelimit import RateSpec
from workerpool.registry import registry


class LimitedUpstream(ThreadingHTTPServer):
    """Allows 20 requests/s globally (token bucket, capacity 2); 429 without Retry-After."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.tokens, self.last = 2.0, time.monotonic()
        self.ok: list[float] = []
        self.refused = 0

    def admit(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(2.0, self.tokens + (now - self.last) * 20.0)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                self.ok.append(now)
                return True
            self.refused += 1
            return False


class _Handler(BaseHTTPRequestHandler):
    server: LimitedUpstream
    protocol_version = "HTTP/1.1"  # keep-alive, as real APIs offer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200 if self.server.admit() else 429)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[LimitedUpstream]:
    server = LimitedUpstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _deliver_300(pubsub: PubSubEnv, upstream: LimitedUpstream, **settings: Any) -> dict[str, int]:
    pubsub.provision(retry_policy=False)
    url = f"http://127.0.0.1:{upstream.server_address[1]}/menus"
    pubsub.publish_many("http.delivery", [(f"menu-{i}", {"url": url}) for i in range(300)])
    config = {"allowed_hosts": ["127.0.0.1"], "allow_loopback": True, "timeout": 5}
    config.update(settings.pop("config", {}))
    with pubsub.worker(
        registry,
        max_outstanding=50,
        min_backoff=1.0,
        max_backoff=2.0,
        job_config={"http.delivery": config},
        **settings,
    ) as worker:
        stats = worker.processor.stats
        assert wait_for(lambda: stats["done"] + stats["dead_lettered"] >= 300, timeout=120)
        return dict(stats)


def test_fifty_slots_without_a_limiter_hit_the_upstream_limit(
    pubsub: PubSubEnv, upstream: LimitedUpstream
) -> None:
    # Given 300 deliveries and 50 slots, no rate limit declared
    stats = _deliver_300(pubsub, upstream)
    # Then the upstream refused many requests; retried jobs got through or ran out of attempts
    print(f"no limiter: {upstream.refused} responses 429, stats {stats}")
    assert upstream.refused > 100
    assert len(upstream.ok) == stats["done"] and stats["done"] + stats["dead_lettered"] == 300


def test_declared_rate_gets_zero_429s_and_takes_rate_time(
    pubsub: PubSubEnv, upstream: LimitedUpstream
) -> None:
    # Given the same 300 deliveries and 50 slots, with partner = 20/s (burst 1) declared
    stats = _deliver_300(
        pubsub,
        upstream,
        rate_limits={"partner": RateSpec(20.0, 1)},
        config={"limiters": {"127.0.0.1": "partner"}},
    )
    # Then no 429 at all, and the run takes 300 / 20 s within 10%
    span = upstream.ok[-1] - upstream.ok[0]
    print(f"20/s declared: {upstream.refused} responses 429, 300 requests in {span:.2f}s")
    assert upstream.refused == 0 and stats == {"done": 300}
    assert abs(span - 299 / 20) <= 0.1 * 15
