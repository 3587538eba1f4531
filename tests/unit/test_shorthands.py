"""``chain`` and ``topic_router`` written as the interceptor become the routes they stand for.

The config loader rewrites them (with a deprecation warning naming the new shape), so the
runtime owns which topic and in which order; a shape it cannot rewrite exactly is left to
the built-in, which still runs it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kiproxy.interceptors import ClientIdentity
from kiproxy.proxy.config.model import ProxyConfig, load_config
from kiproxy.proxy.routes.runtime import load_routes
from kiproxy.proxy.routes.table import RouteTable

CLIENT = ClientIdentity(client_host="10.1.2.3", client_port=40000)


def _load(tmp_path: Path, text: str) -> ProxyConfig:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(text)
    return load_config(path, {})


CHAIN = """
interceptor:
  class: chain
  timeout_ms: 700
  mode: observe
  workers: 3
  config:
    links:
      - interceptor: trace_context
        config: {sampled: false}
      - uppercase
"""


def test_a_chain_interceptor_becomes_one_route_of_its_links(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiproxy"):
        config = _load(tmp_path, CHAIN)
    assert config.interceptor.class_name is None
    assert config.interceptor.workers == 3  # what holds for every route stays
    [route] = config.routes
    assert (route.name, route.mode) == ("default", "observe")
    assert [(link.class_name, link.config, link.timeout_ms, link.mode)
            for link in route.interceptors] == [
        ("trace_context", {"sampled": False}, 700, "enforce"),
        ("uppercase", {}, 700, "enforce")]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "interceptor: {class: chain} is deprecated" in warning
    assert "routes: [{name: default, interceptors: [{class: ..., config: ...}, ...]}]" \
        in warning
    loaded = load_routes(config)
    assert loaded is not None and loaded.single is not None
    assert [link.name for link in loaded.single.links] == ["trace_context", "uppercase"]


ROUTER = """
interceptor:
  class: kiproxy.interceptors.builtin.route:TopicRouter
  isolation: inline
  config:
    routes:
      - topic: "orders|payments"
        interceptor: json_schema
        config: {schemas: {orders: {type: object}}}
      - {topic: "logs\\\\..*", interceptor: uppercase}
"""


def test_a_topic_router_becomes_a_route_per_topic_pattern(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiproxy"):
        config = _load(tmp_path, ROUTER)
    assert [(r.match.topic, [link.class_name for link in r.interceptors])
            for r in config.routes] == [("orders|payments", ["json_schema"]),
                                        ("logs\\..*", ["uppercase"])]
    assert "each of its routes is now a route" in caplog.records[0].getMessage()
    table = RouteTable.from_config(config)
    chosen = [table.select(CLIENT, topic, -1, False) for topic in
              ("payments", "logs.app", "other")]
    assert [None if r is None else r.name for r in chosen] == ["0", "1", None]


def test_a_chain_link_of_a_route_becomes_its_links_in_place(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kiproxy"):
        config = _load(tmp_path, """
routes:
  - match: {topic: orders}
    interceptors:
      - {class: trace_context}
      - class: chain
        timeout_ms: 300
        config: {links: [uppercase, {interceptor: stamp_headers}]}
""")
    assert [(link.class_name, link.timeout_ms) for link in config.routes[0].interceptors] == [
        ("trace_context", 5000), ("uppercase", 300), ("stamp_headers", 300)]
    assert "routes[0].interceptors[1] (class: chain) is deprecated" \
        in caplog.records[0].getMessage()


def test_a_composite_in_process_isolation_stays_one_interceptor(tmp_path: Path) -> None:
    config = _load(tmp_path, CHAIN.replace("timeout_ms: 700", "isolation: process"))
    assert config.interceptor.class_name == "chain" and config.routes == ()


def test_a_shape_that_cannot_be_rewritten_is_left_to_the_built_in(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "other").mkdir()
    with caplog.at_level(logging.WARNING, logger="kiproxy"):
        config = _load(tmp_path, f"""
interceptor:
  class: chain
  config: {{links: [uppercase], plugins_dir: {tmp_path / 'other'}}}
""")
    assert config.interceptor.class_name == "chain" and config.routes == ()
    assert caplog.records == []
    loaded = load_routes(config)
    assert loaded is not None and loaded.single is not None
    assert type(loaded.single.links[0].interceptor).__name__ == "Chain"
