"""Commands the documentation shows against a running proxy, run as the pages have them.

Each test reads its block from the page: the sh block under the test marker
that names the test's node id (``<!-- test: skip ... tests/integration/
test_page_commands.py::test_x -->``), so the page and the test cannot drift
apart. What a test changes in a block it says: only what the reader's machine
has and this one must choose, such as a free port instead of the page's fixed
one, or a token file in a temporary folder instead of a Secret's mount.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TANSU_NODE_ID, consume, launch_proxy
from support.dev_mode import running_dev

from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)

THIS = "tests/integration/test_page_commands.py"


def page_block(page: str, test: str) -> str:
    """The sh block of ``docs/page`` whose test marker names ``THIS::test``."""
    node_id = re.escape(f"{THIS}::{test}")
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    found = re.search(r"<!--\s*test:[^>]*" + node_id + r"\b[^>]*-->\n```sh\n(.*?)\n```",
                      text, re.S)
    assert found is not None, f"docs/{page} has no sh block whose marker names {THIS}::{test}"
    return found.group(1)


def _bash(block: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=90, check=False)


def test_the_wasm_example_upper_cases_through_kiproxy_dev() -> None:
    """docs/wasm.md's ``kiproxy dev --interceptor wasm ...``, on a free port."""
    [line] = page_block("wasm.md", "test_the_wasm_example_upper_cases_through_kiproxy_dev") \
        .splitlines()
    argv = shlex.split(line)
    assert argv[:2] == ["kiproxy", "dev"] and "--listen" not in argv, line
    listen = f"127.0.0.1:{free_port()}"
    # The broker's node port free as well (by default the listen port + 1 + its node id,
    # which another test's server may hold).
    with running_dev(*argv[2:], "--listen", listen,
                     "--broker-port-start", str(free_port() - TANSU_NODE_ID)) as dev:
        dev.wait_bootstrap(90)
        from confluent_kafka import Producer

        topic = f"wasm-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": listen})
        producer.produce(topic, value=b"hello wasm", partition=0)
        assert producer.flush(30) == 0
        assert [m.value() for m in consume(listen, topic, 1)] == [b"HELLO WASM"]
        dev.interrupt()
        assert dev.process.wait(30) == 0, dev.output


@pytest.mark.parametrize(("page", "token"), [("reload.md", None), ("deployment.md", "s3cret")])
def test_the_reload_pages_curl_lines_reload_a_running_proxy(
        page: str, token: str | None, tmp_path: Path, broker: EmbeddedBroker) -> None:
    """The pages' ``curl ... /reload``: the metrics listener on a free port instead of 9404,
    deployment.md's token file in a temporary folder instead of the Secret's mount."""
    block = page_block(page, "test_the_reload_pages_curl_lines_reload_a_running_proxy")
    metrics = f"127.0.0.1:{free_port()}"
    assert "127.0.0.1:9404" in block, block
    block = block.replace("127.0.0.1:9404", metrics)
    config = tmp_path / "kiproxy.yaml"
    config.write_text("{}\n")
    if token is not None:
        mount = "/var/run/secrets/kiproxy/admin-token"
        assert mount in block, block
        token_file = tmp_path / "admin-token"
        token_file.write_text(f"{token}\n")
        config.write_text(f"admin:\n  token_file: {token_file}\n")
        block = block.replace(mount, str(token_file))
    proxy = launch_proxy(broker.bootstrap, "--metrics-listen", metrics, config_file=config)
    try:
        done = _bash(block, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"ok": true' in done.stdout and '"trigger": "http"' in done.stdout, done.stdout
        assert "reload (http) applied" in proxy.wait_for_line("reload (http) applied")
    finally:
        proxy.stop()


@pytest.mark.timeout(180)
def test_the_keytool_lines_convert_a_jks_truststore(tmp_path: Path) -> None:
    """docs/replay-security.md's keytool lines on a JKS truststore holding a CA certificate
    under the alias ``CARoot``, the passwords keytool asks for typed on stdin."""
    keytool = shutil.which("keytool")
    if keytool is None:
        pytest.skip("keytool is not installed (it comes with a JDK, which the README's "
                    "prerequisites name)")
    store = ["-storepass", "changeit"]
    for step in (["-genkeypair", "-alias", "CARoot", "-keyalg", "RSA", "-keysize", "2048",
                  "-dname", "CN=docs-ca", "-validity", "2", "-keystore", "ca.p12", *store],
                 ["-exportcert", "-alias", "CARoot", "-keystore", "ca.p12", *store,
                  "-file", "ca.der"],
                 ["-importcert", "-noprompt", "-alias", "CARoot", "-file", "ca.der",
                  "-keystore", "truststore.jks", "-storetype", "JKS", *store]):
        made = subprocess.run([keytool, *step], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)
        assert made.returncode == 0, made.stdout + made.stderr
    block = page_block("replay-security.md", "test_the_keytool_lines_convert_a_jks_truststore")
    # -importkeystore asks for the new store's password twice, then for the JKS file's.
    done = _bash(block, tmp_path, stdin="changeit\n" * 3)
    assert done.returncode == 0, done.stdout + done.stderr

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import pkcs12

    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    assert ca.subject.rfc4514_string() == "CN=docs-ca"
    converted = pkcs12.load_pkcs12((tmp_path / "truststore.p12").read_bytes(), b"changeit")
    assert [c.certificate for c in converted.additional_certs] == [ca]
