# The gate, with the tools of the active Python environment (make PYTHON=... to pick another).
# `make check` is the fast one (format, lint, types, the unit tier); `make test` is the
# README's test command, the one .ci/run runs after the same checks.
PYTHON ?= python

.PHONY: check format lint types unit test

check: format lint types unit

format:
	$(PYTHON) -m ruff format --check .

lint:
	$(PYTHON) -m ruff check .

types:
	$(PYTHON) -m mypy

unit:
	$(PYTHON) -m pytest -m "not emulator" -q

test:
	$(PYTHON) -m pytest -n 2
