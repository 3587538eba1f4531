"""Fixtures of the integration tests that need more than the shared broker and proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import pytest
from support.confluent import close_producers
from support.registry import registry_jar_or_skip

from integration.haproxy import HaproxyFront, StartHaproxy, haproxy_binary, running_haproxy
from kiproxy_dev.apicurio import ApicurioRegistry


@pytest.fixture(autouse=True)
def _close_producers() -> Iterator[None]:
    """Producers made with ``support.confluent.confluent_producer`` end with their test."""
    yield
    close_producers()


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[StartHaproxy]:
    """``haproxy(backend_port, send_proxy="v2"|"v1", bind="127.0.0.1", port=None)``: a started
    HAProxy (``mode tcp``) in front of the port, stopped after the test."""
    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed; `make test` installs it with "
                    "`apt-get install haproxy` (needs root or sudo)")
    with ExitStack() as stack:
        def start(backend_port: int, send_proxy: Literal["v1", "v2"] = "v2",
                  bind: str = "127.0.0.1", port: int | None = None) -> HaproxyFront:
            return stack.enter_context(running_haproxy(
                tmp_path, backend_port, send_proxy=send_proxy, bind=bind, port=port))
        yield start


@pytest.fixture
def start_registry(tmp_path: Path) -> Iterator[Callable[[], ApicurioRegistry]]:
    """``start_registry()``: a started registry of the test's own (to stop and restart),
    stopped after the test."""
    started: list[ApicurioRegistry] = []

    def start() -> ApicurioRegistry:
        registry = ApicurioRegistry(registry_jar_or_skip(),
                                    workdir=tmp_path / f"registry-{len(started)}")
        registry.workdir.mkdir()
        started.append(registry)
        registry.start()
        return registry

    yield start
    for registry in started:
        registry.stop()
