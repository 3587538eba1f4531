"""Whether a listener believes a PROXY header: one decision per mode, peer and header."""

from __future__ import annotations

import pytest

from kiproxy.protocol.proxy_header import (
    Incomplete,
    Local,
    NotProxy,
    ProxyHeader,
    ProxyHeaderError,
)
from kiproxy.proxy.net.proxy_protocol import (
    Refuse,
    UseHeader,
    UsePeer,
    accept_proxy_header,
    trusted_networks,
)

BALANCERS = trusted_networks(("10.0.0.0/24", "fd00::/64"))
BALANCER = ("10.0.0.7", 51000)
STRANGER = ("203.0.113.9", 51000)
HEADER = ProxyHeader(version=2, family="inet", source=("198.51.100.4", 40000),
                     destination=("10.0.0.7", 9092), length=28)


@pytest.mark.parametrize("mode", ["optional", "required"])
def test_a_trusted_balancer_names_the_client(mode: str) -> None:
    assert accept_proxy_header(mode, BALANCERS, BALANCER, HEADER) == \
        UseHeader(("198.51.100.4", 40000), 28)  # type: ignore[arg-type]
    assert accept_proxy_header(mode, BALANCERS, ("fd00::1", 1), HEADER) == \
        UseHeader(("198.51.100.4", 40000), 28)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["optional", "required"])
def test_a_header_from_an_untrusted_peer_is_refused(mode: str) -> None:
    decision = accept_proxy_header(mode, BALANCERS, STRANGER, HEADER)  # type: ignore[arg-type]
    assert isinstance(decision, Refuse)
    assert "203.0.113.9:51000" in decision.reason and "proxy_protocol_trusted" in decision.reason


def test_off_takes_direct_clients_and_refuses_any_header() -> None:
    assert accept_proxy_header("off", (), STRANGER, NotProxy()) == UsePeer()
    decision = accept_proxy_header("off", BALANCERS, BALANCER, HEADER)
    assert isinstance(decision, Refuse) and "proxy_protocol: off" in decision.reason
    bad = accept_proxy_header("off", (), STRANGER, ProxyHeaderError("PROXY v2 header: x"))
    assert isinstance(bad, Refuse) and "proxy_protocol: off" in bad.reason


def test_required_refuses_a_direct_client_optional_takes_it() -> None:
    assert accept_proxy_header("optional", BALANCERS, STRANGER, NotProxy()) == UsePeer()
    decision = accept_proxy_header("required", BALANCERS, BALANCER, NotProxy())
    assert isinstance(decision, Refuse) and "sent no PROXY header" in decision.reason


def test_local_and_unknown_headers_mean_the_peer() -> None:
    assert accept_proxy_header("required", BALANCERS, BALANCER, Local(length=16)) == UsePeer(16)
    unknown = ProxyHeader(version=1, family="unspec", source=None, destination=None, length=15)
    assert accept_proxy_header("optional", BALANCERS, BALANCER, unknown) == UsePeer(15)


def test_malformed_or_unfinished_headers_are_refused_with_the_reason() -> None:
    decision = accept_proxy_header("optional", BALANCERS, BALANCER,
                                   ProxyHeaderError("PROXY v2 header: CRC32C does not match"))
    assert decision == Refuse("client 10.0.0.7:51000: PROXY v2 header: CRC32C does not match",
                             "malformed")
    late = accept_proxy_header("required", BALANCERS, BALANCER, Incomplete(4))
    assert isinstance(late, Refuse) and "in time" in late.reason
