"""WebAssembly interceptors and the header middleware end to end.

A real broker (Tansu), kiproxy as a subprocess, confluent-kafka producing and
consuming. Two proxies are shared by the whole module: one runs
WasmInterceptor with a module per topic, the other TopicRouter with one
middleware (or Chain) per topic prefix. What is asserted is what a consumer
reads, and what a producer is told when its batch is rejected.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TESTS, ProxyProcess, consume, launch_proxy

from kiproxy.interceptors import Header, Record
from kiproxy.interceptors.builtin.signing import signature
from kiproxy.interceptors.builtin.trace import traceparent_problem
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(120)

INVALID_RECORD = 87
POLICY_VIOLATION = 44
TIMEOUT_MS = 3000
SECRET = "integration-secret"


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None, Any]],
            timeout: float = 20) -> list[Any]:
    """Produce ``records`` (key, value, headers) to partition 0 in one batch where possible;
    return each record's delivery error (None when delivered), in order."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 100,
                         "message.timeout.ms": int(timeout * 1000), "retries": 0})
    reports: dict[int, Any] = {}
    for i, (key, value, headers) in enumerate(records):
        producer.produce(topic, key=key, value=value, headers=headers, partition=0,
                         on_delivery=lambda err, msg, i=i: reports.__setitem__(i, err))
    producer.flush(timeout + 5)
    assert len(reports) == len(records), "every record gets a delivery report"
    return [reports[i] for i in range(len(records))]


