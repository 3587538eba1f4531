"""Routes: the config model, its errors and warnings, and which route a batch gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kiproxy.interceptors import ClientIdentity, InterceptContext
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.config.networks import client_ip
from kiproxy.proxy.routes.runtime import link_names, load_routes
from kiproxy.proxy.routes.table import Route, RouteTable


def _config(tmp_path: Path, text: str) -> ProxyConfig:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(text)
    return load_config(path, {})


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, text)
    return str(caught.value)


def client(**facts: Any) -> ClientIdentity:
    base: dict[str, Any] = {"client_host": "10.1.2.3", "client_port": 40000}
    return ClientIdentity(**(base | facts))


def name(route: Route | None) -> str | None:
    return None if route is None else route.name


TEAMS = """
routes:
  - name: payments
    match: {principal: [payments-svc], topic: "payments\\\\..*"}
    interceptors:
      - class: kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator
        config: {schemas: {}}
  - name: legacy
    match: {client_id: "legacy-batch-.*"}
    interceptors: [{class: tp_common:Identity}]
  - name: outside
    match: {client_address: [10.0.0.0/8, "fd00::/8"], transactional: false}
    interceptors: [{class: a:Mask}, {class: b:Stamp, timeout_ms: 200}]
  - match: {acks: [0, all], listener: default}
    interceptors: [{class: a:Other}]
default:
  interceptors: [{class: a:Reject}]
"""


# ------------------------------------------------------------------ selection

def test_the_first_route_that_holds_handles_the_batch(tmp_path: Path) -> None:
    table = RouteTable.from_config(_config(tmp_path, TEAMS))
    payments = client(principal="payments-svc")
    assert name(table.select(payments, "payments.eu", 1, False)) == "payments"
    assert name(table.select(payments, "payments", 1, False)) == "outside"  # topic fails
    assert name(table.select(client(client_id="legacy-batch-7"), "x", 1, True)) == "legacy"
    assert name(table.select(client(), "x", 1, True)) == "default"  # transactional
    assert name(table.select(client(client_host="192.168.1.1"), "x", -1, True)) == "3"
    assert name(table.select(client(client_host="fd00::5"), "x", 1, False)) == "outside"
    assert name(table.select(client(client_host="::ffff:10.9.9.9"), "x", 1, False)) \
        == "outside"  # an IPv4 client seen through a dual-stack socket


def test_chain_links_keep_their_order_and_settings(tmp_path: Path) -> None:
    route = RouteTable.from_config(_config(tmp_path, TEAMS)).routes[2]
    assert [link.class_name for link in route.links] == ["a:Mask", "b:Stamp"]
    assert [link.timeout_ms for link in route.links] == [5000, 200]


def test_no_route_and_no_default_passes_through(tmp_path: Path) -> None:
    table = RouteTable.from_config(_config(
        tmp_path, "routes: [{match: {topic: orders}, interceptors: [{class: a:B}]}]"))
    assert table.select(client(), "orders", 1, False) is not None
    assert table.select(client(), "orders-eu", 1, False) is None  # the whole name


def test_principal_exact_and_regex_need_a_principal(tmp_path: Path) -> None:
    table = RouteTable.from_config(_config(tmp_path, """
routes:
  - {name: svc, match: {principal_regex: "CN=.*,O=Example"}, interceptors: [{class: a:B}]}
  - {name: alice, match: {principal: alice}, interceptors: [{class: a:B}]}
