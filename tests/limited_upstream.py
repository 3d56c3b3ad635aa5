"""An upstream API that allows 20 requests/s globally (token bucket, capacity 2) and answers
429 without Retry-After beyond that. It runs as a process of its own (``python -m
tests.limited_upstream``, printing its port), so a pause in the test process cannot bunch
arrivals; ``GET /stats`` returns the accepted request times and the refused count.

A request is counted when it reached this host (the kernel's receive time), not when this
process gets round to reading it: a real upstream runs on a machine of its own, while this
one shares a loaded test machine, where its own starved threads would bunch arrivals that
came in apart."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SO_TIMESTAMPNS = 35  # Linux's; Python's socket module does not name it


class LimitedUpstream(ThreadingHTTPServer):
    """Allows 20 requests/s globally (token bucket, capacity 2); 429 without Retry-After."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.tokens, self.last = 2.0, time.time()
        self.ok: list[float] = []
        self.refused = 0

    def server_bind(self) -> None:
        # Every packet gets the kernel's receive time; accepted sockets inherit the option.
        self.socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        super().server_bind()

    def admit(self, arrived: float) -> bool:
        with self.lock:
            # Threads may take requests out of arrival order: refill only forwards.
            self.tokens = min(2.0, self.tokens + max(0.0, arrived - self.last) * 20.0)
            self.last = max(self.last, arrived)
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                self.ok.append(arrived)
                return True
            self.refused += 1
            return False


class _Handler(BaseHTTPRequestHandler):
    server: LimitedUpstream
    protocol_version = "HTTP/1.1"  # keep-alive, as real APIs offer

    def handle_one_request(self) -> None:
        # Peek at the next request's first bytes (waiting for them, as reading it would) for
        # the time the kernel received them (none if the client closed the connection).
        _, stamps, _, _ = self.connection.recvmsg(1, socket.CMSG_SPACE(16), socket.MSG_PEEK)
        self.arrived = time.time()
        for _, _, data in stamps:
            seconds, nanoseconds = struct.unpack("qq", data)
            self.arrived = seconds + nanoseconds / 1e9
        super().handle_one_request()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200 if self.server.admit(self.arrived) else 429)
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
