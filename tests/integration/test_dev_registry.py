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