"""))
    assert name(table.select(client(principal="CN=app,O=Example"), "t", 1, False)) == "svc"
    assert name(table.select(client(principal="alice"), "t", 1, False)) == "alice"
    assert table.select(client(principal="alice2"), "t", 1, False) is None
    assert table.select(client(), "t", 1, False) is None


def test_an_absent_client_id_is_the_empty_string(tmp_path: Path) -> None:
    table = RouteTable.from_config(_config(
        tmp_path, "routes: [{match: {client_id: ''}, interceptors: [{class: a:B}]}]"))
    assert table.select(client(), "t", 1, False) is not None
    assert table.select(client(client_id="app"), "t", 1, False) is None


def test_the_interceptor_shorthand_is_one_route_named_default(tmp_path: Path) -> None:
    config = _config(tmp_path, "interceptor: {class: a:B, timeout_ms: 300}")
    table = RouteTable.from_config(config)
    route = table.select(client(), "anything", 0, True)
    assert route is not None and route.name == "default"
    assert [(link.class_name, link.timeout_ms) for link in route.links] == [("a:B", 300)]
    assert RouteTable.from_config(ProxyConfig()).select(client(), "t", 1, False) is None


def test_selection_is_cached_per_client_and_topic(tmp_path: Path) -> None:
    table = RouteTable.from_config(_config(tmp_path, TEAMS))
    first = table.for_client(client(principal="payments-svc"))
    assert table.for_client(client(principal="payments-svc")) is first
    assert first.select("payments.eu", 1, False) is first.select("payments.eu", 1, False)


def test_identity_rides_on_the_context_with_a_default() -> None:
    ctx = InterceptContext(client_id=None, client_address="", principal=None, api_version=9,
                           acks=1, transactional_id=None, deadline=0.0)
    assert ctx.identity.listener == ""
    assert client(client_host="2001:db8::1", client_port=9).client_address == "[2001:db8::1]:9"


# ------------------------------------------------------------------ errors name the route and key

@pytest.mark.parametrize(("text", "message"), [
    ("routes: [{interceptors: [{class: a:B}]}, {match: {client_address: [10.0.0.0/33]}, "
     "interceptors: [{class: a:B}]}]",
     "routes[1].match.client_address: '10.0.0.0/33' is not a CIDR"),
    ("routes: [{match: {client_address: 10.0.0.1/8}, interceptors: [{class: a:B}]}]",
     "routes[0].match.client_address: '10.0.0.1/8' is not a CIDR (host bits set"),
    ("routes: [{match: {topic: '('}, interceptors: [{class: a:B}]}]",
     "routes[0].match.topic: '(' is not a regular expression"),
    ("routes: [{match: {client_id: '[a'}, interceptors: [{class: a:B}]}]",
     "routes[0].match.client_id: '[a' is not a regular expression"),
    ("routes: [{match: {owner: team-a}, interceptors: [{class: a:B}]}]",
     "routes[0].match.owner: unknown key; valid keys here: topic, principal, "
     "principal_regex, client_id, client_address, listener, transactional, acks"),
    ("routes: [{match: {acks: 2}, interceptors: [{class: a:B}]}]",
     "routes[0].match.acks: 2 is not an acks value"),
    ("routes: [{match: {transactional: 'yes'}, interceptors: [{class: a:B}]}]",
     "routes[0].match.transactional"),
    ("routes: [{match: {}, interceptors: []}]", "routes[0].interceptors"),
    ("routes: [{interceptors: [{class: 'not a class'}]}]",
     "routes[0].interceptors[0].class: 'not a class' must be MODULE:CLASS"),
    ("routes: [{interceptors: [{class: a:B, isolation: thread}]}]",
     "routes[0].interceptors[0].isolation"),
    ("routes: [{name: x, interceptors: [{class: a:B}]}, {name: x, interceptors: [{class: a:B}]}]",
     "routes[1].name: 'x' is already the name of routes[0]"),
    ("interceptor: {class: a:B}\nroutes: [{interceptors: [{class: a:B}]}]",
     "interceptor.class and routes cannot both be set"),
    ("interceptor: {class: a:B}\ndefault: {interceptors: [{class: a:B}]}",
     "interceptor.class and default cannot both be set"),
    ("default: {match: {topic: x}, interceptors: [{class: a:B}]}", "default.match: unknown key"),
])
def test_bad_routes_are_config_errors_naming_the_key(tmp_path: Path, text: str,
                                                      message: str) -> None:
    assert message in _error(tmp_path, text)


def test_interceptor_without_class_still_sets_workers_beside_routes(tmp_path: Path) -> None:
    config = _config(tmp_path, "interceptor: {workers: 4}\nroutes: "
                               "[{interceptors: [{class: a:B, isolation: process}]}]")
    assert config.interceptor.workers == 4


# ------------------------------------------------------------------ warnings at start

def test_routes_that_can_never_match_are_warned_about(tmp_path: Path) -> None:
    config = _config(tmp_path, """
routes:
  - {name: orders, match: {topic: orders}, interceptors: [{class: a:B}]}
  - {match: {topic: orders}, interceptors: [{class: a:C}]}
  - {name: internal, match: {listener: internal}, interceptors: [{class: a:B}]}
  - {name: all, interceptors: [{class: a:B}]}
  - {name: late, match: {acks: 0}, interceptors: [{class: a:B}]}
