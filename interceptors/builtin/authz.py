"""``kiproxy.interceptors.builtin.authz:HeaderTokenAuthorizer`` - a produce token per topic.

Every record must carry a header (``kiproxy-token`` by default) whose value is
one of the tokens configured for its topic; a batch with any record that does
not is rejected (POLICY_VIOLATION, non-retriable) with ``record_errors``
naming each record and why - never the token it carried. With ``strip: true``
(the default) the token header is removed before the batch is stored, so
consumers never read the secret.

Tokens are compared in constant time by their SHA-256 digests. Give them as
literal strings, as ``sha256:<hex digest>`` (so the config holds no secret:
``printf %s "$TOKEN" | sha256sum``), or as ``{env: NAME}`` / ``{file: PATH}``.
A record with several token headers is authorized when any of them is valid.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.authz:HeaderTokenAuthorizer
      config:
        header: kiproxy-token
        tokens:                                  # topic -> token or list of tokens
          orders:
            - {env: ORDERS_TOKEN}
            - "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
          payments: s3cr3t
          "*": {file: /run/secrets/default-token}   # any other topic (optional)
        unlisted: deny             # topics with no entry and no "*": deny or allow
        strip: true
        error: POLICY_VIOLATION
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin.signing import resolve_secret
from kiproxy.interceptors.settings import ErrorName
from kiproxy.interceptors.topics import TopicSelector

_MAX_REPORTED = 50
_SHA256 = re.compile(r"sha256:([0-9a-fA-F]{64})")


def _digest(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value  # already a digest
    if isinstance(value, str) and value.startswith("sha256:"):
        match = _SHA256.fullmatch(value)
        if match is None:
            raise ValueError("a sha256: token needs 64 hex digits after the prefix")
        return bytes.fromhex(match.group(1))
    return hashlib.sha256(resolve_secret(value)).digest()


def _listed(value: Any) -> Any:
    return value if isinstance(value, list | tuple) else [value]


TokenDigest = Annotated[bytes, BeforeValidator(_digest)]
"""A token: a literal string, ``sha256:<hex digest>``, ``{env: NAME}`` or ``{file: PATH}``;
kept as its SHA-256 digest."""


class HeaderTokenAuthorizerSettings(PluginSettings):
    """Settings of ``header_token_authorizer``."""

    header: str = Field(default="kiproxy-token", min_length=1)
    """The header that carries the token."""
    tokens: dict[str, Annotated[tuple[TokenDigest, ...], BeforeValidator(_listed),
                                Field(min_length=1)]] = Field(min_length=1)
    """Topic -> a token or a list of tokens (a string, ``sha256:<hex>``, ``{env: NAME}``
    or ``{file: PATH}``); ``"*"`` for any other topic."""
    unlisted: Literal["deny", "allow"] = "deny"
    """A topic with no entry and no ``"*"``: denied or allowed."""
    strip: bool = True
    """Remove the token header before the batch is stored."""
    error: ErrorName = "POLICY_VIOLATION"
    """The error code of a rejection."""


class HeaderTokenAuthorizer(ProduceRequestInterceptor[HeaderTokenAuthorizerSettings]):
    """Rejects batches whose records lack a valid token header for their topic."""

    def __init__(self) -> None:
        self.header = "kiproxy-token"
        self.tokens: TopicSelector[tuple[bytes, ...]] = TopicSelector.of_names({})
        self.unlisted_allowed = False
        self.strip = True
        self.error = "POLICY_VIOLATION"

    def configure(self, config: HeaderTokenAuthorizerSettings) -> None:
        """Take the validated settings."""
        self.header = config.header
        self.tokens = TopicSelector.of_names(config.tokens)
        self.unlisted_allowed = config.unlisted == "allow"
        self.strip = config.strip
        self.error = config.error

    def _problem(self, record: Record, valid: tuple[bytes, ...], topic: str) -> str | None:
        presented = record.header_values(self.header)
        if not presented:
            return f"has no {self.header} header"
        for token in presented:
            digest = hashlib.sha256(token or b"").digest()
            # Compare against every valid token so timing does not tell which one matched.
            if any([hmac.compare_digest(digest, v) for v in valid]):
                return None
        return f"its {self.header} is not valid for topic {topic!r}"

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch (token headers stripped), or reject it."""
        valid = self.tokens.select(batch.topic)
        if valid is None:
            if self.unlisted_allowed:
                return batch
            raise RejectBatch(
                f"HeaderTokenAuthorizer: no token is configured for topic {batch.topic!r}, "
                "so producing to it is denied", self.error)
        problems: list[tuple[int, str]] = []
        for i, record in enumerate(batch.records):
            problem = self._problem(record, valid, batch.topic)
            if problem is not None:
                problems.append((i, problem))
                if len(problems) >= _MAX_REPORTED:
                    break
        if problems:
            first_index, first = problems[0]
            raise RejectBatch(
                f"HeaderTokenAuthorizer: {len(problems)} record(s) of "
                f"{batch.topic}[{batch.partition}] are not authorized; first, record "
                f"{first_index}: {first}",
                self.error, problems,
            )
        if not self.strip:
            return batch
        return batch.with_records(
            r.with_headers(h for h in r.headers if h.key != self.header) for r in batch.records)