def rejection_message(bootstrap: str, topic: str, value: bytes,
                      headers: list[tuple[str, bytes]] | None = None) -> str:
    """The error a producer reports for ``value`` (kafka-python surfaces the proxy's
    ``error_message``/``record_errors``; librdkafka only the error code)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, retries=0)
    try:
        producer.send(topic, value, headers=headers or [], partition=0).get(20)
    except Exception as exc:
        return str(exc)
    finally:
        producer.close(5)
    raise AssertionError(f"{value!r} was not rejected")


def headers_of(message: Any) -> list[tuple[str, bytes | None]]:
    return [(k, None if v is None else bytes(v)) for k, v in (message.headers() or [])]


def assert_rejected(errors: list[Any], code: int) -> None:
    assert all(e is not None and e.code() == code for e in errors), errors


# ---------------------------------------------------------------------------- fixtures

WASM_TOPICS = {"up": _name("wasm-up"), "up2": _name("wasm-up2"), "shout": _name("wasm-shout"),
               "spin": _name("wasm-spin"), "json": _name("wasm-json")}


@pytest.fixture(scope="module")
def wasm_proxy(broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    uppercase = str(ROOT / "examples" / "wasm" / "uppercase.wat")
    # The examples declare their entry, ABI and encoding: a path (and `abi: 2` to pick the
    # batch entry) is all the config says; `json` overrides the declared encoding on purpose.
    config = {
        "topics": {
            WASM_TOPICS["up"]: uppercase,
            WASM_TOPICS["up2"]: {"module": uppercase, "abi": 2},
            WASM_TOPICS["shout"]: str(ROOT / "examples" / "wasm" / "reject_shouting.wat"),
            WASM_TOPICS["json"]: {"module": uppercase, "encoding": "json"},
            WASM_TOPICS["spin"]: {"module": str(TESTS / "wasm" / "faults.wat"),
                                  "function": "spin_on_bang", "fuel": 200_000_000},
        },
    }
    p = launch_proxy(broker.bootstrap, "--interceptor-timeout-ms", str(TIMEOUT_MS),
                     interceptor="kiproxy.interceptors.builtin.wasm:WasmInterceptor",
                     interceptor_config=config)
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


ROUTES: list[dict[str, Any]] = [
    {"topic": "trail-east-.*", "interceptor": "kiproxy.interceptors.builtin.paper_trail:PaperTrail",
     "config": {"cluster": "east", "host": "kp-east"}},
    {"topic": "trail-west-.*", "interceptor": "kiproxy.interceptors.builtin.paper_trail:PaperTrail",
     "config": {"cluster": "west", "host": "kp-west"}},
    {"topic": "trace-.*", "interceptor": "kiproxy.interceptors.builtin.trace:TraceContext",
     "config": {"on_invalid": "reject"}},
    {"topic": "authz-.*", "interceptor": "kiproxy.interceptors.builtin.authz:HeaderTokenAuthorizer",
     "config": {"tokens": {"*": "tok-123"}}},
    {"topic": "pii-.*", "interceptor": "kiproxy.interceptors.builtin.pii:PiiMasker",
     "config": {"rules": {"no_ssn": {"builtin": "ssn", "action": "reject"}},
                "topics": {"*": ["email", "card", "no_ssn"]}}},
    {"topic": "signed-.*", "interceptor": "kiproxy.interceptors.builtin.chain:Chain",
     "config": {"links": [{"interceptor": "kiproxy.interceptors.builtin.signing:Signer",
                           "config": {"keys": {"k1": SECRET}, "headers": ["tenant"],
                                      "require_headers": True}}]}},
    {"topic": "verified-.*", "interceptor": "kiproxy.interceptors.builtin.chain:Chain",
     "config": {"links": [
         {"interceptor": "kiproxy.interceptors.builtin.signing:SignatureVerifier",
          "config": {"keys": {"k1": SECRET}, "headers": ["tenant"]}},
         {"interceptor": "kiproxy.interceptors.builtin.paper_trail:PaperTrail",
          "config": {"cluster": "core"}}]}},
]


@pytest.fixture(scope="module")
def middleware_proxy(broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    p = launch_proxy(broker.bootstrap, interceptor="kiproxy.interceptors.builtin.route:TopicRouter",
                     interceptor_config={"routes": ROUTES})
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


HEADERS = [("h", b"1"), ("n", None), ("h", b"2")]


# ---------------------------------------------------------------------------- Wasm


@pytest.mark.parametrize("which", ["up", "up2"])
def test_uppercase_wat_transforms_through_the_proxy(wasm_proxy: ProxyProcess,
                                                    which: str) -> None:
    topic = WASM_TOPICS[which]
    records = [(b"k1", b"hello kafka", HEADERS), (None, b"MiXeD", []), (b"k3", None, HEADERS)]
    assert produce(wasm_proxy.bootstrap, topic, records) == [None, None, None]
    got = consume(wasm_proxy.bootstrap, topic, 3)
    assert [(m.key(), m.value(), headers_of(m)) for m in got] == [
        (b"k1", b"HELLO KAFKA", HEADERS), (None, b"MIXED", []), (b"k3", None, HEADERS)]


def test_an_encoding_the_module_does_not_declare_is_named_in_the_rejection(
        wasm_proxy: ProxyProcess) -> None:
    topic = WASM_TOPICS["json"]
    assert_rejected(produce(wasm_proxy.bootstrap, topic, [(None, b"hello", [])]), INVALID_RECORD)
    message = rejection_message(wasm_proxy.bootstrap, topic, b"hello")
    assert "uppercase.wat (transform, abi v1) trapped" in message
    assert ("The host and the module disagree: the config sets encoding json but the module "
            "declares binary for 'transform'") in message
    wasm_proxy.wait_for_line("the config sets encoding json but the module declares binary")


def test_reject_shouting_wat_rejects_the_whole_batch(wasm_proxy: ProxyProcess) -> None:
    topic = WASM_TOPICS["shout"]
    errors = produce(wasm_proxy.bootstrap, topic, [(None, b"calm", []), (None, b"LOUD!", [])])
    assert_rejected(errors, INVALID_RECORD)
    assert produce(wasm_proxy.bootstrap, topic, [(None, b"still calm", [])]) == [None]
    assert [m.value() for m in consume(wasm_proxy.bootstrap, topic, 1)] == [b"still calm"]
    wasm_proxy.wait_for_line("reject_shouting.wat (transform, abi v1) rejected record 1")
    wasm_proxy.wait_for_line("value is all upper case")


def test_an_infinite_loop_runs_out_of_fuel_within_the_deadline(wasm_proxy: ProxyProcess) -> None:
    topic = WASM_TOPICS["spin"]
    assert produce(wasm_proxy.bootstrap, topic, [(None, b"warm-up", [])]) == [None]
    started = time.monotonic()
    errors = produce(wasm_proxy.bootstrap, topic, [(None, b"!loop forever", [])])
    elapsed = time.monotonic() - started
    assert_rejected(errors, INVALID_RECORD)
    assert elapsed < TIMEOUT_MS / 1000, f"rejected after {elapsed:.2f} s"
    message = rejection_message(wasm_proxy.bootstrap, topic, b"!again")
    assert "faults.wat (spin_on_bang, abi v1) ran out of fuel (200000000 per batch)" in message
    # The instance was reset and the proxy serves the next batch.
    assert produce(wasm_proxy.bootstrap, topic, [(None, b"next", [])]) == [None]
    assert [m.value() for m in consume(wasm_proxy.bootstrap, topic, 2)] == [b"warm-up", b"next"]


def test_a_replaced_module_file_is_served_without_a_restart(broker: EmbeddedBroker,
                                                            tmp_path: Path) -> None:
    module = tmp_path / "live.wat"
    shutil.copyfile(ROOT / "examples" / "wasm" / "uppercase.wat", module)
    proxy = launch_proxy(broker.bootstrap, interceptor="wasm",
                         interceptor_config={"module": str(module), "reload_interval_ms": 0})
    try:
        topic = _name("wasm-live")
        assert produce(proxy.bootstrap, topic, [(None, b"before", [])]) == [None]
        # Swap the module the way the README advises: write aside, then rename over it.
        staged = tmp_path / "staged.wat"
        shutil.copyfile(ROOT / "examples" / "wasm" / "reject_shouting.wat", staged)
        os.replace(staged, module)
        assert_rejected(produce(proxy.bootstrap, topic, [(None, b"LOUD", [])]), INVALID_RECORD)
        assert produce(proxy.bootstrap, topic, [(None, b"after", [])]) == [None]
        assert [m.value() for m in consume(proxy.bootstrap, topic, 2)] == [b"BEFORE", b"after"]
        assert "reloaded (file changed)" in proxy.log
        assert proxy.alive()
    finally:
        proxy.stop()


# ---------------------------------------------------------------------------- middleware


def test_paper_trail_across_a_mirror(middleware_proxy: ProxyProcess) -> None:
    suffix = uuid.uuid4().hex[:8]
    east, west = f"trail-east-{suffix}", f"trail-west-{suffix}"
    bootstrap = middleware_proxy.bootstrap
    assert produce(bootstrap, east, [(b"k", b"v", HEADERS)]) == [None]
    (first,) = consume(bootstrap, east, 1)
    assert headers_of(first)[:3] == HEADERS
    # A mirror copies the record, headers and all, into the other cluster's topic.
    assert produce(bootstrap, west, [(first.key(), first.value(), headers_of(first))]) == [None]
    (mirrored,) = consume(bootstrap, west, 1)
    trail = [Record(headers=[Header(k, v)]) for k, v in headers_of(mirrored)
             if k == "kiproxy-trail"]
    from kiproxy.interceptors.builtin.paper_trail import trail_entries

    entries = [e for r in trail for e in trail_entries(r)]
    assert [(e["cluster"], e["topic"], e["host"]) for e in entries] == [
        ("east", east, "kp-east"), ("west", west, "kp-west")]
    assert all(isinstance(e["ts"], int) and e["ts"] > 1_600_000_000_000 for e in entries)
    assert headers_of(mirrored)[:3] == HEADERS
    # Mirroring it back into east is a loop.
    errors = produce(bootstrap, east, [(b"k", b"v", headers_of(mirrored))])
    assert_rejected(errors, POLICY_VIOLATION)
    middleware_proxy.wait_for_line("routing loop")


def test_trace_context(middleware_proxy: ProxyProcess) -> None:
    topic = f"trace-{uuid.uuid4().hex[:8]}"
    existing = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    records = [(None, b"a", HEADERS), (None, b"b", [("traceparent", existing), ("h", b"x")])]
    assert produce(middleware_proxy.bootstrap, topic, records) == [None, None]
    first, second = consume(middleware_proxy.bootstrap, topic, 2)
    assert headers_of(first)[:3] == HEADERS and headers_of(first)[3][0] == "traceparent"
    assert traceparent_problem(headers_of(first)[3][1]) is None
    assert headers_of(second) == [("traceparent", existing), ("h", b"x")]
    errors = produce(middleware_proxy.bootstrap, topic, [(None, b"c", [("traceparent", b"bad")])])
    assert_rejected(errors, INVALID_RECORD)
    middleware_proxy.wait_for_line("carry an invalid traceparent")


def test_header_token_authorizer(middleware_proxy: ProxyProcess) -> None:
    topic = f"authz-{uuid.uuid4().hex[:8]}"
    token = ("kiproxy-token", b"tok-123")
    assert produce(middleware_proxy.bootstrap, topic,
                   [(None, b"ok", [("a", b"1"), token, ("a", b"2")])]) == [None]
    (message,) = consume(middleware_proxy.bootstrap, topic, 1)
    assert headers_of(message) == [("a", b"1"), ("a", b"2")], "the token is not stored"
    errors = produce(middleware_proxy.bootstrap, topic,
                     [(None, b"x", [token]), (None, b"y", [("kiproxy-token", b"guess")])])
    assert_rejected(errors, POLICY_VIOLATION)
    middleware_proxy.wait_for_line("its kiproxy-token is not valid for topic")
    assert "guess" not in middleware_proxy.log


def test_pii_masker(middleware_proxy: ProxyProcess) -> None:
    topic = f"pii-{uuid.uuid4().hex[:8]}"
    records = [(b"k", b"mail jo@example.com card 4111 1111 1111 1111", HEADERS),
               (b"k", b"nothing personal", [])]
    assert produce(middleware_proxy.bootstrap, topic, records) == [None, None]
    got = consume(middleware_proxy.bootstrap, topic, 2)
    assert [(m.value(), headers_of(m)) for m in got] == [
        (b"mail ***@*** card ****-****-****-1111", HEADERS), (b"nothing personal", [])]
    errors = produce(middleware_proxy.bootstrap, topic, [(None, b"ssn 123-45-6789", [])])
    assert_rejected(errors, POLICY_VIOLATION)
    middleware_proxy.wait_for_line("matches rule 'no_ssn'")


def test_signed_stream_verified_behind_chain(middleware_proxy: ProxyProcess) -> None:
    suffix = uuid.uuid4().hex[:8]
    signed_topic, verified_topic = f"signed-{suffix}", f"verified-{suffix}"
    bootstrap = middleware_proxy.bootstrap
    records = [(b"k1", b"one", [("tenant", b"acme"), ("h", b"1"), ("h", b"2")]),
               (None, b"two", [("tenant", b"acme")])]
    assert produce(bootstrap, signed_topic, records) == [None, None]
    signed = consume(bootstrap, signed_topic, 2)
    for message, (key, value, headers) in zip(signed, records, strict=True):
        assert headers_of(message)[:-1] == headers
        name, sig = headers_of(message)[-1]
        expected = signature(Record(key=key, value=value, headers=headers), "k1",
                             SECRET.encode(), ["tenant"])
        assert (name, sig) == ("kiproxy-signature", expected)
    # The signed stream, copied on to a topic whose Chain verifies first, passes.
    copies = [(m.key(), m.value(), headers_of(m)) for m in signed]
    assert produce(bootstrap, verified_topic, copies) == [None, None]
    verified = consume(bootstrap, verified_topic, 2)
    assert [m.value() for m in verified] == [b"one", b"two"]
    assert [k for k, _ in headers_of(verified[0])][-2:] == ["kiproxy-signature", "kiproxy-trail"]
    # A tampered record is rejected (with its untouched neighbour: the batch is one unit).
    key, _, headers = copies[1]
    errors = produce(bootstrap, verified_topic, [copies[0], (key, b"TWO", headers)])
    assert_rejected(errors, POLICY_VIOLATION)
    # The router's chain is the links of a route of the proxy: the verifier's own message.
    middleware_proxy.wait_for_line(
        f"SignatureVerifier: 1 record(s) of {verified_topic}[0] failed signature verification")
    middleware_proxy.wait_for_line("signature does not match (key k1)")
    assert "signature does not match" in rejection_message(bootstrap, verified_topic,
                                                           b"forged", headers)
    # A record without the covered header cannot be signed.
    errors = produce(bootstrap, signed_topic, [(None, b"anonymous", [])])
    assert_rejected(errors, INVALID_RECORD)
    middleware_proxy.wait_for_line("lacks header(s) tenant")