default: {interceptors: [{class: a:B}]}
""")
    assert config.route_warnings() == [
        "routes[1] can never match: routes[0] (orders) before it has the same match; "
        "merge the two or change one",
        "routes[2] (internal) can never match: match.listener internal names no "
        "configured listener (default)",
        "routes[4] (late) can never match: routes[3] (all) before it matches every batch; "
        "move it up or narrow the earlier match",
        "default (default) is never used: routes[3] (all) matches every batch",
    ]
    assert _config(tmp_path, TEAMS).route_warnings() == []


# ------------------------------------------------------------------ the listener's PROXY protocol

def test_listener_settings(tmp_path: Path) -> None:
    config = _config(tmp_path, "listener: {name: external, proxy_protocol: required, "
                               "proxy_protocol_trusted: [10.0.0.0/8, '::1']}")
    assert config.listener.proxy_protocol_trusted == ("10.0.0.0/8", "::1/128")
    assert _config(tmp_path, "listener: {proxy_protocol: off}").listener.proxy_protocol == "off"
    assert "listener.proxy_protocol_trusted: '300.0.0.0/8' is not a CIDR" in _error(
        tmp_path, "listener: {proxy_protocol: optional, proxy_protocol_trusted: [300.0.0.0/8]}")
    assert "proxy_protocol: required needs proxy_protocol_trusted" in _error(
        tmp_path, "listener: {proxy_protocol: required}")


def test_routes_table_built_from_yaml_is_also_built_from_python() -> None:
    data = yaml.safe_load(TEAMS)
    assert isinstance(RouteTable.from_config(ProxyConfig.model_validate(data)), RouteTable)


@pytest.mark.parametrize(("host", "parsed"), [
    ("10.0.0.1", "10.0.0.1"), ("::ffff:10.1.2.3", "10.1.2.3"), ("fe80::1%eth0", "fe80::1"),
    ("1.2.3", None), ("", None), ("/run/kafka.sock", None)])
def test_client_ip(host: str, parsed: str | None) -> None:
    found = client_ip(host)
    assert (None if found is None else str(found)) == parsed


def test_the_route_benchmark_runs_and_picks_the_last_route() -> None:
    from support.bench import load_bench

    load_bench()  # bench/ is not an installed package
    from bench.routes import measure

    results = measure(50, 1)
    assert set(results) == {"connection", "table", "first sight"}
    assert all(set(by) == {1, 50} for by in results.values())


def test_observe_mode_and_dead_letter_settings_compile(tmp_path: Path) -> None:
    config = _config(tmp_path, """
        upstream: [127.0.0.1:9092]
        routes:
          - name: watch
            match: {topic: "trial|rej-observe"}
            mode: observe
            observe_sample: 0.1
            interceptors: [{class: uppercase}, {class: uppercase, mode: observe}]
          - name: guard
            match: {topic: payments}
            dead_letter: {topic: payments-dlq}
            dead_letter_observed: true
            interceptors: [{class: uppercase}]
    """)
    watch, guard = RouteTable.from_config(config).routes
    assert (watch.observe, watch.observe_sample, watch.dead_letter) == (True, 0.1, None)
    assert [link.mode for link in watch.links] == ["enforce", "observe"]
    assert (guard.observe, guard.dead_letter, guard.dead_letter_observed) == (
        False, "payments-dlq", True)


def test_the_shorthand_takes_a_mode(tmp_path: Path) -> None:
    config = _config(tmp_path, """
        upstream: [127.0.0.1:9092]
        interceptor: {class: uppercase, mode: observe, observe_sample: 0.5}
    """)
    [route] = RouteTable.from_config(config).routes
    assert (route.name, route.observe, route.observe_sample) == ("default", True, 0.5)


@pytest.mark.parametrize(("text", "needle"), [
    ("routes: [{interceptors: [{class: uppercase}], mode: watch}]", "routes[0].mode"),
    ("routes: [{interceptors: [{class: uppercase, mode: log}]}]",
     "routes[0].interceptors[0].mode"),
    ("routes: [{interceptors: [{class: uppercase}], observe_sample: 0}]",
     "routes[0].observe_sample"),
    # accepted before, and every batch judged: a sample only an observing route takes
    ("routes: [{interceptors: [{class: uppercase}], observe_sample: 0.1}]",
     "routes[0]: observe_sample applies in mode: observe only"),
    ("interceptor: {class: uppercase, observe_sample: 0.1}",
     "interceptor: observe_sample applies in mode: observe only"),
    ("routes: [{interceptors: [{class: uppercase}], dead_letter_observed: true}]",
     "dead_letter_observed: true needs dead_letter"),
    ("routes: [{interceptors: [{class: uppercase}], dead_letter: {}}]",
     "routes[0].dead_letter.topic"),
])
def test_rollout_settings_errors_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    assert needle in _error(tmp_path, "upstream: [127.0.0.1:9092]\n" + text)


def test_a_class_repeated_in_a_chain_names_its_later_links_by_occurrence(
        tmp_path: Path) -> None:
    config = _config(tmp_path, """
routes:
  - name: r
    interceptors:
      - {class: uppercase}
      - {class: stamp_headers, config: {headers: {a: "1"}}}
      - {class: uppercase}
      - {class: stamp_headers, config: {headers: {b: "2"}}}
      - {class: uppercase}
""")
    assert link_names(config.routes[0].interceptors) == [
        "uppercase", "stamp_headers", "uppercase#2", "stamp_headers#2", "uppercase#3"]
    loaded = load_routes(config)
    assert loaded is not None and loaded.single is not None
    assert [link.name for link in loaded.single.every] == link_names(
        config.routes[0].interceptors)
