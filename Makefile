# The gate, with the tools of the active Python environment (make PYTHON=... to pick another).
# `make check` is the fast one (format, lint, types, the docs site, the unit tier); `make test`
# is the README's test command, the one .ci/run runs after the same checks.
PYTHON ?= python

.PHONY: check format lint types docs unit test proto bench-report

check: format lint types docs unit

format:
	$(PYTHON) -m ruff format --check .

lint:
	$(PYTHON) -m ruff check .

types:
	$(PYTHON) -m mypy

# The site goes to a throwaway folder: this only proves it builds without a warning. Not
# --quiet: it hides the warnings from --strict too, and the build passes. The variable silences
# the theme's banner about its end of life, printed on every build.
docs:
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict \
		--site-dir $$site; \
	status=$$?; rm -rf $$site; exit $$status

unit:
	$(PYTHON) -m pytest -m "not emulator and not slow" -n 3 -q

test:
	$(PYTHON) -m pytest -n 3

# BENCHMARKS.md, written by the bench: every runner of bench/ with the report's short settings
# (about 20 minutes on 2 cores), its results in bench/results/, then the report from them.
bench-report:
	$(PYTHON) -m bench.summary

# The KEDA external scaler's modules (workerpool/autoscale/externalscaler_pb2*.py[i]), generated
# from externalscaler.proto and committed. The generator is pinned old on purpose, and installed
# in a throwaway venv rather than the dev extra (it needs protobuf < 5): protoc 25's code has no
# runtime version check, so it loads under protobuf 4.25 to 7.x and grpcio 1.62 on, where a newer
# generator's code refuses any runtime older than itself.
proto:
	tools=$$(mktemp -d) && $(PYTHON) -m venv $$tools \
	&& $$tools/bin/python -m pip install --quiet 'grpcio-tools==1.62.3' \
	&& $$tools/bin/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
		--grpc_python_out=. workerpool/autoscale/externalscaler.proto; \
	status=$$?; rm -rf $$tools; exit $$status
