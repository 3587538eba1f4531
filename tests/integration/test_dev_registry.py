"""``kiproxy dev --registry``: the dev mode with a schema registry (Apicurio) beside the
broker. It prints the registry's URL, the registry answers the Confluent API there while
the proxy serves, and Ctrl-C ends its JVM too. Registry flags without ``--registry`` are
one line.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.dev_mode import popen_dev, running_dev
from support.registry import registry_jar_or_skip

from kiproxy_dev.processes import port_free
from kiproxy_dev.tansu import free_port

pytestmark = pytest.mark.timeout(180)


def test_dev_with_a_registry_prints_its_url_and_stops_it_on_ctrl_c() -> None:
    jar = registry_jar_or_skip()
    listen, port = free_port(), free_port()
    with running_dev("--registry", "--registry-jar", str(jar), "--registry-port", str(port),
                     "--listen", f"127.0.0.1:{listen}") as dev:
        dev.wait_bootstrap(120)
        url = f"http://127.0.0.1:{port}/apis/ccompat/v7"
        assert f"kiproxy: schema registry (Apicurio Registry, in memory) at {url}" in dev.lines
        from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
        schema = json.dumps({"type": "record", "name": "Dev", "fields": [
            {"name": "n", "type": "int"}]})
        schema_id = SchemaRegistryClient({"url": url}).register_schema(
            "dev-value", Schema(schema, "AVRO"))
        with urllib.request.urlopen(f"{url}/schemas/ids/{schema_id}", timeout=10) as resp:
            assert json.loads(json.loads(resp.read())["schema"])["name"] == "Dev"

        dev.interrupt()
        assert dev.process.wait(60) == 0, dev.output
        assert port_free(port), "the registry still listens after Ctrl-C"
        assert "Traceback" not in dev.output


def test_registry_flags_without_registry_are_one_line() -> None:
    proc = popen_dev("--registry-port", "9999")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1] == (
        "kiproxy: config error: --registry-jar and --registry-port need --registry")


def test_the_registry_jvm_ends_when_its_launcher_is_killed() -> None:
    """The JVM runs in a session of its own (a Ctrl-C reaches only the launcher, which
    stops it in order); a launcher killed with SIGKILL runs no cleanup, so the JVM is
    told by the kernel instead (PR_SET_PDEATHSIG) and no registry is left on its port."""
    import os
    import signal
    import subprocess
    import sys
    import time

    jar = registry_jar_or_skip()
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from pathlib import Path\n"
         "from kiproxy_dev.apicurio import ApicurioRegistry\n"
         f"ApicurioRegistry(Path({str(jar)!r}), port={port}).start()\n"
         "print('up', flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "up"
        assert not port_free(port)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_free(port), "the registry JVM outlived its killed launcher"
    finally:
        launcher.kill()
