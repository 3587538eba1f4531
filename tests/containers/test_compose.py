"""docker-compose.yml brought up for real: three Apache Kafka brokers and kiproxy in front.

``docker compose`` where a Docker engine answers, else ``podman-compose`` (PyPI)
with podman; the Kafka image is ``apache/kafka`` when it can be pulled, else
the one ``make kafka-image`` builds from ``make kafka``'s jars, and kiproxy's is
``make image``'s (``KAFKA_IMAGE`` and ``KIPROXY_IMAGE`` name them). podman 4
ignores ``depends_on: condition: service_healthy``, so kiproxy starts with the
brokers and must wait for them itself (``wait_for_upstream``, and discovery
retried until the brokers answer). Then the README's produce-and-consume example
runs unchanged against the published port and reads the record masked.

The stack publishes fixed host ports (9192-9195, 9404), as the README says.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import redirect_stdout
from io import StringIO

import pytest

from .engine import ROOT, Image, engine_env

pytestmark = pytest.mark.timeout(900)

PORTS = (9192, 9193, 9194, 9195, 9404)


def _compose_command(engine: str) -> list[str]:
    if engine == "docker":
        plugin = subprocess.run(["docker", "compose", "version"], capture_output=True,
                                text=True, env=engine_env(), timeout=60, check=False)
        if plugin.returncode != 0:
            pytest.skip(f"docker compose is not installed: {plugin.stderr.strip()[:200]}")
        return ["docker", "compose"]
    if shutil.which("podman-compose") is None:
        try:
            import podman_compose  # noqa: F401
        except ImportError:
            pytest.skip("podman-compose is not installed (the test extra has it)")
    return [sys.executable, "-m", "podman_compose"]


def _readyz() -> int:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9404/readyz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def stack(image: Image, kafka_image: Image) -> Iterator[list[str]]:
    """The Compose project up, kiproxy's /readyz answering 200; brought down afterwards.
    Yields the command prefix that names the project."""
    busy = [p for p in PORTS if not _free(p)]
    if busy:
        pytest.fail(f"ports {busy} are in use: the Compose file publishes them")
    command = [*_compose_command(image.engine), "-f", str(ROOT / "docker-compose.yml"),
               "-p", f"kiproxy-test-{uuid.uuid4().hex[:6]}"]
    env = {**engine_env(), "KAFKA_IMAGE": kafka_image.ref, "KIPROXY_IMAGE": image.ref}

    def compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=timeout, check=False)

    started = time.monotonic()
    up = compose("up", "-d")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        deadline = time.monotonic() + 180
        while _readyz() != 200:
            assert time.monotonic() < deadline, compose("logs", "kiproxy").stdout
            time.sleep(0.5)
        print(f"\ncompose: kiproxy ready {time.monotonic() - started:.1f} s after `up -d`")
        yield command
    finally:
        # Nothing is checked on the way down: no grace period (a Kafka broker's controlled
        # shutdown alone took seconds of each run).
        compose("down", "-t", "0", timeout=120)


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- test: run expect=\"b'card \*\*\*\*-\*\*\*\*-\*\*\*\*-1111 paid'\" -->"
                      r"\n```python\n(.*?)```", readme, re.DOTALL)
    assert found, "the README's produce-and-consume example"
    return found.group(1)


def test_the_readme_example_reads_its_record_masked_through_the_stack(
        stack: list[str], image: Image) -> None:
    out = StringIO()
    with redirect_stdout(out):
        exec(compile(_readme_example(), "README.md", "exec"), {})
    assert out.getvalue() == "b'card ****-****-****-1111 paid'\n"

    # The cluster may still be registering a broker when the example runs: ask through the
    # proxy until its Metadata names all three (each then has its node listener).
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": "127.0.0.1:9192"})
    deadline = time.monotonic() + 60
    while len(admin.list_topics(timeout=10).brokers) < 3:
        assert time.monotonic() < deadline, "the cluster never named three brokers"
        time.sleep(1)
    logs = subprocess.run([*stack, "logs", "kiproxy"], capture_output=True, text=True,
                          env=engine_env(), cwd=ROOT, timeout=60, check=False)
    text = logs.stdout + logs.stderr
    # Learnt by discovery or from the example's own Metadata, whichever came first.
    for node in (1, 2, 3):
        assert f"node {node} (kafka-{node}:9092) gets listener port {9192 + node}" in text, text
    if image.engine == "podman":  # no health ordering: kiproxy started before the brokers
        assert "could not learn the cluster's nodes from the upstream brokers" in text, text
