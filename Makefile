# The README's two set-up commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SOURCES := pyproject.toml setup.py protocol/_codec.pyx protocol/_frames.pxi protocol/_produce.pxi protocol/_gcm.pxi protocol/_blocks.pxi protocol/_parallel.pxi protocol/_slots.pxi \
	interceptors/builtin/schema_registry/_avro_check.pyx kiproxy/__init__.py dev/pyproject.toml
RUN_FLAGS ?= --plugins-dir plugins --interceptor mask_card_numbers:MaskCardNumbers
# Compiled extensions, kept by the hash of what their compilation reads (setup.py): the
# tests' fresh checkouts and wheels of the same sources copy them instead of compiling.
# A KIPROXY_EXT_CACHE in the environment (the tests set one for the checkouts) wins.
EXT_CACHE ?= $(or $(KIPROXY_EXT_CACHE),$(CURDIR)/$(VENV)/extensions)

.PHONY: install run test lint typecheck unit dist wheel docs docs-config bench-codec bench-deps haproxy-deps bench-proxy bench-routes bench clean

## The virtualenv's own pip is recent enough for `make run` (editable installs need pip 21.3;
## Python 3.11 ships 23), and pip builds the package with the setuptools pyproject.toml asks for.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

## What `make run` needs: the package, its runtime dependencies and dev/ (`kiproxy dev`, Tansu),
## with the record codec alone compiled (the demo never loads the Avro check; setup.py).
$(RUN_STAMP): $(SOURCES) | $(BIN)/python
	KIPROXY_EXTENSIONS=codec KIPROXY_EXT_CACHE=$(EXT_CACHE) \
		$(BIN)/python -m pip install --quiet -e . -e ./dev
	touch $(RUN_STAMP)

## What `make test` needs on top: the test, Spark, docs and packaging tools.
## A current pip first: it installs this many packages with a quarter less CPU than 23.2 does.
$(TEST_STAMP): $(SOURCES) | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	KIPROXY_EXT_CACHE=$(EXT_CACHE) $(BIN)/python -m pip install --quiet -e '.[test]' -e ./dev
	touch $(RUN_STAMP) $(TEST_STAMP)

install: $(TEST_STAMP)

## Start an embedded broker with the proxy and the example plugin in front of it:
## Tansu by default; BROKER=kafka for Apache Kafka (fetched by `make kafka` first, needs Java 17+).
BROKER ?= tansu
run: $(RUN_STAMP)
ifeq ($(BROKER),kafka)
	out="$$(apache-kafka/fetch.sh)" && home="$$(printf '%s\n' "$$out" | tail -n 1)" && \
		$(BIN)/kiproxy dev --broker kafka --kafka-home "$$home" $(RUN_FLAGS)
else
	$(BIN)/kiproxy dev $(RUN_FLAGS)
endif

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

## ruff, mypy --strict and the whole pytest suite (unit, property and integration tests,
## on Tansu and on Apache Kafka; the Apache Kafka tests skip, saying why, if Maven fails;
## the schema registry tests skip only where Java or Maven is missing; the container tests
## build the image once and skip, saying why, if no engine can run).
## Two workers (PYTEST_WORKERS): most tests wait on brokers, JVMs and clients rather than
## the CPU; tests/conftest.py (pytest_xdist_make_scheduler) shares the tests out.
PYTEST_WORKERS ?= 2
test: lint typecheck kafka-for-tests registry-for-tests haproxy-deps images-for-tests
	KIPROXY_EXT_CACHE=$(EXT_CACHE) $(BIN)/pytest -n $(PYTEST_WORKERS)

