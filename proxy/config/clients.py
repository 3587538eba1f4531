"""The producers the proxy runs itself: how they connect to Kafka, and their queues.

Two side copies use one producer class (:mod:`kiproxy.proxy.observe.kafka_sink`), each
configured by a section of the same shape (:class:`KafkaSinkSettings`):
``dead_letter_sink`` copies refused records to dead-letter topics
(:mod:`kiproxy.proxy.observe.dead_letter`), ``audit_sink`` sends the audit events to
``audit.topic``. Each has its bootstrap servers (default: the upstream cluster), TLS
(default: ``upstream_tls`` when the bootstrap is the upstream's), SASL credentials of its
own, its bounded queue and its time bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["AuditSinkSettings", "ClientTlsSettings", "DeadLetterSinkSettings",
           "KafkaSinkSettings", "SaslClientSettings", "TlsFiles", "bootstrap_servers",
           "parse_host_port"]


def parse_host_port(value: str, what: str = "address") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` allowed); raise ``ValueError`` naming ``what``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {value!r} is not HOST:PORT".lstrip())
    return host.strip("[]"), int(port)


def bootstrap_servers(value: object) -> object:
    """A bootstrap list as Kafka's ``bootstrap.servers`` writes it (``HOST:PORT,HOST:PORT``),
    a list of such strings, or both, as one list of ``HOST:PORT``; raises ``ValueError``
    naming a server that is not ``HOST:PORT``. Other values are returned for the field's
    type to refuse."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        return value
    servers = []
    for item in items:
        for server in str(item).split(","):
            server = server.strip()
            if not server:
                raise ValueError(f"{item!r} has an empty entry; write HOST:PORT,HOST:PORT")
            parse_host_port(server, "")
            servers.append(server)
    return servers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              use_attribute_docstrings=True)


class TlsFiles(Protocol):
    """What a TLS context for a connection to brokers is made from (``upstream_tls`` or
    ``dead_letter_sink.tls``)."""

    enabled: bool
    ca: str | None
    cert: str | None
    key: str | None
    verify_hostname: bool

    @property
    def active(self) -> bool:
        """TLS is on."""


class ClientTlsSettings(_Strict):
    """TLS of the proxy's own producer; on when ``enabled`` or any file is set."""

    enabled: bool = False
    """Use TLS with the system's CA store even when no ``ca`` is given."""
    ca: str | None = None
    """PEM CA bundle that signed the brokers' certificates (default: the system store)."""
    cert: str | None = None
    """Client certificate for brokers that require mTLS."""
    key: str | None = None
    """PEM private key of ``cert``."""
    verify_hostname: bool = True
    """Check that the broker's certificate names the host connected to."""

    @property
    def active(self) -> bool:
        """TLS is on."""
        return self.enabled or self.ca is not None or self.cert is not None


class SaslClientSettings(_Strict):
    """SASL credentials of a producer the proxy runs itself."""

    mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    """The SASL mechanism the brokers' listener offers."""
    username: str = Field(min_length=1)
    """The user the proxy's producer authenticates as (give it write access to the topics
    it writes, and nothing else)."""
    password: str | None = None
    """The user's password (redacted in ``/config``); or ``password_file``."""
    password_file: str | None = None
    """A file holding the password (trailing newline ignored), read at start (the sinks'
    settings, this one included, are restart-only)."""

    @model_validator(mode="after")
    def _one_password(self) -> SaslClientSettings:
        if (self.password is None) == (self.password_file is None):
            raise ValueError("give exactly one of password and password_file")
        return self

    def secret(self) -> str:
        """The password, read from ``password_file`` when that is how it is given."""
        if self.password is not None:
            return self.password
        assert self.password_file is not None
        try:
            return Path(self.password_file).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"sasl.password_file {self.password_file}: cannot read it "
                             f"({exc.strerror or exc})") from None


