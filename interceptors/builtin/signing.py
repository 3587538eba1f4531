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
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin._per_record import MAX_REPORTED, map_records
from kiproxy.interceptors.settings import ErrorName

__all__ = ["Secret", "SignatureVerifier", "SignatureVerifierSettings", "Signer",
           "SignerSettings", "resolve_secret", "signature", "signing_message"]

_PREFIX = b"kiproxy-sig-v1\n"
_NULL = b"\xff\xff\xff\xff"
_HEX_DIGEST = re.compile(rb"[0-9a-f]{64}")
"""The digest of a v1 signature: HMAC-SHA256 in lower-case hex, as :func:`signature` writes it."""


def resolve_secret(value: Any, where: str = "") -> bytes:
    """A secret from config: a literal string, ``{env: NAME}`` or ``{file: PATH}``.

    ``where`` (``keys.k1``) begins the message of the ``ValueError`` a bad one raises.
    """
    at = f"{where}: " if where else ""
    if isinstance(value, bytes):
        return value  # already resolved
    if isinstance(value, str):
        secret = value.encode()
    elif isinstance(value, Mapping) and set(value) == {"env"}:
        env = os.environ.get(str(value["env"]))
        if env is None:
            raise ValueError(f"{at}environment variable {value['env']} is not set")
        secret = env.encode()
    elif isinstance(value, Mapping) and set(value) == {"file"}:
        try:
            secret = Path(str(value["file"])).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{at}cannot read secret file: {exc}") from None
    else:
        raise ValueError(f"{at}a secret is a string, {{env: NAME}} or {{file: PATH}}")
    if not secret:
        raise ValueError(f"{at}the secret is empty")
    return secret


Secret = Annotated[bytes, BeforeValidator(resolve_secret)]
"""A secret: a literal string, ``{env: NAME}`` or ``{file: PATH}`` (read at load)."""


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


class _SigningSettings(PluginSettings):
    """Settings shared by ``signer`` and ``signature_verifier``."""

    keys: dict[str, Secret] = Field(min_length=1)
    """Key id -> secret: a literal string, ``{env: NAME}`` or ``{file: PATH}``."""
    header: str = Field(default="kiproxy-signature", min_length=1)
    """The header the signature is in."""
    headers: list[str] = Field(default_factory=list)
    """Header names the signature covers, in this order."""
    include_topic: bool = False
    """Also cover the topic (breaks when a mirror renames it)."""

    @field_validator("keys")
    @classmethod
    def _key_ids(cls, keys: dict[str, bytes]) -> dict[str, bytes]:
        for key_id in keys:
            if not key_id or ":" in key_id:
                raise ValueError(f"key id {key_id!r} must be non-empty without ':'")
        return keys

    @model_validator(mode="after")
    def _signature_header_not_covered(self) -> _SigningSettings:
        if self.header in self.headers:
            raise ValueError(f"headers must not include the signature header {self.header!r}")
        return self


class SignerSettings(_SigningSettings):
    """Settings of ``signer``."""

    key_id: str | None = None
    """The key to sign with; default: the only key of ``keys``."""
    on_existing: Literal["replace", "keep", "reject"] = "replace"
    """A record already signed: its signature replaced, kept, or the batch rejected."""
    require_headers: bool = False
    """Reject records lacking a header of ``headers``."""
    error: ErrorName = "INVALID_RECORD"
    """The error code of a rejection."""

    @model_validator(mode="after")
    def _signing_key(self) -> SignerSettings:
        if self.key_id is None and len(self.keys) != 1:
            raise ValueError("key_id is required when keys holds more than one key")
        if self.key_id is not None and self.key_id not in self.keys:
            raise ValueError(f"key_id {self.key_id!r} is not one of keys "
                             f"({', '.join(self.keys)})")
        return self

    @property
    def signing_key(self) -> str:
        """``key_id``, or the only key's id."""
        return self.key_id if self.key_id is not None else next(iter(self.keys))


class SignatureVerifierSettings(_SigningSettings):
    """Settings of ``signature_verifier``."""

    strip: bool = False
    """Remove the signature header once verified."""
    error: ErrorName = "POLICY_VIOLATION"
    """The error code of a rejection."""


_S = TypeVar("_S", SignerSettings, SignatureVerifierSettings)


class _Signing(ProduceRequestInterceptor[_S], Generic[_S]):
    """Settings shared by Signer and SignatureVerifier."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.header = "kiproxy-signature"
        self.headers: tuple[str, ...] = ()
        self.include_topic = False
        self.error = "POLICY_VIOLATION"

    def configure(self, config: _S) -> None:
        """Take the shared settings (see the module docstring)."""
        self.keys = dict(config.keys)
        self.header = config.header
        self.headers = tuple(config.headers)
        self.include_topic = config.include_topic
        self.error = config.error
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


class Signer(_Signing[SignerSettings]):
    """Appends an HMAC-SHA256 signature of key, value and chosen headers to every record."""

    def __init__(self) -> None:
        super().__init__()
        self.key_id = ""
        self.on_existing = "replace"
        self.require_headers = False

    def configure(self, config: SignerSettings) -> None:
        """Take the shared settings plus ``key_id``, ``on_existing``, ``require_headers``."""
        super().configure(config)
        self.key_id = config.signing_key
        self.on_existing = config.on_existing
        self.require_headers = config.require_headers

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


class SignatureVerifier(_Signing[SignatureVerifierSettings]):
    """Rejects batches holding a record whose signature is missing or wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.strip = False

    def configure(self, config: SignatureVerifierSettings) -> None:
        """Take the shared settings plus ``strip``."""
        super().configure(config)
        self.strip = config.strip

    def problem(self, record: Record, topic: str) -> str | None:
        """Why ``record``'s signature does not verify, or None when it does."""
        values = record.header_values(self.header)
        if not values:
            return f"has no {self.header} header"
        if len(values) > 1:
            return f"has {len(values)} {self.header} headers (exactly one is allowed)"
        value = values[0] or b""
        parts = value.split(b":")
        if len(parts) != 3 or parts[0] != b"v1" or not _HEX_DIGEST.fullmatch(parts[2]):
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
