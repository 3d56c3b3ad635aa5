"""Start and stop the Google Cloud emulators installed with the gcloud CLI.

Used by the test fixtures and by ``workerpool demo``. ``gcloud`` is only a wrapper around a
Java server, so the emulator runs in its own process group and the whole group is killed on
stop; otherwise the Java process outlives the wrapper.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

_COMMANDS = {
    "pubsub": ["gcloud", "beta", "emulators", "pubsub", "start"],
    "firestore": ["gcloud", "emulators", "firestore", "start"],
}
_ENV_VARS = {"pubsub": "PUBSUB_EMULATOR_HOST", "firestore": "FIRESTORE_EMULATOR_HOST"}


class EmulatorError(RuntimeError):
    """The emulator could not be started."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def gcloud_available() -> bool:
    return shutil.which("gcloud") is not None


@dataclass
class LocalEmulator:
    """One emulator process group on a loopback port.

    ``start()`` blocks until the port accepts connections; ``stop()`` kills the group and is
    safe to call twice. ``restart()`` keeps the port, which is how tests simulate an outage.
    """

    kind: str
    project: str = "workerpool-local"
    port: int = field(default_factory=free_port)
    startup_timeout: float = 60.0
    _process: subprocess.Popen[bytes] | None = None
    _log_path: Path | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env_var(self) -> str:
        return _ENV_VARS[self.kind]

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def start(self) -> LocalEmulator:
        if self.kind not in _COMMANDS:
            raise EmulatorError(f"unknown emulator kind {self.kind!r}")
        if not gcloud_available():
            raise EmulatorError("the gcloud CLI is not installed")
        fd, log_name = tempfile.mkstemp(prefix=f"{self.kind}-emulator-", suffix=".log")
        self._log_path = Path(log_name)
        command = [*_COMMANDS[self.kind], f"--host-port={self.host}", f"--project={self.project}"]
        self._process = subprocess.Popen(
            command, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True
        )
        os.close(fd)
        self._wait_until_listening()
        return self

    def _wait_until_listening(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise EmulatorError(f"{self.kind} emulator exited early; see {self._log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise EmulatorError(f"{self.kind} emulator did not listen within {self.startup_timeout}s")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        # Wait for the whole group, not just the wrapper: the Java server exits after it.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(process.pid, sig) or _group_gone(process, timeout=10):
                break
        process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> LocalEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_gone(process: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap the wrapper so it does not linger as a zombie in the group
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