class KafkaSinkSettings(_Strict):
    """A producer the proxy runs itself for a side copy: where it connects, its queue and
    its time bounds (the shape of ``dead_letter_sink`` and ``audit_sink``).

    Nothing it does changes or delays a producer's answer; what it cannot write is
    dropped and counted in ``kiproxy_sink_dropped_total{sink,reason}``."""

    bootstrap: tuple[str, ...] = ()
    """``HOST:PORT`` bootstrap servers of the cluster holding the sink's topics, a list or
    comma-separated as ``bootstrap.servers`` (default: ``upstream``)."""
    tls: ClientTlsSettings | None = None
    """TLS to that cluster (default: ``upstream_tls`` when ``bootstrap`` is unset, else off)."""
    sasl: SaslClientSettings | None = None
    """SASL credentials of the sink's own producer (default: none)."""
    client_id: str = "kiproxy-sink"
    """The producer's client id, as the brokers log and quota it."""
    queue_records: int = Field(default=10_000, gt=0)
    """Records waiting to be written, at most; a copy that does not fit is dropped whole
    and counted (``kiproxy_sink_dropped_total{reason="queue_full"}``)."""
    queue_bytes: int = Field(default=64 * 2**20, gt=0)
    """Bytes (keys, values, headers) of the records waiting, at most; dropped likewise."""
    acks: Literal["all", 1] = "all"
    """Acknowledgement the producer waits for (``all``: every in-sync replica)."""
    linger_ms: int = Field(default=20, ge=0)
    """How long the producer waits to fill a batch."""
    request_timeout_ms: int = Field(default=10_000, gt=0)
    """How long connecting, asking for a topic, or a write may take (retries included):
    records handed to the producer and not acknowledged by then are dropped and counted as
    ``unavailable``; while the cluster cannot be reached at all, copies wait in the queue
    (tried again every second) until it is full (``queue_full``) or the proxy stops
    (``closed``)."""
    close_timeout_ms: int = Field(default=5_000, ge=0)
    """At shutdown, how long queued records may take to be written; the rest are counted
    as ``closed``."""
    topic_check_interval_ms: int = Field(default=10_000, gt=0)
    """How often the sink asks the cluster whether a topic exists; records for a missing
    topic are dropped as ``topic_missing`` meanwhile."""

    @field_validator("bootstrap", mode="before")
    @classmethod
    def _servers(cls, value: object) -> object:
        servers = bootstrap_servers(value)
        return tuple(servers) if isinstance(servers, list) else servers

    def connection(self, upstream: Sequence[str], upstream_tls: TlsFiles
                   ) -> tuple[tuple[str, ...], TlsFiles | None]:
        """The bootstrap servers and TLS settings the sink connects with: ``bootstrap`` or
        the upstream's, ``tls`` or (for the upstream) ``upstream_tls``; None: no TLS."""
        if self.bootstrap:
            return self.bootstrap, self.tls if self.tls is not None and self.tls.active \
                else None
        tls: TlsFiles = self.tls if self.tls is not None else upstream_tls
        return tuple(upstream), tls if tls.active else None


class DeadLetterSinkSettings(KafkaSinkSettings):
    """The producer that copies refused records to a route's ``dead_letter.topic``.

    Only used when some route has a ``dead_letter``; the topics must exist (the sink
    never creates one). docs/observability.md lists the headers each copy carries.
    """

    client_id: str = "kiproxy-dead-letter"
    """The producer's client id, as the brokers log and quota it."""


class AuditSinkSettings(KafkaSinkSettings):
    """The producer that sends the audit events to ``audit.topic``.

    Only used when ``audit.topic`` is set; the topic is created by the cluster on first
    use where it creates topics automatically (``auto.create.topics.enable``).
    """

    client_id: str = "kiproxy-audit"
    """The producer's client id, as the brokers log and quota it."""
    linger_ms: int = Field(default=50, ge=0)
    """How long the producer waits to fill a batch."""
