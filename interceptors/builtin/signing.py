"""``Signer`` and ``SignatureVerifier`` - HMAC-SHA256 record signatures in a header.

``kiproxy.interceptors.builtin.signing:Signer`` signs every record's key, value and
the chosen headers and appends the signature as a header;
``kiproxy.interceptors.builtin.signing:SignatureVerifier`` rejects batches holding a
record whose signature is missing, malformed, made with an unknown key, or
wrong. Producers (or a proxy at the edge) sign; a proxy in front of the
cluster that must only take signed data verifies.

Signature header (``kiproxy-signature`` by default)::

    v1:<key id>:<64 hex digits of HMAC-SHA256(secret, message)>

The signed message, so that any language can produce it (``u32`` is 4 bytes
big-endian; ``field(x)`` is ``u32 len(x)`` then ``x``, or ``u32 0xffffffff``
for null)::

    b"kiproxy-sig-v1\\n"
    field(topic)                                     only with include_topic: true
    field(key) field(value)
    for each name in `headers` (config order):
        field(name) u32 count field(value_1) ... field(value_count)   # every value, in order

The signature header itself is never covered. A header listed in ``headers``
that a record lacks is signed as count 0, so removing it later breaks the
signature; adding a header that is not listed does not.

Config (both classes)::

    interceptor:
      class: kiproxy.interceptors.builtin.signing:SignatureVerifier     # or :Signer
      config:
        keys:                      # key id -> secret
          k1: {env: KIPROXY_SIGNING_KEY}     # or {file: /run/secrets/k1}, or a literal string
          k0: old-secret-still-accepted
        key_id: k1                 # Signer: the key to sign with (default: the only key)
        header: kiproxy-signature
        headers: [tenant, content-type]      # header names covered, in this order
        include_topic: false       # also cover the topic (breaks when a mirror renames it)
        # Signer only:
        on_existing: replace       # a record already signed: replace, keep or reject
        require_headers: false     # reject records lacking a header of `headers`
        # SignatureVerifier only:
        strip: false               # remove the signature header once verified
        error: POLICY_VIOLATION    # Signer's default: INVALID_RECORD
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
)
from kiproxy.interceptors.builtin._per_record import MAX_REPORTED, map_records
from kiproxy.interceptors.config_keys import check_keys

__all__ = ["SignatureVerifier", "Signer", "resolve_secret", "signature", "signing_message"]

_PREFIX = b"kiproxy-sig-v1\n"
_NULL = b"\xff\xff\xff\xff"


def resolve_secret(value: Any, where: str) -> bytes:
    """A secret from config: a literal string, ``{env: NAME}`` or ``{file: PATH}``."""
    if isinstance(value, str):
        secret = value.encode()
    elif isinstance(value, Mapping) and set(value) == {"env"}:
        env = os.environ.get(str(value["env"]))
        if env is None:
            raise ValueError(f"{where}: environment variable {value['env']} is not set")
        secret = env.encode()
    elif isinstance(value, Mapping) and set(value) == {"file"}:
        try:
            secret = Path(str(value["file"])).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{where}: cannot read secret file: {exc}") from None
    else:
        raise ValueError(f"{where} must be a string, {{env: NAME}} or {{file: PATH}}")
    if not secret:
        raise ValueError(f"{where} is empty")
    return secret


def _field(data: bytes | None) -> bytes:
    if data is None:
        return _NULL
    return len(data).to_bytes(4, "big") + data


def signing_message(
    record: Record, headers: Sequence[str] = (), topic: str | None = None
) -> bytes:
    """The bytes that are signed for ``record`` (``topic`` only when it is covered)."""
    parts = [_PREFIX]
    if topic is not None:
        parts.append(_field(topic.encode()))
    parts.append(_field(record.key))
    parts.append(_field(record.value))
    for name in headers:
        values = record.header_values(name)
        parts.append(_field(name.encode()))
        parts.append(len(values).to_bytes(4, "big"))
        parts.extend(_field(v) for v in values)
    return b"".join(parts)


def signature(
    record: Record, key_id: str, secret: bytes, headers: Sequence[str] = (),
    topic: str | None = None,
) -> bytes:
    """The signature header value for ``record``: ``v1:<key id>:<hex HMAC-SHA256>``."""
    digest = hmac.new(secret, signing_message(record, headers, topic), hashlib.sha256)
    return f"v1:{key_id}:{digest.hexdigest()}".encode()


class _Signing(ProduceRequestInterceptor):
    """Settings shared by Signer and SignatureVerifier."""

    _own_keys: frozenset[str] = frozenset()
    _default_error = "POLICY_VIOLATION"

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.header = "kiproxy-signature"
        self.headers: tuple[str, ...] = ()
        self.include_topic = False
        self.error = self._default_error

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read the shared settings (see the module docstring)."""
        known = {"keys", "header", "headers", "include_topic", "error"} | self._own_keys
        check_keys(config, known)
        keys = config.get("keys")
        if not isinstance(keys, Mapping) or not keys:
            raise ValueError("keys must be a non-empty mapping of key id to secret")
        for key_id, secret in keys.items():
            if not str(key_id) or ":" in str(key_id):
                raise ValueError(f"keys: key id {key_id!r} must be non-empty without ':'")
            self.keys[str(key_id)] = resolve_secret(secret, f"keys.{key_id}")
        self.header = str(config.get("header", self.header))
        headers = config.get("headers", []) or []
        if not isinstance(headers, list) or not all(isinstance(h, str) for h in headers):
            raise ValueError("headers must be a list of header names")
        if self.header in headers:
            raise ValueError(f"headers must not include the signature header {self.header!r}")
        self.headers = tuple(headers)
        self.include_topic = bool(config.get("include_topic", False))
        self.error = str(config.get("error", self._default_error))
        error_code(self.error)

    def _reject(self, batch: RecordBatch, what: str, problems: list[tuple[int, str]]) -> None:
        if problems:
            first_index, first = problems[0]
            raise RejectBatch(
                f"{type(self).__name__}: {len(problems)} record(s) of "
                f"{batch.topic}[{batch.partition}] {what}; first, record {first_index}: {first}",
                self.error, problems,
            )

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Implemented by the subclasses."""
        raise NotImplementedError


class Signer(_Signing):
    """Appends an HMAC-SHA256 signature of key, value and chosen headers to every record."""

    _own_keys = frozenset({"key_id", "on_existing", "require_headers"})
    _default_error = "INVALID_RECORD"

    def __init__(self) -> None:
        super().__init__()
        self.key_id = ""
        self.on_existing = "replace"
        self.require_headers = False

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read the shared settings plus ``key_id``, ``on_existing``, ``require_headers``."""
        super().configure(config)
        key_id = config.get("key_id")
        if key_id is None:
            if len(self.keys) != 1:
                raise ValueError("key_id is required when keys holds more than one key")
            key_id = next(iter(self.keys))
        if str(key_id) not in self.keys:
            raise ValueError(f"key_id {key_id!r} is not one of keys ({', '.join(self.keys)})")
        self.key_id = str(key_id)
        self.on_existing = str(config.get("on_existing", "replace"))
        if self.on_existing not in ("replace", "keep", "reject"):
            raise ValueError(f"on_existing must be replace, keep or reject, "
                             f"not {self.on_existing!r}")
        self.require_headers = bool(config.get("require_headers", False))

    def sign(self, record: Record, topic: str) -> bytes:
        """The signature header value for ``record`` produced to ``topic``."""
        return signature(record, self.key_id, self.keys[self.key_id], self.headers,
                         topic if self.include_topic else None)

    def _one(self, record: Record, topic: str) -> Record | str:
        if self.require_headers:
            present = {h.key for h in record.headers}
            missing = [h for h in self.headers if h not in present]
            if missing:
                return f"lacks header(s) {', '.join(missing)} that the signature must cover"
        if any(h.key == self.header for h in record.headers):
            if self.on_existing == "keep":
                return record
            if self.on_existing == "reject":
                return f"is already signed ({self.header} header present)"
            record = record.with_headers(h for h in record.headers if h.key != self.header)
        return record.with_header(self.header, self.sign(record, topic))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with every record signed."""
        out, problems = map_records(batch, lambda r: self._one(r, batch.topic))
        self._reject(batch, "cannot be signed", problems)
        return batch.with_records(out)


class SignatureVerifier(_Signing):
    """Rejects batches holding a record whose signature is missing or wrong."""

    _own_keys = frozenset({"strip"})

    def __init__(self) -> None:
        super().__init__()
        self.strip = False

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read the shared settings plus ``strip``."""
        super().configure(config)
        self.strip = bool(config.get("strip", False))

    def problem(self, record: Record, topic: str) -> str | None:
        """Why ``record``'s signature does not verify, or None when it does."""
        values = record.header_values(self.header)
        if not values:
            return f"has no {self.header} header"
        if len(values) > 1:
            return f"has {len(values)} {self.header} headers (exactly one is allowed)"
        value = values[0] or b""
        parts = value.split(b":")
        if len(parts) != 3 or parts[0] != b"v1":
            return f"{self.header} is not v1:<key id>:<hex digest>"
        key_id = parts[1].decode(errors="replace")
        secret = self.keys.get(key_id)
        if secret is None:
            return f"is signed with unknown key id {key_id!r}"
        unsigned = record.with_headers(h for h in record.headers if h.key != self.header)
        expected = signature(unsigned, key_id, secret, self.headers,
                             topic if self.include_topic else None)
        if not hmac.compare_digest(expected, value):
            return f"signature does not match (key {key_id}): the record was altered or " \
                   "signed with another secret"
        return None

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch (without signature headers when ``strip``), or reject it."""
        problems: list[tuple[int, str]] = []
        for i, record in enumerate(batch.records):
            problem = self.problem(record, batch.topic)
            if problem is not None:
                problems.append((i, problem))
                if len(problems) >= MAX_REPORTED:
                    break
        self._reject(batch, "failed signature verification", problems)
        if not self.strip:
            return batch
        return batch.with_records(
            r.with_headers(h for h in r.headers if h.key != self.header) for r in batch.records)
