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
from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
)
from kiproxy.interceptors.builtin.signing import resolve_secret
from kiproxy.interceptors.config_keys import check_keys

_MAX_REPORTED = 50
_SHA256 = re.compile(r"sha256:([0-9a-fA-F]{64})")


def _digest(value: Any, where: str) -> bytes:
    if isinstance(value, str) and value.startswith("sha256:"):
        match = _SHA256.fullmatch(value)
        if match is None:
            raise ValueError(f"{where}: a sha256: token needs 64 hex digits after the prefix")
        return bytes.fromhex(match.group(1))
    return hashlib.sha256(resolve_secret(value, where)).digest()


class HeaderTokenAuthorizer(ProduceRequestInterceptor):
    """Rejects batches whose records lack a valid token header for their topic."""

    def __init__(self) -> None:
        self.header = "kiproxy-token"
        self.tokens: dict[str, tuple[bytes, ...]] = {}
        self.unlisted_allowed = False
        self.strip = True
        self.error = "POLICY_VIOLATION"

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``header``, ``tokens``, ``unlisted``, ``strip`` and ``error``."""
        known = {"header", "tokens", "unlisted", "strip", "error"}
        check_keys(config, known)
        self.header = str(config.get("header", self.header))
        tokens = config.get("tokens")
        if not isinstance(tokens, Mapping) or not tokens:
            raise ValueError("tokens must be a non-empty mapping of topic to token(s)")
        for topic, entry in tokens.items():
            entries = entry if isinstance(entry, list) else [entry]
            if not entries:
                raise ValueError(f"tokens.{topic} is an empty list")
            self.tokens[str(topic)] = tuple(
                _digest(e, f"tokens.{topic}[{i}]") for i, e in enumerate(entries))
        unlisted = str(config.get("unlisted", "deny"))
        if unlisted not in ("deny", "allow"):
            raise ValueError(f"unlisted must be deny or allow, not {unlisted!r}")
        self.unlisted_allowed = unlisted == "allow"
        self.strip = bool(config.get("strip", True))
        self.error = str(config.get("error", self.error))
        error_code(self.error)

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
        valid = self.tokens.get(batch.topic, self.tokens.get("*"))
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
