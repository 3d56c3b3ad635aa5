"""``--metrics-port``: /metrics (Prometheus text), /healthz and /readyz on one small server.

Nothing listens unless asked (Cloud Run worker pools need no port). ``/healthz`` answers 200
while the process is alive and its pull streams are healthy, else 503; ``/readyz`` answers 200
once the pools have started and until they start draining, else 503. A stdlib server on a
daemon thread: no framework.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workerpool import constants as c
from workerpool.errors import ConfigError
from workerpool.telemetry.prometheus import CONTENT_TYPE, PrometheusReader

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.05

Check = Callable[[], bool]


class HealthServer:
    def __init__(
        self,
        port: int,
        *,
        healthy: Check,
        ready: Check,
        metrics: PrometheusReader | None = None,
        host: str = "0.0.0.0",
    ) -> None:
        self._address = (host, port)
        self._healthy = healthy
        self._ready = ready
        self._metrics = metrics
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port listened on (useful with port 0: any free port)."""
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        try:
            self._server = ThreadingHTTPServer(self._address, self._handler_class())
        except OSError as exc:
            raise ConfigError(
                f"metrics_port: cannot listen on port {self._address[1]}: {exc.strerror}"
            ) from None
        self._server.daemon_threads = True
        # shutdown() waits until serve_forever notices; its default 0.5 s poll added about
        # half a second to every drain's exit (measured in bench/, scenario 3).
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_SECONDS},
            name="workerpool-health",
            daemon=True,
        )
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on port %d", self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def answer(self, path: str) -> tuple[int, str, str]:
        """``(status, content type, body)`` for a GET of ``path``."""
        path = path.split("?", 1)[0]
        if path == c.PATH_HEALTHZ:
            return _check(self._healthy, "ok\n", "pull stream unhealthy\n")
        if path == c.PATH_READYZ:
            return _check(self._ready, "ready\n", "not ready (draining or not started)\n")
        if path == c.PATH_METRICS and self._metrics is not None:
            return 200, CONTENT_TYPE, self._metrics.render()
        return 404, "text/plain; charset=utf-8", "not found\n"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    status, content_type, body = server.answer(self.path)
                except Exception:  # a failed check or render is the server's error, not a crash
                    log.exception("%s failed", self.path)
                    status, content_type, body = 500, "text/plain; charset=utf-8", "error\n"
                payload = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        return Handler


def _check(check: Check, good: str, bad: str) -> tuple[int, str, str]:
    ok = check()
    return (200 if ok else 503), "text/plain; charset=utf-8", good if ok else bad
