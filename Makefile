# The README's two set-up commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_FLAGS ?= --plugins-dir plugins --interceptor mask_card_numbers:MaskCardNumbers

.PHONY: install run test lint typecheck unit bench-codec bench-deps bench-proxy bench clean

$(STAMP): pyproject.toml setup.py protocol/_codec.pyx kiproxy/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## Start an embedded broker with the proxy and the example plugin in front of it.
run: $(STAMP)
	$(BIN)/kiproxy dev $(RUN_FLAGS)

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

## ruff, mypy --strict and the whole pytest suite (unit, property and integration tests).
test: lint typecheck
	$(BIN)/pytest

bench-codec: $(STAMP)
	$(BIN)/python -m bench.codec

## haproxy (the plain L4 baseline of bench-proxy) from Debian, when it is missing; the
## benchmark runs without it and says so if this cannot install it.
bench-deps:
	-command -v haproxy >/dev/null 2>&1 || { \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		$$sudo apt-get install -y -qq --no-install-recommends haproxy >/dev/null; }

## End-to-end: producer -> (haproxy | kiproxy) -> embedded broker; BENCH_FLAGS=--quick for a short run.
bench-proxy: $(STAMP) bench-deps
	$(BIN)/python -m bench.proxy $(BENCH_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info protocol/_codec.c protocol/_codec*.so
