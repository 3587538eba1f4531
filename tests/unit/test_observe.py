"""Observer delivery, the audit file, SASL principal extraction and log formats."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors.observer import Observer, PartitionSummary, RequestInfo, ResponseInfo
from kiproxy.protocol.framing import encode_response_header
from kiproxy.protocol.messages import ApiKey, request_type, response_type, serialize
from kiproxy.proxy.net.sasl import SaslTracker, user_from_token
from kiproxy.proxy.observe.audit import AuditLog
from kiproxy.proxy.observe.hub import ObserverHub
from kiproxy.proxy.observe.logs import JsonFormatter, KeyValueFormatter
from kiproxy.proxy.observe.metrics import Metrics


def _request(api_key: int = 0, correlation_id: int = 1) -> RequestInfo:
    return RequestInfo(api_key=api_key, api_name="Produce" if api_key == 0 else "Metadata",
                       api_version=9, correlation_id=correlation_id, client_id="c",
                       client_address="127.0.0.1:5000", principal=None, size=100,
                       received_at_ms=1_700_000_000_000, node_id=None)


def _produce_response(correlation_id: int, records: int = 3) -> ResponseInfo:
    return ResponseInfo(
        request=_request(0, correlation_id), size=50, latency_ms=1.5, answered_by_proxy=False,
        produce=(PartitionSummary(topic="t", partition=0, batches=1, records=records,
                                  bytes=200, outcome="forwarded", base_offset=correlation_id),))


class _Collect(Observer):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_response(self, info: ResponseInfo) -> None:
        self.seen.append(info.request.correlation_id)


class _Blocked(Observer):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.count = 0

    def on_response(self, info: ResponseInfo) -> None:
        self.release.wait(10)
        self.count += 1


class _Raises(Observer):
    def on_response(self, info: ResponseInfo) -> None:
        raise ValueError("boom")


def test_hub_delivers_in_order_and_close_drains_everything() -> None:
    collect = _Collect()
    hub = ObserverHub([("collect", collect)])
    for i in range(1000):
        hub.response(_produce_response(i))
    hub.close()
    assert collect.seen == list(range(1000))


def test_full_queue_drops_and_counts_without_blocking_the_caller() -> None:
    blocked = _Blocked()
    metrics = Metrics()
    hub = ObserverHub([("blocked", blocked)], metrics=metrics, queue_size=5)
    started = time.monotonic()
    for i in range(50):
        hub.response(_produce_response(i))
    assert time.monotonic() - started < 5  # the caller never waited on the observer
    worker = hub.workers[0]
    assert worker.dropped >= 50 - 5 - 1
    assert metrics.registry.get_sample_value(
        "kiproxy_observer_dropped_events_total", {"observer": "blocked"}) == worker.dropped
    blocked.release.set()
    hub.close()
    assert blocked.count + worker.dropped == 50


def test_raising_observer_is_counted_and_others_still_get_events(
        caplog: pytest.LogCaptureFixture) -> None:
    collect = _Collect()
    metrics = Metrics()
    hub = ObserverHub([("bad", _Raises()), ("good", collect)], metrics=metrics)
    with caplog.at_level(logging.ERROR):
        for i in range(10):
            hub.response(_produce_response(i))
        hub.close()
    assert collect.seen == list(range(10))
    assert metrics.registry.get_sample_value(
        "kiproxy_observer_errors_total", {"observer": "bad"}) == 10
    assert sum("observer bad: on_response failed" in r.message for r in caplog.records) == 1


def test_hub_skips_observers_that_do_not_want_requests() -> None:
    hub = ObserverHub([("collect", _Collect())])
    assert hub.active and hub.wants_responses and not hub.wants_requests
    hub.close()


def test_audit_log_rotates_by_size_keeps_backups_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog()
    audit.configure({"path": str(path), "max_bytes": 2000, "rotate_interval_s": 0,
                     "backups": 3})
    for i in range(100):
        audit.on_response(_produce_response(i))
    audit.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 4  # the current file and 3 backups
    assert audit.rotations > 3
    for f in files:
        assert f.stat().st_size <= 2000
    kept = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    # Pruned files hold the oldest events; what is kept is a contiguous newest run.
    offsets = sorted(e["base_offset"] for e in kept)
    assert offsets == list(range(100 - len(offsets), 100))


def test_audit_log_rotates_by_time_and_keeps_all_with_backups_zero(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog()
    audit.configure({"path": str(path), "max_bytes": 0, "rotate_interval_s": 0.05,
                     "backups": 0})
    for i in range(5):
        audit.on_response(_produce_response(i))
        time.sleep(0.06)
    audit.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 5
    events = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert sorted(e["base_offset"] for e in events) == list(range(5))


def test_audit_event_fields(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog()
    audit.configure({"path": str(path), "requests": True})
    audit.on_response(_produce_response(7, records=4))
    audit.on_response(ResponseInfo(request=_request(3, 8), size=321, latency_ms=0.25,
                                   answered_by_proxy=False))
    audit.close()
    produce, other = (json.loads(x) for x in path.read_text().splitlines())
    assert produce == {
        "event": "produce", "ts": 1_700_000_000_000, "client_id": "c",
        "client_address": "127.0.0.1:5000", "principal": None, "api_version": 9,
        "correlation_id": 7, "topic": "t", "partition": 0, "batches": 1, "records": 4,
        "bytes": 200, "outcome": "forwarded", "route": None, "error_code": 0, "error_message": None,
        "base_offset": 7, "latency_ms": 1.5}
    assert other["event"] == "request" and other["api_name"] == "Metadata"
    assert (other["request_bytes"], other["response_bytes"]) == (100, 321)


def test_audit_log_flushes_on_its_own(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    audit = AuditLog()
    audit.configure({"path": str(path), "flush_interval_ms": 20})
    audit.on_response(_produce_response(1))
    deadline = time.monotonic() + 5
    while not path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.read_text().count("\n") == 1
    audit.close()


def test_audit_requires_a_path() -> None:
    with pytest.raises(ValueError, match=r"audit\.path"):
        AuditLog().configure({})


# ---------------------------------------------------------------------- SASL

def _frame(api_key: int, version: int, **fields: Any) -> tuple[bytes, int]:
    body = serialize(request_type(api_key, version)(**fields))
    header = b"\x00" * 10  # the tracker only reads the body at the offset given
    return header + body, len(header)


@pytest.mark.parametrize(("mechanism", "token", "user"), [
    ("PLAIN", b"\x00alice\x00secret", "alice"),
    ("PLAIN", b"admin\x00alice\x00secret", "admin"),
    ("SCRAM-SHA-256", b"n,,n=bob,r=abc123", "bob"),
    ("SCRAM-SHA-512", b"n,,n=we=2Cird=3Dname,r=x", "we,ird=name"),
    ("SCRAM-SHA-256", b"c=biws,r=abc,p=xyz", None),
    ("GSSAPI", b"\x60\x82", None),
    ("PLAIN", b"broken", None),
])
def test_user_from_token(mechanism: str, token: bytes, user: str | None) -> None:
    assert user_from_token(mechanism, token) == user


@pytest.mark.parametrize("version", [0, 1, 2])
def test_tracker_sets_principal_only_on_success(version: int) -> None:
    from kio.schema.errors import ErrorCode

    flexible = version >= 2
    resp_cls = response_type(ApiKey.SASL_AUTHENTICATE, version)

    def response(code: ErrorCode) -> bytes:
        kwargs: dict[str, Any] = {"error_code": code, "error_message": None,
                                  "auth_bytes": b""}
        if version >= 1:
            import datetime

            kwargs["session_lifetime"] = datetime.timedelta(0)
        return encode_response_header(5, 1 if flexible else 0) + serialize(resp_cls(**kwargs))

    def login(user: str, code: ErrorCode) -> Any:
        tracker = SaslTracker()
        frame, off = _frame(ApiKey.SASL_HANDSHAKE, 1, mechanism="PLAIN")
        tracker.on_handshake(1, frame, off)
        frame, off = _frame(ApiKey.SASL_AUTHENTICATE, version,
                            auth_bytes=b"\x00" + user.encode() + b"\x00pw")
        round_ = tracker.on_authenticate(version, frame, off)
        return tracker.on_response(round_, version, flexible, response(code))

    ok = login("carol", ErrorCode.none)
    assert (ok.user, ok.succeeded) == ("carol", True)
    refused = login("mallory", ErrorCode.sasl_authentication_failed)
    assert (refused.user, refused.succeeded) == ("mallory", False)


# ---------------------------------------------------------------------- logs

def _record(**extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("kiproxy.connection", logging.WARNING, __file__, 1,
                               "closing client %s", ("1.2.3.4:5",), None)
    record.__dict__.update(extra)
    return record


def test_key_value_log_lines_carry_the_client() -> None:
    line = KeyValueFormatter().format(_record(client_address="1.2.3.4:5", client_id="app 1"))
    assert " level=WARNING logger=kiproxy.connection " in line
    assert 'msg="closing client 1.2.3.4:5"' in line
    assert 'client_address=1.2.3.4:5 client_id="app 1"' in line
    assert "\n" not in line


def test_json_log_lines_carry_the_client() -> None:
    data = json.loads(JsonFormatter().format(_record(client_address="1.2.3.4:5",
                                                     client_id=None)))
    assert data["msg"] == "closing client 1.2.3.4:5"
    assert data["client_address"] == "1.2.3.4:5"
    assert "client_id" not in data
