"""A TCP proxy that stalls, drops or cuts connections on command (stdlib only).

    with FaultProxy(pubsub_emulator) as proxy:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", proxy.address)  # before the worker starts
        proxy.stall()    # connections stay open; nothing moves either way (a black hole)
        proxy.forward()  # bytes flow again, what was buffered first
        proxy.cut()      # every open connection is reset now; new ones pass
        proxy.drop()     # every connection, open or new, is reset at once until forward()
        proxy.stats      # ProxyStats: connections and bytes, for assertions

It moves bytes and nothing else, so gRPC over HTTP/2 passes untouched. One thread runs a
selector loop over every socket. A mode change is applied by that thread before the call
returns: after ``stall()`` nothing more is forwarded, after ``cut()`` no earlier connection
is open. Resets are abortive closes (RST), which gRPC reports as UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, fields
from types import TracebackType

_CHUNK = 256 * 1024
_BUFFER_LIMIT = 4 * 1024 * 1024  # per connection and direction; reading pauses beyond it
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE
_COMMAND_TIMEOUT = 2.0


class Mode(enum.Enum):
    PASS = "pass"
    STALL = "stall"
    DROP = "drop"


@dataclass(frozen=True)
class ProxyStats:
    accepted: int = 0  # connections accepted from clients
    open: int = 0  # proxied connections open now
    dropped: int = 0  # accepted while dropping, and reset at once
    cut: int = 0  # open connections reset by cut() or drop()
    upstream_failed: int = 0  # connections whose target could not be reached
    bytes_up: int = 0  # forwarded client -> target
    bytes_down: int = 0  # forwarded target -> client


class _Pipe:
    """One proxied connection: the client's socket, ours to the target, a buffer each way."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.connecting = True
        self.to_upstream = bytearray()
        self.to_client = bytearray()
        self.client_eof = self.upstream_eof = False
        self.upstream_shut = self.client_shut = False
        self.closed = False


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _send(sock: socket.socket, buffer: bytearray) -> int:
    try:
        sent = sock.send(buffer)
    except (BlockingIOError, InterruptedError):
        return 0
    del buffer[:sent]
    return sent


