"""An upstream API that allows 20 requests/s globally (token bucket, capacity 2) and answers
429 without Retry-After beyond that. It runs as a process of its own (``python -m
tests.limited_upstream``, printing its port), so a pause in the test process cannot bunch
arrivals; ``GET /stats`` returns the accepted request times and the refused count."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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

    def do_GET(self) -> None:
        with self.server.lock:
            body = json.dumps({"ok": self.server.ok, "refused": self.server.refused}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


if __name__ == "__main__":
    server = LimitedUpstream()
    print(server.server_address[1], flush=True)
    server.serve_forever()
