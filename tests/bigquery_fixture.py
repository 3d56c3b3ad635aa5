"""The local BigQuery emulator for the tests, and the statement seam the emulator needs.

``local_bigquery`` runs ``local-bigquery serve`` (through ``_SERVE``, which starts V8 first;
local-bigquery 0.3.2 needs Python 3.13: it lives in its own venv, ``.bqemu-venv`` in the repo,
made on first use by emulator/install-bigquery-emulator.sh) on a free port with a fresh data
directory, in its own process group, and kills the group afterwards.
``BIGQUERY_EMULATOR_HOST`` set beforehand means "use that one instead".

The emulator runs jobs in the background, keeps labels, answers 409 for a repeated job id and
lists jobs by state, but it rejects ``format='CLOUD_BIGTABLE'`` and external table definitions.
So the lifecycle tests swap the statement for a SELECT that naps (``nap_query``), while the real
statement is checked by tests/test_bigquery_statement.py. Worker processes get the same swap by
importing this module (``--jobs tests.bigquery_fixture``) with ``NAP_ENV`` set (and
``LIST_LAG_ENV``, to make the plugin's count of running exports as stale as in production).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import workerpool_jobs.bigquery_reverse_etl as plugin
from workerpool_jobs.bigquery_reverse_etl import ExportRequest, Query
from workerpool_jobs.bigquery_reverse_etl.launch import Export
from workerpool_jobs.bigquery_reverse_etl.statement import build_query

# The example, with names that pass the real rules (project ids are 6-30 characters,
# Bigtable instance ids 6-33: the "p" and "i" are rejected, see below).
EXAMPLE_PAYLOAD: dict[str, Any] = {
    "source": {
        "uris": ["gs://bucket/segments/2026-11-30/*.csv"],
        "format": "CSV",
        "skip_leading_rows": 1,
        "schema": [{"name": "user_id", "type": "STRING"}, {"name": "segment", "type": "STRING"}],
    },
    "row_key": "user_id",
    "column_families": {"seg": ["segment"]},
    "target": {
        "project": "ads-serving",
        "instance": "segments-prod",
        "app_profile": "retl",
        "table": "segments",
    },
    "options": {"overwrite": True, "auto_create_column_families": True},
    "location": "US",
    "labels": {"team": "ads"},
}

REPO = Path(__file__).resolve().parent.parent
# Where to find the emulator: this variable (the executable), else the repo's own venv, else PATH.
EXECUTABLE_ENV = "LOCAL_BIGQUERY"
REPO_EXECUTABLE = REPO / ".bqemu-venv" / "bin" / "local-bigquery"
# Read by worker processes that import this module: nap this many seconds instead of exporting.
NAP_ENV = "WORKERPOOL_TEST_BQ_NAP_SECONDS"
LIST_LAG_ENV = "WORKERPOOL_TEST_BQ_LIST_LAG_SECONDS"
# DuckDB extensions the emulator loads, shipped as duckdb-extension-* wheels in its venv.
EXTENSIONS = ("ducklake", "icu", "spatial")
_INSTALL_EXTENSIONS = """
import importlib.util, pathlib, sys, duckdb
for name in sys.argv[1:]:
    spec = importlib.util.find_spec("duckdb_extension_" + name)
    if spec is None:
        sys.exit("duckdb-extension-" + name + " is not installed")
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    duckdb.connect().install_extension(str(next(root.rglob("*.duckdb_extension"))))
"""

# ``local-bigquery serve``, but with V8 started first, in this main thread, with memory
# protection keys off. The emulator starts V8 lazily in the job thread of the first JS UDF; on
# a CPU with pkeys (pku), mini-racer >= 0.13 (V8 14) then segfaults the whole emulator when a
# second UDF context is made on another job thread, i.e. as soon as two naps run at once.
_SERVE = """
import sys
from py_mini_racer import init_mini_racer
init_mini_racer(flags=("--single-threaded", "--no-memory-protection-keys"))
from local_bigquery.cli import main
sys.exit(main(sys.argv[1:]))
"""


def find_local_bigquery() -> Path | None:
    given = os.environ.get(EXECUTABLE_ENV)
    if given:
        return Path(given)
    if REPO_EXECUTABLE.exists():
        return REPO_EXECUTABLE
    found = shutil.which("local-bigquery")
    if found:
        return Path(found)
    installer = REPO / "emulator" / "install-bigquery-emulator.sh"
    result = subprocess.run(["bash", str(installer)], capture_output=True, timeout=600, check=False)
    return REPO_EXECUTABLE if result.returncode == 0 and REPO_EXECUTABLE.exists() else None


def install_extensions(executable: Path) -> None:
    """Copy the extension binaries from their wheels into DuckDB's extension directory, so
    the emulator never tries to download them (it does ``INSTALL spatial`` at start)."""
    python = executable.parent / "python"
    subprocess.run(
        [str(python), "-c", _INSTALL_EXTENSIONS, *EXTENSIONS],
        check=True,
        capture_output=True,
        timeout=120,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def local_bigquery(executable: Path, project: str, timeout: float = 90.0) -> Iterator[str]:
    """Yield the emulator's URL (``http://127.0.0.1:PORT``) while it runs."""
    install_extensions(executable)
    data_dir = Path(tempfile.mkdtemp(prefix="bqemu-"))
    log = data_dir / "emulator.log"
    port, grpc_port = _free_port(), _free_port()
    command = [
        str(executable.parent / "python"), "-c", _SERVE, "serve",
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--project", project, "--data-dir", str(data_dir / "data"),
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _answers(f"{url}/bigquery/v2/projects/{project}/jobs?maxResults=1"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"local-bigquery did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        shutil.rmtree(data_dir, ignore_errors=True)


def nap_sql(seconds: float) -> str:
    """A query that stays RUNNING for ``seconds`` without burning CPU. The JS body carries a
    fresh tag because the emulator runs each distinct UDF body in one V8 context at a time:
    with the same body, concurrent jobs would nap one after another."""
    tag = uuid.uuid4().hex
    return (
        'CREATE TEMP FUNCTION nap(ms FLOAT64) RETURNS FLOAT64 LANGUAGE js AS r"""\n'
        f"  // {tag}\n"
        "  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);\n"
        "  return ms;\n"
        '""";\n'
        f"SELECT nap({seconds * 1000:.0f}) AS napped"
    )


def nap_query(seconds: float) -> Callable[[ExportRequest, str | None], Query]:
    """A ``query_builder`` that validates the request and builds the real statement (so a bad
    payload still fails as it would), then submits a nap of ``seconds`` instead."""

    def build(request: ExportRequest, default_project: str | None) -> Query:
        build_query(request, default_project)
        return Query(nap_sql(seconds))

    return build


def stale_count(lag: float) -> Callable[[Export], int]:
    """``Export.running_exports`` answering ``lag`` seconds late: what jobs.list's eventual
    consistency does to the count in production (a job just inserted is not listed yet),
    which the emulator, listing at once, hides."""
    count = Export.running_exports

    def late(export: Export) -> int:
        running = count(export)
        time.sleep(lag)
        return running

    return late


# A worker process started with ``--jobs tests.bigquery_fixture`` and NAP_ENV naps too; with
# LIST_LAG_ENV its count of running exports is that many seconds stale.
if os.environ.get(NAP_ENV):
    plugin.query_builder = nap_query(float(os.environ[NAP_ENV]))
if os.environ.get(LIST_LAG_ENV):
    Export.running_exports = stale_count(float(os.environ[LIST_LAG_ENV]))
