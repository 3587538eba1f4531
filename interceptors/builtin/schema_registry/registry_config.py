"""``RegistrySettings``: how the schema registry client connects and caches, parsed from the
``registry:`` mapping of the ``schema_registry`` interceptor's config.

Contract: :meth:`RegistrySettings.from_config` accepts exactly the keys below (an unknown
key, a wrong type, a missing ``url`` or a missing file is a :class:`ValueError` whose
message names the key as ``registry.<key>``) and returns a frozen value; nothing is
connected here. File paths are checked at parse time, read when the client connects
(the bearer token file again whenever it changes, so a rotated token is picked up).

Keys (``docs/schema-registry.md``, "Registry connection settings")::

    registry:
      url: http://127.0.0.1:8081/apis/ccompat/v7   # Confluent Schema Registry API base URL
      basic_auth: {username: u, password: p}        # or password_file: /path
      bearer_token: t                               # or bearer_token_file: /path
      ca_file: ca.pem                               # TLS: trust these CAs (default: system)
      cert_file: client.pem                         # TLS client certificate ...
      key_file: client.key                          # ... and its key
      timeout_ms: 2000                              # per HTTP request
      cache_size: 10000                             # schema ids kept (least recently used out)
      cache_ttl_s: 300                              # an id is refreshed after this long
      negative_ttl_s: 5                             # an unknown, uncompilable or unanswered
                                                    # id is asked again after this long
      subject_ttl_s: 1                              # an id's subjects, a subject's latest id
      max_connections: 10                           # concurrent HTTP connections
      max_requests_in_flight: 2                     # HTTP requests at once; the rest wait
      max_response_bytes: 4194304                   # a larger answer is refused
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import pydantic
from pydantic import ConfigDict, Field

__all__ = ["BasicAuth", "RegistrySettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BasicAuth:
    """HTTP basic authentication: the password inline or in a file (one of them)."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    username: str
    password: str | None = None
    password_file: str | None = None


_Positive = Annotated[float, Field(gt=0)]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrySettings:
    """The registry's URL, credentials, TLS files, timeout and cache bounds."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    url: str
    basic_auth: BasicAuth | None = None
    bearer_token: str | None = None
    bearer_token_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout_ms: Annotated[int, Field(gt=0)] = 2000
    cache_size: Annotated[int, Field(gt=0)] = 10_000
    cache_ttl_s: _Positive = 300.0
    negative_ttl_s: Annotated[float, Field(ge=0)] = 5.0
    subject_ttl_s: Annotated[float, Field(ge=0)] = 1.0
    max_connections: Annotated[int, Field(gt=0)] = 10
    max_requests_in_flight: Annotated[int, Field(gt=0)] = 2
    max_response_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    """The largest registry answer read (4 MiB: real schemas are a few KiB, the largest
    generated ones a few hundred); a larger one fails the lookup as unavailable."""

    @classmethod
    def from_config(cls, raw: Mapping[str, object]) -> RegistrySettings:
        """Parse and check the ``registry:`` mapping; errors name the key (``registry.url``)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"registry: expected a mapping with at least `url`, "
                             f"got {type(raw).__name__}")
        try:
            settings = _ADAPTER.validate_python(dict(raw))
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"registry.{where}: {err['msg']}") from None
        settings._check()
        return settings

    def _check(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"registry.url: {self.url!r} is not an http:// or https:// URL "
                             "(e.g. http://127.0.0.1:8081/apis/ccompat/v7)")
        if self.bearer_token is not None and self.bearer_token_file is not None:
            raise ValueError("registry.bearer_token / registry.bearer_token_file: "
                             "give one of them, not both")
        if self.basic_auth is not None and (self.bearer_token or self.bearer_token_file):
            raise ValueError("registry.basic_auth / registry.bearer_token: "
                             "give one kind of credentials, not both")
        if self.basic_auth is not None and (
                (self.basic_auth.password is None) == (self.basic_auth.password_file is None)):
            raise ValueError("registry.basic_auth: give exactly one of password, password_file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("registry.cert_file / registry.key_file: a client certificate "
                             "needs both")
        files = {"ca_file": self.ca_file, "cert_file": self.cert_file,
                 "key_file": self.key_file, "bearer_token_file": self.bearer_token_file,
                 "basic_auth.password_file": (self.basic_auth.password_file
                                              if self.basic_auth else None)}
        for key, path in files.items():
            if path is not None and not Path(path).is_file():
                raise ValueError(f"registry.{key}: no file at {path!r}")

    @property
    def timeout_s(self) -> float:
        """``timeout_ms`` in seconds."""
        return self.timeout_ms / 1000


_ADAPTER = pydantic.TypeAdapter(RegistrySettings)
