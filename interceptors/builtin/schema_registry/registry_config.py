"""``RegistrySettings``: how the schema registry client connects and caches, the ``registry:``
mapping of the ``schema_registry`` interceptor's config.

Contract: a typed settings model (:class:`~kiproxy.interceptors.PluginSettings`) nested in
the interceptor's settings, so its keys are validated with theirs (an unknown key, a wrong
type, a missing ``url`` or a missing file is a problem naming the key as
``registry.<key>``) and documented in ``docs/builtin-settings.md``; the value is frozen and
nothing is connected here. File paths are checked at parse time, read when the client
connects (the bearer token file again whenever it changes, so a rotated token is picked
up). :meth:`RegistrySettings.from_config` validates a ``registry:`` mapping alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from kiproxy.interceptors.settings import PluginSettings, parse_settings

__all__ = ["BasicAuth", "RegistrySettings"]


def _file(path: str) -> str:
    if not Path(path).is_file():
        raise ValueError(f"no file at {path!r}")
    return path


File = Annotated[str, AfterValidator(_file)]
"""The path of a file that exists when the configuration is loaded."""


class BasicAuth(PluginSettings):
    """HTTP basic authentication: the password inline or in a file (one of them)."""

    username: str
    """The user name."""
    password: str | None = None
    """The password (or ``password_file``)."""
    password_file: File | None = None
    """A file holding the password."""

    @model_validator(mode="after")
    def _one_password(self) -> BasicAuth:
        if (self.password is None) == (self.password_file is None):
            raise ValueError("give exactly one of password, password_file")
        return self


class RegistrySettings(PluginSettings):
    """The registry's URL, credentials, TLS files, timeout and cache bounds."""

    url: str
    """Base URL of the Confluent Schema Registry API, ``http://`` or ``https://``
    (Apicurio: ``http://HOST:PORT/apis/ccompat/v7``)."""
    basic_auth: BasicAuth | None = None
    """HTTP basic auth, ``{username, password}`` or ``{username, password_file}``."""
    bearer_token: str | None = None
    """A bearer token sent as ``Authorization: Bearer ...``."""
    bearer_token_file: File | None = None
    """A file holding the token; read again whenever it changes (rotation), checked before
    each request."""
    ca_file: File | None = None
    """PEM file of the CAs that sign the registry's certificate (default: the system's).
    Read again when it changes."""
    cert_file: File | None = None
    """PEM client certificate (mutual TLS); needs ``key_file``. Read again when it changes."""
    key_file: File | None = None
    """The client certificate's PEM key; needs ``cert_file``. Read again when it changes."""
    timeout_ms: int = Field(default=2000, gt=0)
    """Timeout of each HTTP request, and the longest a lookup waits for its turn."""
    cache_size: int = Field(default=10_000, gt=0)
    """Schema ids kept; the least recently used goes first."""
    cache_ttl_s: float = Field(default=300.0, gt=0)
    """An id's schema (and what the proxy compiled of it) is refreshed after this many
    seconds; the old one serves meanwhile."""
    negative_ttl_s: float = Field(default=5.0, ge=0)
    """An id the registry does not know, whose schema the proxy cannot compile, or that the
    registry could not be asked about, is asked again after this many seconds."""
    subject_ttl_s: float = Field(default=1.0, ge=0)
    """How long the registry client keeps an id's subjects and a subject's latest id (they
    change as schemas are registered). The check keeps its own answers ``lookup_ttl_s``
    above this cache, and the two add up: ``lookup_ttl_s`` decides how soon a new latest
    version is seen."""
    max_connections: int = Field(default=10, gt=0)
    """Concurrent HTTP connections to the registry."""
    max_requests_in_flight: int = Field(default=2, gt=0)
    """HTTP requests to the registry at once; other lookups wait their turn. Also the
    threads that parse large answers and compile schemas."""
    max_response_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    """The largest registry answer read (4 MiB: real schemas are a few KiB, the largest
    generated ones a few hundred); a larger one fails the lookup as unavailable."""

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http:// or https:// URL "
                             "(e.g. http://127.0.0.1:8081/apis/ccompat/v7)")
        return url

    @model_validator(mode="after")
    def _credentials(self) -> RegistrySettings:
        if self.bearer_token is not None and self.bearer_token_file is not None:
            raise ValueError("give bearer_token or bearer_token_file, not both")
        if self.basic_auth is not None and (self.bearer_token or self.bearer_token_file):
            raise ValueError("basic_auth and bearer_token: give one kind of credentials, "
                             "not both")
        return self

    @model_validator(mode="before")
    @classmethod
    def _certificate_pair(cls, raw: Any) -> Any:
        # Before the files are looked for: a missing half is named first.
        if isinstance(raw, Mapping) and \
                (raw.get("cert_file") is None) != (raw.get("key_file") is None):
            raise ValueError("cert_file and key_file: a client certificate needs both")
        return raw

    @classmethod
    def from_config(cls, raw: Mapping[str, object]) -> RegistrySettings:
        """The ``registry:`` mapping validated alone; errors name the key (``registry.url``)."""
        return parse_settings(_Registry, {"registry": raw}).registry

    @property
    def timeout_s(self) -> float:
        """``timeout_ms`` in seconds."""
        return self.timeout_ms / 1000


class _Registry(PluginSettings):
    """Just the ``registry:`` key, so that :meth:`RegistrySettings.from_config`'s errors
    name their keys as the interceptor's do."""

    registry: RegistrySettings
    """The registry connection."""