class FaultProxy:
    """Listens on a free loopback port (``address``) and forwards to ``target`` ("host:port"
    or a (host, port) pair). Starts at once; ``close()`` (or leaving ``with``) stops it."""

    def __init__(
        self, target: str | tuple[str, int], *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        if isinstance(target, str):
            name, _, port_text = target.rpartition(":")
            target = (name.strip("[]"), int(port_text))
        self.target = target
        family, _, _, _, address = socket.getaddrinfo(*target, type=socket.SOCK_STREAM)[0]
        self._family, self._target_addr = family, address
        self._listener = socket.create_server((host, port), backlog=512)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, _R, "listener")
        self._selector.register(self._wake_r, _R, "wake")
        self._pipes: set[_Pipe] = set()
        self._lock = threading.Lock()
        self._commands: list[tuple[Mode, bool, threading.Event]] = []
        self._mode = Mode.PASS
        self._counts = {f.name: 0 for f in fields(ProxyStats)}
        self._closing = False
        self._thread = threading.Thread(
            target=self._run, name=f"fault-proxy-{self.port}", daemon=True
        )
        self._thread.start()

    # --- the test's side -------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port`` to give the client, e.g. as ``PUBSUB_EMULATOR_HOST``."""
        return f"{self.host}:{self.port}"

    @property
    def mode(self) -> Mode:
        with self._lock:
            return self._mode

    @property
    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(**self._counts)

    def forward(self) -> None:
        """Pass: forward both ways (the default)."""
        self.set_mode(Mode.PASS)

    def stall(self) -> None:
        """Keep every connection open, accept new ones, forward nothing until switched back."""
        self.set_mode(Mode.STALL)

    def drop(self) -> None:
        """Reset every open connection, and each new one as soon as it is accepted."""
        self.set_mode(Mode.DROP)

    def cut(self) -> None:
        """Reset every open connection now; then pass new ones."""
        self._command(Mode.PASS, reset=True)

    def set_mode(self, mode: Mode | str) -> None:
        self._command(Mode(mode), reset=False)

    def close(self, timeout: float = 1.0) -> None:
        """Reset every connection, stop listening and join the thread (idempotent)."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"fault proxy thread did not stop within {timeout}s")
        self._wake_w.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _command(self, mode: Mode, *, reset: bool) -> None:
        done = threading.Event()
        with self._lock:
            if self._closing:
                raise RuntimeError("fault proxy is closed")
            self._commands.append((mode, reset, done))
        self._wake()
        if not done.wait(_COMMAND_TIMEOUT):
            raise TimeoutError(f"fault proxy did not switch to {mode.value}")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already awake) or closed
            self._wake_w.send(b"x")

    def _count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self._counts[name] += delta

    # --- the loop's side (only its thread touches sockets and pipes) -------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                for key, events in self._selector.select(timeout=1.0):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._apply_commands()
                    else:
                        pipe, side = key.data
                        self._service(pipe, side, events)
        finally:
            for pipe in list(self._pipes):
                self._close_pipe(pipe, reset=True)
            with self._lock:
                pending, self._commands = self._commands, []
            for _, _, done in pending:
                done.set()
            self._selector.close()
            self._listener.close()
            self._wake_r.close()

    def _apply_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            commands, self._commands = self._commands, []
        for mode, reset, done in commands:
            with self._lock:
                self._mode = mode
            if reset or mode is Mode.DROP:
                for pipe in list(self._pipes):
                    self._count("cut")
                    self._close_pipe(pipe, reset=True)
            for pipe in list(self._pipes):
                self._update(pipe)
            done.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: the kernel keeps the rest queued
                return
            self._count("accepted")
            if self._mode is Mode.DROP:
                self._count("dropped")  # counted first: the client may look at once
                _reset(client)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            upstream.setblocking(False)
            error = upstream.connect_ex(self._target_addr)
            if error not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._count("upstream_failed")  # counted before the client sees the reset
                _reset(upstream)
                _reset(client)
                continue
            pipe = _Pipe(client, upstream)
            self._pipes.add(pipe)
            self._count("open")
            self._update(pipe)

    def _service(self, pipe: _Pipe, side: str, events: int) -> None:
        if pipe.closed or self._mode is not Mode.PASS:
            return  # closed or stalled earlier in this round of events
        try:
            if side == "upstream" and pipe.connecting and events & _W:
                if pipe.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self._count("upstream_failed")
                    self._close_pipe(pipe, reset=True)
                    return
                pipe.connecting = False
                pipe.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if events & _R:
                self._read(pipe, side)
            self._flush(pipe)
            self._finish(pipe)
        except OSError:  # reset by a peer, broken pipe: pass the reset on
            self._close_pipe(pipe, reset=True)
            return
        self._update(pipe)

    def _read(self, pipe: _Pipe, side: str) -> None:
        sock = pipe.client if side == "client" else pipe.upstream
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if side == "client":
            pipe.to_upstream += data
            pipe.client_eof = not data
        else:
            pipe.to_client += data
            pipe.upstream_eof = not data

    def _flush(self, pipe: _Pipe) -> None:
        if pipe.to_upstream and not pipe.connecting:
            self._count("bytes_up", _send(pipe.upstream, pipe.to_upstream))
        if pipe.to_client:
            self._count("bytes_down", _send(pipe.client, pipe.to_client))

    def _finish(self, pipe: _Pipe) -> None:
        """Pass a half-close on once its direction is flushed; close when both are done."""
        if pipe.client_eof and not (pipe.to_upstream or pipe.connecting or pipe.upstream_shut):
            pipe.upstream.shutdown(socket.SHUT_WR)
            pipe.upstream_shut = True
        if pipe.upstream_eof and not pipe.to_client and not pipe.client_shut:
            pipe.client.shutdown(socket.SHUT_WR)
            pipe.client_shut = True
        if pipe.upstream_shut and pipe.client_shut:
            self._close_pipe(pipe, reset=False)

    def _update(self, pipe: _Pipe) -> None:
        """Register the events each socket of ``pipe`` waits for now (none while stalled)."""
        if pipe.closed:
            return
        client_events = upstream_events = 0
        if self._mode is Mode.PASS:
            if not pipe.client_eof and len(pipe.to_upstream) < _BUFFER_LIMIT:
                client_events |= _R
            if pipe.to_client:
                client_events |= _W
            if pipe.connecting or pipe.to_upstream:
                upstream_events |= _W
            if not (pipe.connecting or pipe.upstream_eof) and len(pipe.to_client) < _BUFFER_LIMIT:
                upstream_events |= _R
        self._want(pipe.client, client_events, (pipe, "client"))
        self._want(pipe.upstream, upstream_events, (pipe, "upstream"))

    def _want(self, sock: socket.socket, events: int, data: tuple[_Pipe, str]) -> None:
        try:
            key: selectors.SelectorKey | None = self._selector.get_key(sock)
        except KeyError:
            key = None
        if not events:
            if key is not None:
                self._selector.unregister(sock)
        elif key is None:
            self._selector.register(sock, events, data)
        elif key.events != events:
            self._selector.modify(sock, events, data)

    def _close_pipe(self, pipe: _Pipe, *, reset: bool) -> None:
        if pipe.closed:
            return
        pipe.closed = True
        self._pipes.discard(pipe)
        self._count("open", -1)  # before the peers can see the close
        for sock in (pipe.client, pipe.upstream):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            if reset:
                _reset(sock)
            else:
                sock.close()