## The sdist and the wheel (with the compiled record codec) in dist/.
dist: $(TEST_STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

## A wheel of the package alone (its compiled extensions built in) in dist/, to install
## elsewhere with pip; needs only the virtualenv, not the test tools.
wheel: | $(BIN)/python
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir dist .

## The documentation site in build/site (a broken link or a missing page fails the build).
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

## Rewrite docs/configuration.md from the config model after changing a setting.
docs-config: $(RUN_STAMP)
	$(BIN)/python docs/gen_config_reference.py

bench-codec: $(TEST_STAMP)
	$(BIN)/python -m bench.codec

## haproxy from Debian, when it is missing: the load balancer of the PROXY protocol tests and
## the plain L4 baseline of bench-proxy. Both skip it, saying so, if this cannot install it.
haproxy-deps:
	-command -v haproxy >/dev/null 2>&1 || { \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		export DEBIAN_FRONTEND=noninteractive; \
		$$sudo apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 || { \
			$$sudo apt-get update -qq && \
			$$sudo apt-get install -y -qq --no-install-recommends haproxy >/dev/null; }; }

bench-deps: haproxy-deps

## End-to-end: producer -> (haproxy | kiproxy) -> embedded broker; BENCH_FLAGS=--quick for a short run.
bench-proxy: $(TEST_STAMP) bench-deps
	$(BIN)/python -m bench.proxy $(BENCH_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info protocol/_codec.c protocol/_codec*.so \
		interceptors/builtin/schema_registry/_avro_check.c \
		interceptors/builtin/schema_registry/_avro_check*.so

## Apache Kafka (version pinned in apache-kafka/pom.xml) from Maven Central into
## ${KIPROXY_KAFKA_CACHE:-~/.cache/kiproxy/kafka}/kafka_2.13-<version>; prints that folder last.
.PHONY: kafka kafka-for-tests
kafka:
	@apache-kafka/fetch.sh

kafka-for-tests:
	@apache-kafka/fetch.sh >/dev/null || echo "make kafka failed: the Apache Kafka tests will skip"

## A container engine for `make image` and the container tests: docker when `docker info`
## answers, otherwise Debian's podman (with buildah, runc, fuse-overlayfs, slirp4netns,
## uidmap, mmdebstrap for a base image built without a registry, and the dnsname CNI plugin by
## which Compose services find each other by name), installed when missing.
## podman reads this project's settings (CONTAINERS_CONF), never a rewritten /etc.
export CONTAINERS_CONF := $(CURDIR)/deploy/podman/containers.conf
CONTAINER_PACKAGES := podman buildah runc fuse-overlayfs slirp4netns uidmap mmdebstrap \
	golang-github-containernetworking-plugin-dnsname
.PHONY: container-engine image kafka-image
container-engine:
	-@docker info >/dev/null 2>&1 || dpkg -s $(CONTAINER_PACKAGES) >/dev/null 2>&1 || { \
		echo "no container engine answers: installing podman from Debian ($(CONTAINER_PACKAGES))"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		export DEBIAN_FRONTEND=noninteractive; \
		$$sudo apt-get install -y -qq --no-install-recommends $(CONTAINER_PACKAGES) >/dev/null 2>&1 || { \
			$$sudo apt-get update -qq && \
			$$sudo apt-get install -y -qq --no-install-recommends $(CONTAINER_PACKAGES) >/dev/null; } \
		|| echo "podman could not be installed: the container tests will skip"; }

## The project's image (docker or podman; the base image built from Debian packages when no
## registry answers, cached under ~/.cache/kiproxy/images); prints the image reference last.
image: container-engine
	@$(PYTHON) deploy/image.py

## An Apache Kafka image for docker-compose.yml (KAFKA_IMAGE=...): apache/kafka when it can be
## pulled, else one built from `make kafka`'s jars on the same Debian base; prints it last.
kafka-image: container-engine
	@$(PYTHON) deploy/image.py kafka

## Both images built (or found unchanged) before the suite starts, as Kafka and the registry
## are; where one cannot be built, the container tests say why (or skip without an engine).
.PHONY: images-for-tests
images-for-tests: container-engine kafka-for-tests
	@echo "Building the container images for the tests (make image, make kafka-image) ..."
	-@$(PYTHON) deploy/image.py >/dev/null 2>&1 && $(PYTHON) deploy/image.py kafka >/dev/null 2>&1 \
		|| echo "make image or make kafka-image failed: the container tests will say why"

## Apicurio Registry (version pinned in apicurio-registry/pom.xml), built from Maven Central as
## a Quarkus app into ${KIPROXY_REGISTRY_CACHE:-~/.cache/kiproxy/registry}; prints the path of
## its quarkus-run.jar last (`kiproxy dev --registry` and the tests find it there).
.PHONY: registry registry-serdes registry-for-tests
registry:
	@apicurio-registry/build.sh

## Apicurio's Java Avro serde (version pinned in apicurio-registry/serdes/pom.xml) and what it
## needs beside `make kafka`'s libs, copied from Maven Central (a few seconds cold) into
## ${KIPROXY_REGISTRY_CACHE:-~/.cache/kiproxy/registry}/apicurio-serdes-<version>/libs; prints
## that folder last. The tests whose producer carries schema ids in headers use it.
registry-serdes:
	@apicurio-registry/serdes.sh

registry-for-tests:
	@apicurio-registry/build.sh >/dev/null || echo "make registry failed: the schema registry tests will fail (or skip where Java or Maven is missing)"
	@apicurio-registry/serdes.sh >/dev/null || echo "make registry-serdes failed: the Apicurio serde test will fail (or skip where Java or Maven is missing)"
