"""docs/deployment.md's podman block runs as written, in front of a broker on this host.

The block (the one whose test marker names this test) exports ``CONTAINERS_CONF``
itself, builds or reuses the image with ``make -s image``, runs it, waits for
``/readyz``, reloads it with SIGHUP and stops it. It runs here with ``bash -e -o
pipefail`` from the repository root, without ``CONTAINERS_CONF`` in its environment,
so a page that forgot the export fails as a reader's shell would (on a host that
refuses podman's default rlimits: ``error setting rlimit type 7``). Two changes are
made to it: the page's broker ``127.0.0.1:9092`` becomes the session's Tansu broker
and its listeners move to free ports when theirs are taken; and the container's
state is read before the block removes it, to check that SIGTERM stopped it with
exit status 0.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TANSU_NODE_ID

from kiproxy_dev.tansu import EmbeddedBroker, free_port

from .engine import ROOT, Image

pytestmark = pytest.mark.timeout(900)  # a cold `make image` builds the base and the image

PAGE = ROOT / "docs" / "deployment.md"
NODE_ID = "tests/containers/test_deployment_page.py::test_the_podman_lines_run_as_written"
CONTAINER = "kiproxy"
"""The container name the page uses."""


def page_block() -> str:
    """The sh block under the test marker that names this test."""
    found = re.search(r"<!--\s*test:[^>]*" + re.escape(NODE_ID) + r"[^>]*-->\n```sh\n(.*?)\n```",
                      PAGE.read_text(), re.S)
    assert found is not None, f"docs/deployment.md has no sh block whose marker names {NODE_ID}"
    return found.group(1)


def _taken(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


def _addresses(block: str, broker: EmbeddedBroker) -> dict[str, str]:
    """The page's address -> the one this run uses."""
    moved = {"127.0.0.1:9092": broker.bootstrap}
    for address in ("127.0.0.1:9192", "127.0.0.1:9404"):
        assert address in block, f"the page's block no longer names {address}"
        # The node listener (listen port + 1 + node id) must be free too.
        node = f"127.0.0.1:{int(address.rsplit(':', 1)[1]) + 1 + TANSU_NODE_ID}"
        if _taken(address) or (address.endswith(":9192") and _taken(node)):
            moved[address] = f"127.0.0.1:{free_port()}"
    return moved


@pytest.fixture
def no_container(image: Image) -> Iterator[None]:
    """No container named as the page's before and after the test."""
    image.run("rm", "-f", "-t", "0", CONTAINER, check=False)
    yield
    image.run("rm", "-f", "-t", "0", CONTAINER, check=False)


def test_the_podman_lines_run_as_written(image: Image, broker: EmbeddedBroker,
                                         no_container: None, tmp_path: Path) -> None:
    if image.engine != "podman":
        pytest.skip(f"the block is for podman; the engine here is {image.engine}")
    block = page_block()
    for page_address, address in _addresses(block, broker).items():
        block = block.replace(page_address, address)
    # The container's state after `podman stop`, read before the block's `podman rm`.
    assert "podman rm -v kiproxy" in block, "the page's block no longer removes the container"
    block = block.replace("podman rm -v kiproxy", "podman inspect --format '{{json .State}}' "
                          f"kiproxy > {tmp_path / 'state.json'}\npodman rm -v kiproxy")
    env = {k: v for k, v in os.environ.items() if k != "CONTAINERS_CONF"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    logs = image.run("logs", CONTAINER, check=False)
    assert done.returncode == 0, (f"the block failed (exit {done.returncode}):\n{done.stdout}\n"
                                  f"{done.stderr}\ncontainer logs:\n{logs.stdout}{logs.stderr}")
    assert "ready" in done.stdout, done.stdout
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["ExitCode"] == 0, state  # SIGTERM: a clean stop
