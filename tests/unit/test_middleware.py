"""The header middleware through the interceptor API: PaperTrail, TraceContext, Signer and
SignatureVerifier, HeaderTokenAuthorizer, PiiMasker and Chain.

Each one: what a record looks like after it (header order and duplicates kept), and how
it rejects - with a message that says which record and why.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.interceptors import (
    AcknowledgedBatch,
    Header,
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin.authz import HeaderTokenAuthorizer
from kiproxy.interceptors.builtin.chain import Chain
from kiproxy.interceptors.builtin.paper_trail import PaperTrail, trail_entries
from kiproxy.interceptors.builtin.pii import PiiMasker
from kiproxy.interceptors.builtin.signing import (
    SignatureVerifier,
    Signer,
    signature,
    signing_message,
)
from kiproxy.interceptors.builtin.trace import TraceContext, traceparent_problem

INVALID_RECORD = 87
POLICY_VIOLATION = 44

HEADERS = (Header("h", b"1"), Header("n", None), Header("h", b"2"))


def ctx() -> InterceptContext:
    return InterceptContext(client_id="app", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 5, received_at_ms=1_700_000_000_000,
                            proxy_host="proxy-a")


def batch(*records: Record, topic: str = "orders") -> RecordBatch:
    return RecordBatch(topic=topic, partition=0, records=records)


def rec(value: bytes | None = b"v", headers: Any = HEADERS, key: bytes | None = b"k") -> Record:
    return Record(key=key, value=value, headers=headers, timestamp=1)


def configured(cls: type[Any], **config: Any) -> Any:
    plugin = cls()
    plugin.configure(config)
    return plugin


def run(plugin: Any, b: RecordBatch) -> RecordBatch:
    result = plugin.intercept(b, ctx())
    assert isinstance(result, RecordBatch)
    return result


def rejection(plugin: Any, b: RecordBatch) -> RejectBatch:
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(b, ctx())
    return info.value


# ---------------------------------------------------------------------------- PaperTrail


def test_paper_trail_appends_an_entry_after_the_existing_headers() -> None:
    out = run(configured(PaperTrail, cluster="east"), batch(rec(), rec(headers=())))
    first = out.records[0]
    assert first.headers[:3] == HEADERS
    assert first.headers[3].key == "kiproxy-trail"
    assert json.loads(first.headers[3].value or b"") == {
        "host": "proxy-a", "cluster": "east", "topic": "orders", "ts": 1_700_000_000_000}
    assert len(out.records[1].headers) == 1


def test_paper_trail_keeps_earlier_entries_across_mirrored_clusters() -> None:
    east = configured(PaperTrail, cluster="east", host="kp-east")
    west = configured(PaperTrail, cluster="west", host="kp-west")
    record = run(east, batch(rec())).records[0]
    # MirrorMaker copies the record, headers and all, to west's "east.orders".
    record = run(west, batch(record, topic="east.orders")).records[0]
    assert [(e["cluster"], e["topic"], e["host"]) for e in trail_entries(record)] == [
        ("east", "orders", "kp-east"), ("west", "east.orders", "kp-west")]
    assert record.headers[:3] == HEADERS


def test_paper_trail_rejects_a_mirroring_loop() -> None:
    east = configured(PaperTrail, cluster="east")
    west = configured(PaperTrail, cluster="west")
    looped = run(west, batch(run(east, batch(rec())).records[0], topic="east.orders"))
    exc = rejection(east, batch(rec(), looped.records[0]))
    assert exc.error_code == POLICY_VIOLATION
    assert "record 1" in exc.message and "routing loop" in exc.message
    assert "east/orders -> west/east.orders" in exc.message
    assert [i for i, _ in exc.record_errors] == [1]
    allowed = configured(PaperTrail, cluster="east", reject_loops=False)
    assert len(trail_entries(run(allowed, batch(looped.records[0])).records[0])) == 3


def test_paper_trail_max_hops_counts_foreign_entries_too() -> None:
    noisy = rec(headers=[Header("kiproxy-trail", b"not json")] * 3)
    exc = rejection(configured(PaperTrail, cluster="c", max_hops=3), batch(noisy))
    assert "already has 3 entries (max_hops 3)" in exc.message
    out = run(configured(PaperTrail, cluster="c", max_hops=0), batch(noisy))
    assert [h.value for h in out.records[0].headers][:3] == [b"not json"] * 3


@pytest.mark.parametrize(("config", "message"), [
    ({}, "cluster: required key is missing"),
    ({"cluster": "c", "hops": 1}, "hops: unknown key; did you mean host?"),
    ({"cluster": "c", "max_hops": -1}, "max_hops: must be at least 0, got -1"),
])
def test_paper_trail_config_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PaperTrail().configure(config)


# ---------------------------------------------------------------------------- TraceContext


def test_trace_context_adds_a_traceparent_where_none_is() -> None:
    out = run(configured(TraceContext), batch(rec(), rec()))
    values = []
    for record in out.records:
        assert record.headers[:3] == HEADERS
        assert record.headers[3].key == "traceparent"
        value = record.headers[3].value
        assert traceparent_problem(value) is None
        assert value is not None and re.fullmatch(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-01", value)
        values.append(value)
    assert values[0][3:35] != values[1][3:35], "each record starts its own trace"


def test_trace_context_keeps_a_valid_traceparent() -> None:
    existing = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    b = batch(rec(headers=(*HEADERS, Header("traceparent", existing))))
    assert run(configured(TraceContext), b) is b


def test_trace_context_unsampled_flag() -> None:
    out = run(configured(TraceContext, sampled=False), batch(rec(headers=())))
    assert (out.records[0].headers[0].value or b"").endswith(b"-00")


@pytest.mark.parametrize(("value", "problem"), [
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
    (b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", None),
    (b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "lower-case hex"),
    (b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version ff"),
    (b"00-00000000000000000000000000000000-00f067aa0ba902b7-01", "trace-id is all zeros"),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "parent-id is all zeros"),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", "exactly four fields"),
    (None, "null"),
])
def test_traceparent_validation(value: bytes | None, problem: str | None) -> None:
    found = traceparent_problem(value)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_trace_context_replaces_an_invalid_traceparent_in_place() -> None:
    bad = (Header("a", b"1"), Header("traceparent", b"garbage"), Header("b", b"2"),
           Header("traceparent", b"more"))
    out = run(configured(TraceContext), batch(rec(headers=bad))).records[0]
    assert [h.key for h in out.headers] == ["a", "traceparent", "b"]
    assert traceparent_problem(out.headers[1].value) is None
    kept = run(configured(TraceContext, on_invalid="keep"), batch(rec(headers=bad))).records[0]
    assert kept.headers == bad


def test_trace_context_can_reject_an_invalid_traceparent() -> None:
    plugin = configured(TraceContext, on_invalid="reject")
    exc = rejection(plugin, batch(rec(headers=()),
                                  rec(headers=[Header("traceparent", b"00-zz")])))
    assert exc.error_code == INVALID_RECORD
    assert "1 record(s) of orders[0] carry an invalid traceparent; first, record 1" in exc.message
    assert exc.record_errors[0][0] == 1


# ---------------------------------------------------------------------------- signing

KEYS = {"k1": "s3cret-one", "k0": "old-secret"}


def signer(**config: Any) -> Signer:
    return configured(Signer, **{"keys": {"k1": KEYS["k1"]}, **config})  # type: ignore[no-any-return]


def verifier(**config: Any) -> SignatureVerifier:
    return configured(SignatureVerifier, **{"keys": KEYS, **config})  # type: ignore[no-any-return]


def test_signing_message_layout() -> None:
    record = Record(key=None, value=b"v", headers=[("t", b"x"), ("t", None)])
    assert signing_message(record, ["t", "absent"], topic="orders") == (
        b"kiproxy-sig-v1\n"
        + b"\x00\x00\x00\x06orders" + b"\xff\xff\xff\xff" + b"\x00\x00\x00\x01v"
        + b"\x00\x00\x00\x01t" + b"\x00\x00\x00\x02" + b"\x00\x00\x00\x01x" + b"\xff\xff\xff\xff"
        + b"\x00\x00\x00\x06absent" + b"\x00\x00\x00\x00")


def test_signer_appends_a_signature_that_the_verifier_accepts() -> None:
    signed = run(signer(headers=["h"]), batch(rec(), rec(value=None, key=None)))
    for record in signed.records:
        assert record.headers[:3] == HEADERS
        value = record.headers[3].value or b""
        assert record.headers[3].key == "kiproxy-signature"
        assert re.fullmatch(rb"v1:k1:[0-9a-f]{64}", value)
    v = verifier(headers=["h"])
    assert run(v, signed) is signed
    stripped = run(verifier(headers=["h"], strip=True), signed)
    assert stripped.records[0].headers == HEADERS


def test_signature_matches_the_documented_hmac() -> None:
    import hmac as hmac_lib

    record = rec()
    expected = hmac_lib.new(b"s3cret-one", signing_message(record, ["h"]), hashlib.sha256)
    assert signature(record, "k1", b"s3cret-one", ["h"]) == \
        f"v1:k1:{expected.hexdigest()}".encode()


@pytest.mark.parametrize(("tamper", "problem"), [
    (lambda r: r.with_value(b"changed"), "signature does not match (key k1)"),
    (lambda r: r.with_key(None), "signature does not match"),
    (lambda r: r.with_headers([h for h in r.headers if h.key != "h" or h.value != b"2"]),
     "signature does not match"),
    (lambda r: r.with_headers(h for h in r.headers if h.key != "kiproxy-signature"),
     "has no kiproxy-signature header"),
    (lambda r: r.with_header("kiproxy-signature", b"v1:k1:00"), "has 2 kiproxy-signature"),
    (lambda r: r.with_headers([*r.headers[:-1], Header("kiproxy-signature", b"junk")]),
     "is not v1:<key id>:<hex digest>"),
    (lambda r: r.with_headers([*r.headers[:-1], Header("kiproxy-signature",
                                                        b"v1:k9:" + b"0" * 64)]),
     "unknown key id 'k9'"),
    # a digest that is not 64 hex digits is malformed, not a mismatch
    (lambda r: r.with_headers([*r.headers[:-1], Header("kiproxy-signature", b"v1:k1:zz")]),
     "is not v1:<key id>:<hex digest>"),
    (lambda r: r.with_headers([*r.headers[:-1], Header("kiproxy-signature", b"v1:k1:0000")]),
     "is not v1:<key id>:<hex digest>"),
])
def test_the_verifier_rejects_tampered_or_unsigned_records(tamper: Any, problem: str) -> None:
    signed = run(signer(headers=["h"]), batch(rec(), rec(b"other")))
    tampered = batch(signed.records[0], tamper(signed.records[1]))
    exc = rejection(verifier(headers=["h"]), tampered)
    assert exc.error_code == POLICY_VIOLATION
    assert "SignatureVerifier: 1 record(s) of orders[0] failed signature verification; " \
           "first, record 1" in exc.message
    assert problem in exc.message
    assert exc.record_errors[0][0] == 1


def test_headers_that_are_not_covered_may_be_added() -> None:
    signed = run(signer(headers=["h"]), batch(rec()))
    extended = batch(signed.records[0].with_header("added-later", b"x"))
    assert run(verifier(headers=["h"]), extended) is extended


def test_key_rotation_old_signatures_still_verify() -> None:
    old = configured(Signer, keys={"k0": KEYS["k0"]})
    new = signer()
    b = batch(run(old, batch(rec())).records[0], run(new, batch(rec())).records[0])
    assert run(verifier(), b) is b


def test_include_topic_binds_the_signature_to_the_topic() -> None:
    signed = run(signer(include_topic=True), batch(rec()))
    moved = batch(*signed.records, topic="payments")
    assert "signature does not match" in rejection(verifier(include_topic=True), moved).message
    assert run(verifier(include_topic=True), signed) is signed


def test_secrets_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SIGNING_KEY", KEYS["k1"])
    (tmp_path / "k1").write_text(KEYS["k1"] + "\n")
    signed = run(configured(Signer, keys={"k1": {"env": "TEST_SIGNING_KEY"}}), batch(rec()))
    from_file = configured(SignatureVerifier, keys={"k1": {"file": str(tmp_path / "k1")}})
    assert run(from_file, signed) is signed


def test_signer_existing_signature_and_required_headers() -> None:
    signed = run(signer(), batch(rec()))
    resigned = run(signer(), signed).records[0]
    assert [h.key for h in resigned.headers].count("kiproxy-signature") == 1
    kept = run(signer(on_existing="keep"), signed)
    assert kept.records[0] is signed.records[0]
    exc = rejection(signer(on_existing="reject"), signed)
    assert exc.error_code == INVALID_RECORD and "is already signed" in exc.message
    exc = rejection(signer(headers=["tenant", "h"], require_headers=True), batch(rec()))
    assert "Signer: 1 record(s) of orders[0] cannot be signed; first, record 0: lacks " \
           "header(s) tenant" in exc.message


@pytest.mark.parametrize(("cls", "config", "message"), [
    (Signer, {}, "keys: required key is missing"),
    (Signer, {"keys": KEYS}, "key_id is required when keys holds more than one key"),
    (Signer, {"keys": KEYS, "key_id": "k7"}, "key_id 'k7' is not one of keys"),
    (Signer, {"keys": {"a:b": "x"}}, "must be non-empty without ':'"),
    (SignatureVerifier, {"keys": {"k": {"env": "KIPROXY_TEST_UNSET_VAR"}}},
     "keys.k: environment variable KIPROXY_TEST_UNSET_VAR is not set"),
    (SignatureVerifier, {"keys": KEYS, "headers": ["kiproxy-signature"]},
     "must not include the signature header"),
    (SignatureVerifier, {"keys": KEYS, "on_existing": "keep"}, "on_existing: unknown key"),
])
def test_signing_config_errors(cls: type[Any], config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        cls().configure(config)


# ---------------------------------------------------------------------------- authorizer


def token_rec(*tokens: bytes | None, value: bytes = b"v") -> Record:
    return rec(value, headers=[Header("a", b"1"), *(Header("kiproxy-token", t) for t in tokens),
                               Header("a", b"2")])


def test_a_valid_token_passes_and_is_stripped() -> None:
    plugin = configured(HeaderTokenAuthorizer, tokens={"orders": ["t-one", "t-two"]})
    out = run(plugin, batch(token_rec(b"t-two"), token_rec(b"wrong", b"t-one")))
    for record in out.records:
        assert record.headers == (Header("a", b"1"), Header("a", b"2"))
    b = batch(token_rec(b"t-one"))
    assert run(configured(HeaderTokenAuthorizer, tokens={"orders": "t-one"}, strip=False), b) is b


def test_tokens_as_sha256_digests_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hashlib.sha256(b"hashed-token").hexdigest()
    monkeypatch.setenv("TEST_TOKEN", "env-token")
    plugin = configured(HeaderTokenAuthorizer,
                        tokens={"orders": [f"sha256:{digest}", {"env": "TEST_TOKEN"}]})
    out = run(plugin, batch(token_rec(b"hashed-token"), token_rec(b"env-token")))
    # Both records pass, their token header stripped (strip is on by default).
    assert [list(r.headers) for r in out.records] == [[Header("a", b"1"), Header("a", b"2")]] * 2
    # The env token is read at configure time; a wrong token is still refused.
    exc = rejection(plugin, batch(token_rec(b"sha256:" + digest.encode())))
    assert exc.record_errors == ((0, "its kiproxy-token is not valid for topic 'orders'"),)


def test_records_without_a_valid_token_reject_the_batch() -> None:
    plugin = configured(HeaderTokenAuthorizer, tokens={"orders": "t-one"})
    exc = rejection(plugin, batch(token_rec(b"t-one"), token_rec(), token_rec(b"guess")))
    assert exc.error_code == POLICY_VIOLATION
    assert "HeaderTokenAuthorizer: 2 record(s) of orders[0] are not authorized; first, " \
           "record 1: has no kiproxy-token header" in exc.message
    assert exc.record_errors == ((1, "has no kiproxy-token header"),
                                 (2, "its kiproxy-token is not valid for topic 'orders'"))
    assert "guess" not in exc.message and "t-one" not in exc.message


@pytest.mark.parametrize(("config", "message"), [
    ({}, "tokens: required key is missing"),
    ({"tokens": {"t": "sha256:abc"}}, "tokens.t[0]: a sha256: token needs 64 hex digits"),
    ({"tokens": {"t": []}}, "tokens.t: needs at least 1 item(s), got an empty list"),
    ({"tokens": {}}, "tokens: needs at least 1 item(s), got an empty mapping"),
    ({"tokens": {"t": "x"}, "header": ""}, "header: must not be empty"),
    ({"tokens": {"t": "x"}, "unlisted": "maybe"},
     "unlisted: expected 'deny' or 'allow', got 'maybe'"),
])
def test_authorizer_config_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        HeaderTokenAuthorizer().configure(config)


def test_wildcard_and_unlisted_topics() -> None:
    wildcard = configured(HeaderTokenAuthorizer, tokens={"orders": "a", "*": "any"})
    run(wildcard, batch(token_rec(b"any"), topic="logs"))
    assert "not valid for topic 'orders'" in rejection(wildcard, batch(token_rec(b"any"))).message
    deny = configured(HeaderTokenAuthorizer, tokens={"orders": "a"})
    exc = rejection(deny, batch(token_rec(b"a"), topic="logs"))
    assert "no token is configured for topic 'logs'" in exc.message
    allow = configured(HeaderTokenAuthorizer, tokens={"orders": "a"}, unlisted="allow")
    b = batch(token_rec(), topic="logs")
    assert run(allow, b) is b


# ---------------------------------------------------------------------------- PiiMasker


def test_pii_masker_masks_emails_and_card_numbers() -> None:
    plugin = configured(PiiMasker, topics={"orders": ["email", "card"]})
    b = batch(rec(b"mail jane.doe+x@example.co.uk, card 4111 1111 1111 1111, order 1234567890123"),
              rec(b"nothing here"), rec(None))
    out = run(plugin, b)
    assert out.records[0].value == (b"mail ***@***, card ****-****-****-1111, "
                                    b"order 1234567890123")  # not a Luhn number: kept
    assert out.records[1] is b.records[1] and out.records[2] is b.records[2]
    assert len(out.records) == 3
    assert out.records[0].headers == HEADERS and out.records[0].key == b"k"


def test_pii_masker_per_topic_rules_and_default() -> None:
    plugin = configured(PiiMasker, topics={"orders": ["card"], "*": ["email", "ssn", "ipv4",
                                                                    "iban"]})
    value = b"a@b.io 123-45-6789 10.1.2.3 DE89370400440532013000 4111111111111111"
    assert run(plugin, batch(rec(value))).records[0].value == \
        b"a@b.io 123-45-6789 10.1.2.3 DE89370400440532013000 ****-****-****-1111"
    assert run(plugin, batch(rec(value), topic="logs")).records[0].value == \
        b"***@*** ***-**-**** *.*.*.* ****3000 4111111111111111"
    untouched = batch(rec(value))
    assert run(configured(PiiMasker, topics={"other": ["email"]}), untouched) is untouched


def test_pii_masker_custom_rules_and_headers() -> None:
    plugin = configured(PiiMasker, rules={"emp": {"pattern": r"EMP-(\d{2})\d{4}",
                                                  "replacement": r"EMP-\1****"}},
                        topics={"*": ["emp", "email"]}, headers=["user"])
    record = rec(b"by EMP-123456", headers=[Header("user", b"x@y.org"), Header("h", b"x@y.org")])
    out = run(plugin, batch(record)).records[0]
    assert out.value == b"by EMP-12****"
    assert out.headers == (Header("user", b"***@***"), Header("h", b"x@y.org"))


def test_pii_masker_reject_rule() -> None:
    plugin = configured(PiiMasker, rules={"no_cards": {"builtin": "card", "action": "reject"}},
                        topics={"logs": ["email", "no_cards"]})
    exc = rejection(plugin, batch(rec(b"a@b.io"), rec(b"card 4111-1111-1111-1111"),
                                  topic="logs"))
    assert exc.error_code == POLICY_VIOLATION
    assert "PiiMasker: 1 record(s) of logs[0] hold data this topic does not accept; first, " \
           "record 1: its value matches rule 'no_cards'" in exc.message
    # digits that fail the Luhn check are not a card number
    out = run(plugin, batch(rec(b"a@b.io 1234567890123"), topic="logs"))
    assert out.records[0].value == b"***@*** 1234567890123"


@pytest.mark.parametrize(("config", "message"), [
    ({}, "topics: required key is missing"),
    ({"topics": {"t": ["nope"]}}, "topics.t: unknown rule(s) nope"),
    ({"rules": {"r": {"pattern": "("}}, "topics": {"t": ["r"]}},
     "rules.r.pattern: not a regular expression"),
    ({"rules": {"r": {"pattern": "a", "replacement": r"\2"}}, "topics": {"t": ["r"]}},
     "rules.r.replacement: refers to group 2"),
    # found at the first batch before, failing every one of them
    ({"rules": {"r": {"pattern": "E", "replacement": r"\u00e9"}}, "topics": {"t": ["r"]}},
     "rules.r.replacement: not a replacement template: bad escape \\u"),
    # masked between every character before: ****P****L****E
    ({"rules": {"r": {"pattern": ""}}, "topics": {"t": ["r"]}},
     "rules.r.pattern: '' matches an empty string"),
    ({"rules": {"r": {"pattern": "[0-9]*"}}, "topics": {"t": ["r"]}},
     "rules.r.pattern: '[0-9]*' matches an empty string"),
    ({"rules": {"r": {"pattern": "^$"}}, "topics": {"t": ["r"]}},
     "rules.r.pattern: '^$' matches an empty string"),
    ({"rules": {"r": {"builtin": "phone"}}, "topics": {"t": ["r"]}},
     "rules.r.builtin: expected 'email', 'card', 'ssn', 'iban' or 'ipv4', got 'phone'"),
    ({"rules": {"r": {"pattern": "a", "action": "drop"}}, "topics": {"t": ["r"]}},
     "rules.r.action: expected 'mask' or 'reject', got 'drop'"),
])
def test_pii_config_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PiiMasker().configure(config)


# The built-in patterns as first written: the ones in use are faster forms of these, and
# rules with a needed byte skip values without it; neither may change a single match.
_REFERENCE_PATTERNS = {
    "email": rb"(?<![\w.+-])[\w.+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}\b",
    "card": rb"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d])",
    "ssn": rb"\b\d{3}-\d{2}-\d{4}\b",
    "iban": rb"\b[A-Z]{2}\d{2}[A-Z0-9]{11,30}\b",
    "ipv4": rb"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b",
}
_PII_ALPHABET = b"0123456789 -.@_+aZBX"


_pii_text = st.binary(max_size=30).map(
    lambda b: bytes(_PII_ALPHABET[c % len(_PII_ALPHABET)] for c in b))
_ipv4_like = st.lists(st.integers(0, 299), min_size=3, max_size=5).map(
    lambda octets: b".".join(b"%d" % o for o in octets))
_digits_and_separators = st.lists(st.tuples(st.integers(0, 9), st.sampled_from(
    [b"", b"", b"", b" ", b"-", b"--"])), min_size=8, max_size=22).map(
    lambda pairs: b"".join(b"%d%s" % (d, sep) for d, sep in pairs))


@settings(max_examples=600, deadline=None)
@given(data=st.one_of(
    st.tuples(_pii_text, st.one_of(_ipv4_like, _digits_and_separators), _pii_text).map(
        b"".join),
    st.binary(max_size=60).map(lambda b: bytes(_PII_ALPHABET[c % len(_PII_ALPHABET)]
                                               for c in b)),
    st.lists(st.sampled_from([b"4111 1111 1111 1111", b"4111-1111-1111-1111", b"123-45-6789",
                              b"DE89370400440532013000", b"jane.doe@example.com", b"10.0.0.1",
                              b"-", b" ", b"1", b"a", b"@", b".", b"X"]),
             max_size=12).map(b"".join),
    st.binary(max_size=80)))
def test_pii_rules_match_exactly_what_their_reference_patterns_match(data: bytes) -> None:
    from kiproxy.interceptors.builtin.pii import BUILTIN_RULES, _rule

    for name, reference in _REFERENCE_PATTERNS.items():
        rule = _rule(name, {"builtin": name})
        expected = re.compile(reference)
        assert [m.span() for m in rule.pattern.finditer(data)] == \
            [m.span() for m in expected.finditer(data)], name
        replacement = BUILTIN_RULES[name][1]
        assert rule.apply(data) == expected.sub(replacement, data), name
        assert rule.matches(data) == (
            expected.search(data) is not None if isinstance(replacement, bytes)
            else any(replacement(m) != m.group() for m in expected.finditer(data))), name


# ---------------------------------------------------------------------------- Chain


def chain(*links: Any, plugins_dir: Path | None = None) -> Chain:
    config: dict[str, Any] = {"links": list(links)}
    if plugins_dir is not None:
        config["plugins_dir"] = str(plugins_dir)
    return configured(Chain, **config)  # type: ignore[no-any-return]


SIGN = {"interceptor": "kiproxy.interceptors.builtin.signing:Signer",
        "config": {"keys": {"k1": KEYS["k1"]}, "headers": ["h"]}}
VERIFY = {"interceptor": "kiproxy.interceptors.builtin.signing:SignatureVerifier",
          "config": {"keys": KEYS, "headers": ["h"], "strip": True}}
TRAIL = {"interceptor": "kiproxy.interceptors.builtin.paper_trail:PaperTrail",
         "config": {"cluster": "east"}}


def test_chain_runs_links_in_order() -> None:
    signed = run(chain(SIGN), batch(rec(), rec(b"two")))
    out = run(chain(VERIFY, "kiproxy.interceptors.builtin.trace:TraceContext", TRAIL), signed)
    for record in out.records:
        assert [h.key for h in record.headers] == ["h", "n", "h", "traceparent", "kiproxy-trail"]


def test_chain_names_the_link_that_rejected() -> None:
    signed = run(chain(SIGN), batch(rec(), rec(b"two")))
    tampered = batch(signed.records[0], signed.records[1].with_value(b"TWO"))
    exc = rejection(chain(TRAIL, VERIFY), tampered)
    assert exc.error_code == POLICY_VIOLATION
    assert exc.message.startswith("chain link 2 (kiproxy.interceptors.builtin.signing:"
                                  "SignatureVerifier): SignatureVerifier: 1 record(s)")
    assert exc.record_errors[0][0] == 1


def _plugin(tmp_path: Path, source: str) -> tuple[Path, str]:
    name = f"chainlink_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    return tmp_path, name


_ASYNC_PLUGIN = """
import asyncio
import time
from kiproxy.interceptors import ProduceRequestInterceptor

