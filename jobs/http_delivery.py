"""``http.delivery``: send one HTTP request per job, at a declared rate, to allowed hosts only.

Config (``[jobs."http.delivery"]``):

    allowed_hosts = ["api.partner.com", "*.example.com"]   # required: nothing else is reached
    limiters = {"api.partner.com" = "partner"}             # declared limiter per host
    allow_loopback = false      # 127.0.0.0/8, ::1 (for tests and sidecars)
    allow_private = false       # 10/8, 172.16/12, 192.168/16, fc00::/7
    timeout = 10                # seconds, connect and read

Link-local addresses (169.254.0.0/16, which holds the metadata server, and fe80::/10) are always
refused, so a message can never make the worker fetch its own credentials. The host is
resolved and every address checked before the request, and again when a connection is made:
the connection goes to an address from that check, never to a second lookup's answer (a name
whose DNS changes between the two, rebinding, would otherwise reach what was refused).
Redirects are not followed (a redirect could lead anywhere). Responses: 2xx done; 429 and 503
throttle the limiter and retry; other 5xx retry; 4xx and 3xx are permanent. Header values are
never logged.
"""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import socket
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

from workerpool import JobContext, PermanentError, RetryableError, job
from workerpool.errors import RateLimitedError

_METADATA_HOSTS = {"metadata.google.internal", "metadata", "metadata.goog"}
_FORBIDDEN_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass(frozen=True)
class HttpConfig:
    """``[jobs."http.delivery"]``, checked when the worker starts (``@job(config=...)``)."""

    allowed_hosts: list[str] = field(default_factory=list)
    limiters: dict[str, str] = field(default_factory=dict)
    allow_loopback: bool = False
    allow_private: bool = False
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")


@dataclass
class HttpRequest:
    url: str
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    limiter: str | None = None


def _refuse(message: str) -> PermanentError:
    return PermanentError(message, error_type="http.refused")


def _check_destination(url: str, config: HttpConfig) -> str:
    """Return the host if ``url`` may be fetched under ``config``; raise PermanentError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise _refuse(f"url scheme {parts.scheme!r} is not http or https")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host or parts.username or parts.password:
        raise _refuse("url needs a host and no credentials")
    if not any(fnmatch.fnmatchcase(host, pattern.lower()) for pattern in config.allowed_hosts):
        raise _refuse(f"host {host!r} is not in allowed_hosts")
    if host in _METADATA_HOSTS:
        raise _refuse(f"host {host!r} is the metadata server")
    try:
        infos = socket.getaddrinfo(host, parts.port or 443, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise RetryableError(f"cannot resolve {host!r}: {exc}") from exc
    for info in infos:
        _check_address(ipaddress.ip_address(info[4][0]), host, config)
    return host


def _check_address(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str, config: HttpConfig
) -> None:
    if address.is_link_local or address.is_multicast or address.is_unspecified:
        raise _refuse(f"host {host!r} resolves to {address}, which is never allowed")
    if address.is_loopback and not config.allow_loopback:
        raise _refuse(f"host {host!r} resolves to loopback {address}")
    if address.is_private and not address.is_loopback and not config.allow_private:
        raise _refuse(f"host {host!r} resolves to private address {address}")


def _retry_after(response: requests.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def _classify(response: requests.Response, limiter: str | None) -> None:
    status = response.status_code
    if 200 <= status < 300:
        return
    if status in (429, 503):
        raise RateLimitedError(
            f"HTTP {status}", limiter=limiter, retry_after=_retry_after(response)
        )
    if status >= 500:
        raise RetryableError(f"HTTP {status}")
    raise PermanentError(f"HTTP {status}: {response.reason}", error_type=f"http.{status}")


class _Pinned(HTTPConnection):
    """A connection to an address its own lookup found allowed (``policy``), so what is
    checked is what is reached; TLS still verifies the certificate against the name."""

    policy: HttpConfig

    def _new_conn(self) -> socket.socket:
        name = self._dns_host
        try:
            infos = socket.getaddrinfo(name, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise NameResolutionError(self.host, self, exc) from exc  # type: ignore[arg-type]
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        for address in addresses:
            _check_address(address, self.host, self.policy)
        failure: Exception | None = None
        for address in dict.fromkeys(addresses):
            self._dns_host = str(address)  # a literal: urllib3 connects without a lookup
            try:
                return super()._new_conn()
            except (NewConnectionError, ConnectTimeoutError) as exc:
                failure = exc
            finally:
                self._dns_host = name
        assert failure is not None, "getaddrinfo answers at least one address or raises"
        raise failure


@functools.cache
def _pinned_pools(allow_loopback: bool, allow_private: bool) -> dict[str, type]:
    """urllib3's pool classes by scheme, their connections pinned under this policy."""
    policy = {"policy": HttpConfig(allow_loopback=allow_loopback, allow_private=allow_private)}
    http = type("PinnedHTTPConnection", (_Pinned,), policy)
    https = type("PinnedHTTPSConnection", (_Pinned, HTTPSConnection), policy)
    return {
        "http": type("PinnedHTTPPool", (HTTPConnectionPool,), {"ConnectionCls": http}),
        "https": type("PinnedHTTPSPool", (HTTPSConnectionPool,), {"ConnectionCls": https}),
    }


class _PinnedAdapter(HTTPAdapter):
    def __init__(self, config: HttpConfig) -> None:
        self._pools = _pinned_pools(config.allow_loopback, config.allow_private)
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = self._pools


_local = threading.local()


def _session(config: HttpConfig) -> requests.Session:
    """One keep-alive session per slot thread (and address policy): no TCP handshake per
    request, so requests leave when the limiter says, not a connection set-up later
    (sessions are not shared across threads, which requests does not promise to be safe)."""
    sessions: dict[tuple[bool, bool], requests.Session] | None = getattr(_local, "sessions", None)
    if sessions is None:
        sessions = _local.sessions = {}
    policy = (config.allow_loopback, config.allow_private)
    session = sessions.get(policy)
    if session is None:
        session = sessions[policy] = requests.Session()
        session.trust_env = False  # no proxy or netrc from the environment
        adapter = _PinnedAdapter(config)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
    return session


@job("http.delivery", timeout=120, max_attempts=8, payload=HttpRequest, config=HttpConfig)
def deliver(ctx: JobContext, request: HttpRequest) -> None:
    config: HttpConfig = ctx.config
    host = _check_destination(request.url, config)
    bad_headers = sorted(h for h in request.headers if h.lower() in _FORBIDDEN_HEADERS)
    if bad_headers:
        raise PermanentError(f"header {bad_headers[0]} may not be set", error_type="http.refused")
    limiter = request.limiter or config.limiters.get(host)
    if limiter:
        ctx.acquire(limiter)
    timeout = config.timeout
    try:
        response = _session(config).request(
            request.method,
            request.url,
            json=request.body,
            headers=request.headers,
            timeout=(timeout, timeout),
            allow_redirects=False,
        )
    except requests.RequestException as exc:
        raise RetryableError(f"{type(exc).__name__} talking to {host}") from exc
    _classify(response, limiter)
