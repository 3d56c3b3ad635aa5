"""http.delivery's guard rails, without any network: what it refuses and how it classifies."""

from __future__ import annotations

import dataclasses

import pytest
import requests
from workerpool_jobs.http_delivery import HttpConfig, _check_destination, _classify

from workerpool import PermanentError, RetryableError
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