class Tag(ProduceRequestInterceptor):
    def configure(self, config):
        self.tag = config["tag"].encode()
        self.acks = []
        self.closed_at = None

    async def intercept(self, batch, ctx):
        await asyncio.sleep(0)
        return batch.with_records(r.with_header("tag", self.tag) for r in batch.records)

    def on_acknowledgement(self, batch, base_offset, error):
        self.acks.append(base_offset)

    def close(self):
        self.closed_at = time.perf_counter_ns()

class Drop(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(batch.records[1:])
"""


async def test_chain_with_async_links(tmp_path: Path) -> None:
    plugins, name = _plugin(tmp_path, _ASYNC_PLUGIN)
    c = chain({"interceptor": f"{name}:Tag", "config": {"tag": "a"}}, TRAIL,
              {"interceptor": f"{name}:Tag", "config": {"tag": "b"}}, plugins_dir=plugins)
    pending = c.intercept(batch(rec()), ctx())
    assert isinstance(pending, Awaitable)
    out = await pending
    assert [h.key for h in out.records[0].headers][3:] == ["tag", "kiproxy-trail", "tag"]
    # on_acknowledgement reaches the links that have it; close runs in reverse order.
    c.on_acknowledgement(AcknowledgedBatch(topic="orders", partition=0, record_count=1,
                                           transformed=True), 41, None)
    first, last = c.links[0][1], c.links[2][1]
    assert first.acks == [41] and last.acks == [41]
    c.close()
    assert last.closed_at < first.closed_at


def test_a_chain_without_acknowledging_links_has_no_hook() -> None:
    # The proxy parses produce responses only for interceptors whose class has the hook.
    c = chain(TRAIL)
    assert type(c).on_acknowledgement is ProduceRequestInterceptor.on_acknowledgement


async def test_chain_names_a_link_that_breaks_the_record_count_rule(tmp_path: Path) -> None:
    plugins, name = _plugin(tmp_path, _ASYNC_PLUGIN)
    c = chain({"interceptor": f"{name}:Tag", "config": {"tag": "a"}}, f"{name}:Drop",
              plugins_dir=plugins)
    pending = c.intercept(batch(rec(), rec()), ctx())
    assert isinstance(pending, Awaitable)
    with pytest.raises(RejectBatch, match=rf"chain link 2 \({name}:Drop\) broke the "
                                          "record-count rule: returned 1 records for a batch of 2"):
        await pending


@pytest.mark.parametrize(("config", "message"), [
    ({}, "links: required key is missing"),
    ({"links": [{"config": {}}]}, "links[0].interceptor: required key is missing"),
    ({"links": [TRAIL, {"interceptor": "no_such_module_xyz:X"}]},
     "links[1] (no_such_module_xyz:X): interceptor module 'no_such_module_xyz' not found"),
    ({"links": [{"interceptor": "kiproxy.interceptors.builtin.paper_trail:PaperTrail"}]},
     "links[0] (kiproxy.interceptors.builtin.paper_trail:PaperTrail): "
     "kiproxy.interceptors.builtin.paper_trail:PaperTrail: invalid config: "
     "cluster: required key is missing"),
])
def test_chain_config_errors_name_the_link(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Chain().configure(config)


@pytest.mark.parametrize(("plugin", "config", "message"), [
    (PaperTrail, {"cluster": ""}, "cluster: must not be empty"),
    (TraceContext, {"header": ""}, "header: must not be empty"),
    (Signer, {"keys": {}}, "keys: needs at least 1 item(s), got an empty mapping"),
])
def test_empty_names_and_mappings_are_refused_in_the_settings_words(
        plugin: Any, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plugin().configure(config)
