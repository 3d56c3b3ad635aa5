#!/usr/bin/env bash
# Install the local BigQuery emulator (local-bigquery 0.3.2) into .bqemu-venv at the repo root.
# It needs Python 3.13, so it gets a venv of its own (ignored by git: a 3.13 venv writes its
# own .gitignore). duckdb and its extensions are pinned to 1.5.5: the duckdb-extension-* wheels
# carry the extension binaries, which tests/bigquery_fixture.py copies into DuckDB's extension
# directory before starting the emulator, so nothing is downloaded at run time (spatial too:
# the emulator runs INSTALL spatial at start). Exits 3 when no Python 3.13 is found.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .bqemu-venv/bin/local-bigquery ] && exit 0

python313=""
for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 \
    "$(command -v python3.13 || true)"; do  # a pyenv shim may exist without working: try each
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' \
        2>/dev/null; then
        python313="$candidate"
        break
    fi
done
if [ -z "$python313" ]; then
    echo "no Python 3.13 found: the local BigQuery emulator cannot be installed" >&2
    exit 3
fi
"$python313" -m venv .bqemu-venv
.bqemu-venv/bin/python -m pip install --quiet --upgrade pip
.bqemu-venv/bin/python -m pip install --quiet 'local-bigquery==0.3.2' 'duckdb==1.5.5' \
    'duckdb-extension-ducklake==1.5.5' 'duckdb-extension-icu==1.5.5' \
    'duckdb-extension-spatial==1.5.5'
