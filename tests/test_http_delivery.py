"""http.delivery's guard rails, without any network beyond this host: what it refuses and how
it classifies."""

from __future__ import annotations

import dataclasses
import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import requests
from workerpool_jobs.http_delivery import (
    HttpConfig,
    HttpRequest,
    _check_destination,
    _classify,
    deliver,
)

from workerpool import JobContext, PermanentError, RetryableError
from workerpool.context import Flag
from workerpool.errors import RateLimitedError

CONFIG = HttpConfig(allowed_hosts=["127.0.0.1", "localhost", "169.254.169.254", "*.internal"])


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://127.0.0.1/x", "scheme"),
        ("file:///etc/passwd", "scheme"),
        ("http://user:pw@127.0.0.1/", "credentials"),
        ("http://example.com/", "not in allowed_hosts"),
        ("http://metadata.google.internal/computeMetadata/v1/", "metadata server"),
        ("http://169.254.169.254/computeMetadata/v1/", "never allowed"),
        ("http://127.0.0.1:8080/", "loopback"),
        ("http://localhost/", "loopback"),
    ],
)
def test_refused_destinations(url: str, why: str) -> None:
    with pytest.raises(PermanentError, match=why) as refused:
        _check_destination(url, CONFIG)
    assert refused.value.error_type == "http.refused"


def test_loopback_only_when_explicitly_allowed_and_link_local_never() -> None:
    allowing = dataclasses.replace(CONFIG, allow_loopback=True, allow_private=True)
    assert _check_destination("http://127.0.0.1:9/x", allowing) == "127.0.0.1"
    with pytest.raises(PermanentError, match="never allowed"):
        _check_destination("http://169.254.169.254/", allowing)


def _response(status: int, **headers: str) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response.reason = "reason"
    response.headers.update(headers)
    return response


def test_status_codes_are_classified() -> None:
    _classify(_response(204), None)
    with pytest.raises(RateLimitedError) as throttled:
        _classify(_response(429, **{"Retry-After": "7"}), "partner")
    assert (throttled.value.limiter, throttled.value.retry_after) == ("partner", 7.0)
    with pytest.raises(RateLimitedError):
        _classify(_response(503), None)
    with pytest.raises(RetryableError):
        _classify(_response(502), None)
    with pytest.raises(PermanentError) as client_error:
        _classify(_response(404), None)
    assert client_error.value.error_type == "http.404"
    with pytest.raises(PermanentError):
        _classify(_response(302), None)


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A local server that notes every request it gets."""

    protocol_version = "HTTP/1.1"  # keeps the connection alive
    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.path)
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def local_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen.clear()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _rebinding(monkeypatch: pytest.MonkeyPatch, name: str, answers: list[str]) -> list[str]:
    """Make ``name`` resolve to each of ``answers`` in turn (the last one from then on), as a
    DNS server that changes its answer between lookups; returns the answers given."""
    real = socket.getaddrinfo
    given: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != name:
            return real(host, port, *args, **kwargs)
        given.append(answers[min(len(given), len(answers) - 1)])
        return real(given[-1], port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return given


def _deliver(url: str, config: HttpConfig) -> None:
    ctx = JobContext("http.delivery", "j-1", "m-1", 1, None, Flag(), config=config)
    deliver(ctx, HttpRequest(url=url, body={"a": 1}))


def test_a_name_that_answers_a_public_address_then_loopback_never_reaches_loopback(
    monkeypatch: pytest.MonkeyPatch, local_server: int
) -> None:
    # Given an allowed name whose DNS answers a public address to the first lookup and this
    # host's loopback, where a server listens, to the next (DNS rebinding)
    config = HttpConfig(allowed_hosts=["rebind.test"], timeout=2)
    given = _rebinding(monkeypatch, "rebind.test", ["93.184.216.34", "127.0.0.1"])
    # When a job asks for it, Then the request is refused for the loopback answer, and the
    # server never hears of it
    with pytest.raises(PermanentError, match="loopback") as refused:
        _deliver(f"http://rebind.test:{local_server}/steal", config)
    assert refused.value.error_type == "http.refused"
    assert given == ["93.184.216.34", "127.0.0.1"] and _Recorder.seen == []


def test_a_connection_goes_to_the_address_its_own_lookup_checked(
    monkeypatch: pytest.MonkeyPatch, local_server: int
) -> None:
    # Given a name allowed on loopback whose answer is this host's loopback
    config = HttpConfig(allowed_hosts=["svc.test"], allow_loopback=True, timeout=2)
    given = _rebinding(monkeypatch, "svc.test", ["127.0.0.1"])
    # When two jobs ask for it, Then both are delivered, over one kept-alive connection: the
    # name is looked up for each request's check and once for the connection
    _deliver(f"http://svc.test:{local_server}/one", config)
    _deliver(f"http://svc.test:{local_server}/two", config)
    assert _Recorder.seen == ["/one", "/two"]
    assert len(given) == 3
