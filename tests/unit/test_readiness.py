"""``/readyz``'s answer (:meth:`ProxyServer.readiness`): ready once the configured
interceptor is loaded on the side it hooks, every known node has a listener and an
upstream broker accepts a connection."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kiproxy.proxy.config.model import load_config
from kiproxy.proxy.server import ProxyServer

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


@pytest.mark.parametrize("spec", ["tp_fetch:UpperOnConsume",  # fetch side only
                                  "tp_fetch:Reverse",  # both sides
                                  "kiproxy.interceptors.builtin.uppercase:Uppercase"])
async def test_a_loaded_interceptor_is_ready_on_whichever_side_it_hooks(spec: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as broker:
        port = broker.getsockname()[1]
        server = ProxyServer(load_config(None, {
            "upstream": [f"127.0.0.1:{port}"], "plugins_dir": str(PLUGINS),
            "interceptor.class": spec}))
        try:
            assert await server.readiness() is None
        finally:
            server.offload.close()


async def test_an_unreachable_upstream_is_not_ready() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    server = ProxyServer(load_config(None, {"upstream": [f"127.0.0.1:{port}"]}))
    try:
        why = await server.readiness()
        assert why is not None and f"127.0.0.1:{port}" in why
    finally:
        server.offload.close()
