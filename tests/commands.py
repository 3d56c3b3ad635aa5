"""The ``workerpool`` command run as a process of its own, without paying its start each time.

A ``python -m workerpool`` spends a second or more of CPU importing (and, without cached
bytecode, compiling) the package before it reads its first argument: that dominated the
tests that check how a command refuses bad input. Here one Python per test process imports
the command once and forks a process for each run. Each run still starts from a process that
has done nothing but import the command, in the environment it is given, and writes to its own
stdout and stderr file descriptors, read back as it left them, in this process's directory,
and runs its exit handlers as it ends. What only a started
``python -m workerpool`` has (signals held from its first line, the entry point itself) stays
with the tests that start one."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

# Reads one [args, env, cwd] a line on stdin; answers each with [returncode, stdout, stderr].
_SERVER = """
import atexit, json, os, signal, sys, tempfile, traceback
from workerpool.cli import main

def run(args, env, cwd):
    signal.alarm(60)  # a run that would not end (it found nothing wrong) ends here
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # After the directory it runs in (sys.path[0], ''), as a started Python has them
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        main(args, prog_name="workerpool")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    return 1

for line in sys.stdin:
    args, env, cwd = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = run(args, env, cwd)
            atexit._run_exitfuncs()  # (os._exit skips them: a process's end runs them)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        said = [out.read().decode(), err.read().decode()]
    print(json.dumps([os.waitstatus_to_exitcode(status), *said]), flush=True)
"""


class _Server:
    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def run(self, args: Sequence[str], env: Mapping[str, str]) -> list[object]:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = subprocess.Popen(
                    [sys.executable, "-c", _SERVER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            stdin, stdout = self._pipes(self._process)
            stdin.write(json.dumps([list(args), dict(env), os.getcwd()]) + "\n")
            stdin.flush()
            answer: list[object] = json.loads(stdout.readline())
            return answer

    def close(self) -> None:
        """Its input closed, the server ends; waited for, so its CPU counts as this one's."""
        if self._process is not None:
            self._pipes(self._process)[0].close()
            self._process.wait(30)

    @staticmethod
    def _pipes(process: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
        assert process.stdin is not None and process.stdout is not None
        return process.stdin, process.stdout


_server = _Server()
atexit.register(_server.close)


def run_command(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``workerpool ARGS`` run as a process of its own in ``env`` (default: this one's)."""
    code, stdout, stderr = _server.run(args, os.environ if env is None else env)
    assert isinstance(code, int) and isinstance(stdout, str) and isinstance(stderr, str)
    return subprocess.CompletedProcess(["workerpool", *args], code, stdout, stderr)


def run_commands(
    commands: Sequence[Sequence[str]], env: Mapping[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    return [run_command(*args, env=env) for args in commands]
