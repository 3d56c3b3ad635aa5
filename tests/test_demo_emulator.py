"""``workerpool demo`` as a person sees it on a terminal, and as Cloud Logging reads it piped."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

# Control sequences: colours (SGR) and the cursor movements of a live display.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_JOB_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} INFO +demo\.sleep sleep-\d+ done \d+\.\d{3}s$")
_DEMO = [sys.executable, "-m", "workerpool", "demo", "--jobs", "6"]  # 11 jobs published


def _env(emulator: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env.pop("WORKERPOOL_LOG_FORMAT", None)
    return {**env, "PUBSUB_EMULATOR_HOST": emulator, "TERM": "xterm-256color"}


def _run_on_terminal(args: list[str], env: dict[str, str], timeout: float = 240) -> str:
    """Everything ``args`` writes to a pseudo-terminal that is its stdout and stderr."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the process closed the terminal's last other end
                break
            if not data:
                break
            chunks.append(data)
        assert process.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        process.kill()
        os.close(leader)
    return b"".join(chunks).decode("utf-8", errors="replace")


def test_demo_on_a_terminal_shows_short_coloured_lines_and_a_live_display(
    pubsub_emulator: str,
) -> None:
    # Given a pseudo-terminal as the demo's stdout and stderr
    # When the demo runs its 11 jobs
    output = _run_on_terminal(_DEMO, _env(pubsub_emulator))
    plain = [_ANSI.sub("", line).strip() for line in re.split(r"[\r\n]+", output)]
    # Then a job's line is its time, level, job, job id, outcome and duration, no key=value
    assert any(_JOB_LINE.match(line) for line in plain), output
    assert not re.search(r"\b(job|job_id|outcome|duration|message_id)=", "\n".join(plain))
    # and its outcome is coloured: done green, dead_lettered red, retried yellow
    assert "\x1b[32mdone\x1b[0m" in output
    assert "\x1b[31mdead_lettered\x1b[0m" in output
    assert "\x1b[33mretried\x1b[0m" in output
    # and the progress is a live display (the cursor hidden, lines erased and redrawn), whose
    # last frame counts every job settled, in place of the progress lines
    assert "\x1b[?25l" in output and "\x1b[2K" in output
    last = re.compile(
        r"^settled \S+ 11/11 running \d/4  held \d+  done \d+  retried \d+  dead-lettered \d+$"
    )
    assert any(last.match(line) for line in plain), output
    assert "running=" not in output


def test_demo_piped_writes_json_lines(pubsub_emulator: str) -> None:
    # Given the demo's stdout and stderr piped
    # When it runs
    result = subprocess.run(
        _DEMO, env=_env(pubsub_emulator), capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    # Then every log line is JSON in Cloud Logging's shape, job lines with their fields, no colour
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert entries and all("severity" in entry and "message" in entry for entry in entries)
    assert any(entry.get("outcome") == "dead_lettered" for entry in entries)
    assert "\x1b" not in result.stderr + result.stdout
    # and the progress is a line at a time, as before
    assert "running=" in result.stdout


def test_log_format_json_wins_on_a_terminal(pubsub_emulator: str) -> None:
    # Given a terminal, When the demo runs with --log-format json
    output = _run_on_terminal([*_DEMO, "--log-format", "json"], _env(pubsub_emulator))
    # Then its log lines are JSON and no live display is drawn
    entries = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert any(entry.get("outcome") == "done" for entry in entries)
    assert "\x1b" not in output and "running=" in output
