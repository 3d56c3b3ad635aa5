"""A JSON API on a free local port that answers from canned bodies and records every request,
for testing clients of APIs that cannot be reached here (Cloud Run Admin, Kubernetes) with
their real client libraries."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any  # the parsed JSON body, None without one


# The answer to a request: HTTP status and JSON body (bytes: sent as they are, as text/html).
Answer = tuple[int, Any]


class CannedApi(ThreadingHTTPServer):
    """``answer`` is called for each request (in order; it may keep state, or sleep to play a
    silent API); ``requests`` lists them as received."""

    def __init__(self, answer: Callable[[Request], Answer]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.requests: list[Request] = []
        # A short poll, so that leaving the context (shutdown) takes milliseconds.
        self._thread = threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up on a slow answer closed its socket: not the test's news

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> CannedApi:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: CannedApi
    protocol_version = "HTTP/1.1"  # keep-alive, as the real APIs offer

    def _serve(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = Request(
            self.command,
            url.path,
            dict(parse_qsl(url.query)),
            self.headers.get("Content-Type", ""),
            json.loads(raw) if raw else None,
        )
        self.server.requests.append(request)
        status, body = self.server.answer(request)
        raw_answer = isinstance(body, bytes)  # a page that is not the API's JSON
        data = body if raw_answer else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html" if raw_answer else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass
