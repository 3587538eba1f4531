# syntax=docker/dockerfile:1
#
# kiproxy's container image.
#
#   docker build -t kiproxy:0.4.0 .
#   docker run --rm -p 9192-9195:9192-9195 -p 9404:9404 -v "$PWD/plugins:/plugins:ro" \
#       kiproxy:0.4.0 --upstream kafka-1:9092 --advertised-host localhost \
#       --interceptor mask_card_numbers:MaskCardNumbers
#
# Two stages: the builder has gcc and turns the project (with its Cython
# extensions: the record codec and the Avro payload check) and every runtime
# dependency into wheels; the runtime stage installs those wheels only - no
# compiler, no test extras.
#
# Ports (EXPOSE below; the defaults of deploy/docker/config.yaml):
#   9192        bootstrap listener (`listen`)
#   9193-9195   broker node N on 9193+N (`broker_port_start` = listen port + 1);
#               publish one port per broker node, host port = container port,
#               because the proxy advertises its own port numbers in metadata
#   9404        /metrics, /healthz, /readyz (`metrics_listen`)
# Volumes:
#   /etc/kiproxy   config.yaml, read by the entrypoint (`--config /etc/kiproxy/config.yaml`)
#   /plugins       interceptor modules (`plugins_dir`)
# Arguments after the image name are more `kiproxy run` flags; they override the file.

ARG PYTHON_IMAGE=python:3.12-slim-trixie
# The proxy's optional extras the image carries (pyproject.toml).
ARG KIPROXY_EXTRAS=jsonschema,wasm,extism,schema-registry,kafka-audit

FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    KIPROXY_EXT_CACHE=/root/.cache/kiproxy-ext
WORKDIR /src
# .dockerignore keeps tests, virtualenvs and host-built codec files out of the context.
COPY . .
# Build isolation fetches the build requirements (setuptools, wheel, Cython) of pyproject.toml.
# The image carries every built-in interceptor and the audit log's Kafka sink
# (the optional extras of the proxy), not the embedded broker of `kiproxy dev`.
# Two cache mounts outlive a build and never reach an image: pip's cache (what the index
# lets it keep), and the compiled extensions (setup.py's KIPROXY_EXT_CACHE, keyed by a
# hash of what their compilation reads), so a rebuild after a change to the Python
# sources compiles nothing again.
ARG KIPROXY_EXTRAS
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=cache,target=/root/.cache/kiproxy-ext \
    pip wheel --wheel-dir /wheels ".[${KIPROXY_EXTRAS}]"

FROM ${PYTHON_IMAGE}
ARG KIPROXY_EXTRAS
LABEL org.opencontainers.image.title="kiproxy" \
      org.opencontainers.image.description="Kafka produce-request interceptor proxy" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "kafka-interceptor-proxy[${KIPROXY_EXTRAS}]" \
    && python -c "import kiproxy.protocol._codec, \
kiproxy.interceptors.builtin.schema_registry._avro_check, \
kiproxy.interceptors.builtin.schema_registry.contract, kiproxy.interceptors.builtin.extism" \
    && kiproxy run --help > /dev/null
RUN groupadd --system --gid 10001 kiproxy \
    && useradd --system --uid 10001 --gid kiproxy --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin kiproxy \
    && mkdir -p /etc/kiproxy /plugins
COPY deploy/docker/config.yaml /etc/kiproxy/config.yaml
COPY LICENSE /usr/share/doc/kiproxy/LICENSE
VOLUME ["/etc/kiproxy", "/plugins"]
EXPOSE 9192 9193-9195 9404
# Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
# Fails (exit 1) on a refused connection or a non-2xx answer; needs metrics_listen on 9404.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9404/healthz', timeout=4)"]
ENTRYPOINT ["kiproxy", "run", "--config", "/etc/kiproxy/config.yaml"]
CMD []
