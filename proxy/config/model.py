"""kiproxy's settings: one YAML file, validated at start, and the same settings as flags.

A config file may hold only some settings; command-line flags fill in or
override the rest. Unknown keys are errors (a typo must not silently fall back
to a default), and every error names the key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from kiproxy.interceptors.extras import interceptor_feature, missing_extras
from kiproxy.interceptors.flags import (
    DEFAULT_TIMEOUT_MS,
    INTERCEPTOR,
    INTERCEPTOR_CONFIG,
    INTERCEPTOR_TIMEOUT,
    PLUGINS_DIR,
    Flag,
    FlagError,
)
from kiproxy.interceptors.settings import describe
from kiproxy.interceptors.verdict import (
    DEFAULT_MAX_PLUGIN_OUTPUT_BYTES,
    DEFAULT_MAX_PLUGIN_OUTPUT_RATIO,
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
)
from kiproxy.protocol.compression import (
    DEFAULT_LEVELS,
    DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES,
    DEFAULT_MAX_DECOMPRESSION_RATIO,
    GZIP_LEVELS,
    LZ4_LEVELS,
    ZSTD_LEVELS,
    CompressionLevels,
    DecompressionLimits,
)
from kiproxy.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from kiproxy.proxy.config.clients import (
    AuditSinkSettings,
    DeadLetterSinkSettings,
    bootstrap_servers,
    parse_host_port,
)
from kiproxy.proxy.config.networks import network
from kiproxy.proxy.config.routes import (
    DefaultRouteSettings,
    Mode,
    RouteSettings,
    check_observe_sample,
    plugin_spec,
    route_features,
    route_warnings,
)
from kiproxy.proxy.config.shorthands import expand_shorthands

__all__ = [
    "DEFAULT_INLINE_ENCODE_SECONDS",
    "AdminSettings",
    "AuditSettings",
    "CompressionSettings",
    "ConfigError",
    "DeadLetterSinkSettings",
    "InterceptorSettings",
    "ListenerSettings",
    "ObserverSettings",
    "ProxyConfig",
    "TlsSettings",
    "UpstreamTlsSettings",
    "load_config",
    "parse_host_port",
]

log = logging.getLogger("kiproxy")

DEFAULT_INLINE_ENCODE_SECONDS = 0.001
"""CPU a transformed batch is expected to take to re-encode, at most, for it to be
re-encoded on the loop (about what a large inline decode takes). A hop to a thread
costs 100-400 us of CPU on a virtual machine (bench/RESULTS.md, ninth round: two
cross-core wake-ups, each a VM exit), more than compressing 32 KiB; re-encoding up to
this on the loop took 13-45% less CPU a record on the compressed transforms than the
earlier 32/64 KiB byte bounds (1 ms is about 230 KiB of zstd level 3 here), and a
1 MB batch of the neighbours bench still compresses on a thread."""


class ConfigError(Exception):
    """A setting is missing or invalid; the message names the key.

    The message has one line per problem (``KEY: what is wrong``); ``file`` is the
    config file the settings came from, when there is one. :meth:`lines` gives
    what the command prints.
    """

    def __init__(self, message: str, file: str | Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = str(file) if file is not None else None

    def lines(self) -> list[str]:
        """``kiproxy: config error in FILE: KEY: ...``, one line per problem."""
        where = f" in {self.file}" if self.file else ""
        return [f"kiproxy: config error{where}: {line}" for line in self.message.splitlines()]


class _Strict(BaseModel):
    # The docstring under a field is its description: the `run`/`dev` flag's help.
    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              use_attribute_docstrings=True)


# How a setting is spelled on the command line: a Flag on its field
# (kiproxy.interceptors.flags); `kiproxy dev` runs its own broker, without these.
_RUN_ONLY = frozenset({"run"})
_UPSTREAM_TLS: dict[str, Any] = {"group": "TLS", "commands": _RUN_ONLY}


def _node_ports(items: list[str]) -> dict[int, int]:
    """``--node-port NODE=PORT`` items as the ``node_ports`` mapping."""
    ports: dict[int, int] = {}
    for item in items:
        node, _, port = item.partition("=")
        if not node.strip().isdigit() or not port.strip().isdigit():
            raise FlagError(f"--node-port {item!r}: expected NODE=PORT")
        ports[int(node)] = int(port)
    return ports


class CompressionSettings(_Strict):
    """Levels a batch the interceptor changed is re-compressed with, in the codec it came in.

    Named after Kafka's producer configs ``compression.<codec>.level``; the defaults are
    what a producer writes with its default settings (LZ4: fast mode).
    """

    gzip_level: Annotated[int, Flag("--compression-gzip-level", metavar="LEVEL")] = Field(
        default=DEFAULT_LEVELS.gzip, ge=GZIP_LEVELS.start, le=GZIP_LEVELS.stop - 1, strict=True)
    """1 (fastest) .. 9 (smallest); 6 is the JDK's and zlib's default."""
    lz4_level: Annotated[int, Flag("--compression-lz4-level", metavar="LEVEL")] = Field(
        default=DEFAULT_LEVELS.lz4, ge=LZ4_LEVELS.start, le=LZ4_LEVELS.stop - 1, strict=True)
    """LZ4 frame level: 1 fast mode, 2 LZ4's middle mode, 3-12 LZ4HC (13-17 as 12)."""
    zstd_level: Annotated[int, Flag("--compression-zstd-level", metavar="LEVEL")] = Field(
        default=DEFAULT_LEVELS.zstd, ge=ZSTD_LEVELS.start, le=ZSTD_LEVELS.stop - 1, strict=True)
    """-131072 .. 22; negative levels are zstd's fast modes, 3 its default."""

    def levels(self) -> CompressionLevels:
        """These settings as the codec's :class:`CompressionLevels`."""
        return CompressionLevels(gzip=self.gzip_level, lz4=self.lz4_level,
                                 zstd=self.zstd_level)


_plugin_spec = plugin_spec


class InterceptorSettings(_Strict):
    """The one interceptor every produced batch goes through."""

    class_name: Annotated[str | None, INTERCEPTOR] = Field(default=None, alias="class")
    """``MODULE:CLASS`` (plugins dir, then installed modules) or an entry-point name."""
    config: Annotated[dict[str, Any], INTERCEPTOR_CONFIG] = Field(default_factory=dict)
    """Passed to the interceptor's ``configure()``. The flag takes a JSON object inline
    (text starting with ``{``) or the path of a JSON or YAML file holding it, read at start."""
    properties: Annotated[str | None,
                          Flag("--interceptor-properties", metavar="FILE")] = None
    """A broker-style ``.properties`` file, passed to ``configure()`` as the config key
    ``properties`` (the ``extism`` interceptor reads its
    ``produce.request.interceptor.wasm.*`` keys); watched for changes like the config."""
    timeout_ms: Annotated[int, INTERCEPTOR_TIMEOUT] = Field(default=DEFAULT_TIMEOUT_MS, gt=0)
    """Per-batch deadline; a batch not done by then is rejected with REQUEST_TIMED_OUT."""
    isolation: Annotated[Literal["inline", "process"],
                Flag("--interceptor-isolation", metavar="MODE")] = "inline"
    """``inline``: on the event loop (fastest); ``process``: in worker processes that are
    killed at the deadline or when they crash, and replaced (see "Plugin isolation" in the
    interceptors page)."""
    workers: Annotated[int,
                Flag("--interceptor-workers", metavar="N")] = Field(default=2, gt=0, le=256)
    """Plugin worker processes when ``isolation`` is ``process`` (per proxy process)."""
    compression: CompressionSettings = Field(default_factory=CompressionSettings)
    """Compression levels of the batches the interceptor changed."""
    mode: Mode = "enforce"
    """``enforce``, or ``observe``: the verdict is recorded and every batch forwarded as
    received (as on a route; see the routing page)."""
    observe_sample: float = Field(default=1.0, gt=0, le=1)
    """In observe mode, the fraction of batches evaluated, chosen per batch."""

    @field_validator("class_name")
    @classmethod
    def _module_colon_class(cls, value: str | None) -> str | None:
        return None if value is None else _plugin_spec(value)

    @model_validator(mode="after")
    def _sample_only_when_observing(self) -> InterceptorSettings:
        check_observe_sample(self.mode, self.observe_sample)
        return self


class ReloadSettings(_Strict):
    """How a running proxy takes a changed configuration (SIGHUP and ``POST /reload``
    always work; this adds the file watch)."""

    watch: bool = False
    """Reload when the config file, a file in the plugins dir or a TLS file changes."""
    watch_interval_ms: int = Field(default=1000, gt=0)
    """How often the watched files are checked (their contents are hashed)."""
    debounce_ms: int = Field(default=2000, ge=0)
    """How long the watched files must stay unchanged before a reload starts."""


class AdminSettings(_Strict):
    """Who may use the metrics listener's admin actions (``POST /reload``); see "The admin
    surface" in the deployment page. ``/metrics``, ``/healthz``, ``/livez``, ``/readyz``
    and ``/config`` (read-only, secrets redacted) stay open to whoever reaches the
    listener: bind ``metrics_listen`` where only trusted callers do."""

    token_file: str | None = None
    """File holding the bearer token ``POST /reload`` needs (``Authorization: Bearer
    <token>``), read on every attempt; unset: only callers on this host may reload."""


class AuditSettings(_Strict):
    """The built-in audit log (JSON Lines); off unless ``path`` or ``topic`` is set."""

    path: Annotated[str | None, Flag("--audit-log", metavar="PATH")] = None
    """File the events are appended to; rotated files are ``PATH.<time>.<n>``."""
    max_bytes: int = Field(default=100 * 2**20, ge=0)
    """Rotate when the file would grow past this size (0: never)."""
    rotate_interval_s: float = Field(default=3600, ge=0)
    """Rotate when the file is this old (0: never)."""
    backups: int = Field(default=24, ge=0)
    """Rotated files kept; older ones are deleted (0: keep all)."""
    requests: Annotated[bool, Flag("--audit-requests", set_to=True)] = False
    """Also write one event per request of APIs other than Produce."""
    flush_interval_ms: int = Field(default=200, gt=0)
    """Longest time an event waits in the write buffer."""
    topic: str | None = None
    """Also send every event to this topic (of the upstream cluster unless ``audit_sink``
    says otherwise)."""


class TlsSettings(_Strict):
    """TLS on the client-facing listeners; off unless ``cert`` and ``key`` are set."""

    cert: Annotated[str | None, Flag("--tls-cert", metavar="FILE", group="TLS")] = None
    """PEM certificate chain the proxy presents to clients."""
    key: Annotated[str | None, Flag("--tls-key", metavar="FILE", group="TLS")] = None
    """PEM private key of ``cert``."""
    client_ca: Annotated[str | None, Flag("--tls-client-ca", metavar="FILE", group="TLS")] = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mTLS)."""
    min_version: Annotated[Literal["TLSv1.2", "TLSv1.3"],
                Flag("--tls-min-version", metavar="VERSION", group="TLS")] = "TLSv1.2"
    """Oldest TLS version a client may negotiate."""


class UpstreamTlsSettings(_Strict):
    """TLS to the brokers; on when ``enabled`` or any file is set."""

    enabled: Annotated[bool, Flag("--upstream-tls", set_to=True, **_UPSTREAM_TLS)] = False
    """Use TLS with the system's CA store even when no ``ca`` is given."""
    ca: Annotated[str | None, Flag("--upstream-tls-ca", metavar="FILE", **_UPSTREAM_TLS)] = None
    """PEM CA bundle that signed the brokers' certificates (default: the system store)."""
    cert: Annotated[str | None,
                    Flag("--upstream-tls-cert", metavar="FILE", **_UPSTREAM_TLS)] = None
    """Client certificate for brokers that require mTLS."""
    key: Annotated[str | None, Flag("--upstream-tls-key", metavar="FILE", **_UPSTREAM_TLS)] = None
    """PEM private key of ``cert``."""
    verify_hostname: Annotated[bool, Flag(
        "--upstream-tls-no-verify-hostname", set_to=False, **_UPSTREAM_TLS,
        help="do not check broker host names against their certificates")] = True
    """Check that the broker's certificate names the host the proxy connects to."""

    @property
    def active(self) -> bool:
        """TLS to the brokers is on."""
        return self.enabled or self.ca is not None or self.cert is not None


class ObserverSettings(_Strict):
    """One observer plugin."""

    class_name: str = Field(alias="class")
    """``MODULE:CLASS``, resolved like the interceptor."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Passed to the observer's ``configure()``."""

    @field_validator("class_name")
    @classmethod
    def _module_colon_class(cls, value: str) -> str:
        return _plugin_spec(value)


class ListenerSettings(_Strict):
    """The client listener (bootstrap and broker ports): its name and the PROXY protocol."""

    name: str = Field(default="default", min_length=1)
    """Routes match it with ``match.listener``; logs and the client identity carry it."""
    proxy_protocol: Literal["off", "optional", "required"] = "off"
    """``off``: a PROXY header closes the connection; ``optional``: a header from a
    trusted peer is used when sent; ``required``: every connection must start with one."""
    proxy_protocol_trusted: tuple[str, ...] = ()
    """CIDRs of the load balancers allowed to send a PROXY header; a header from any
    other peer closes the connection. Required unless ``proxy_protocol`` is ``off``."""
    proxy_protocol_timeout_ms: int = Field(default=5000, gt=0)
    """How long a connection may take to send its PROXY header before it is closed."""

    @field_validator("proxy_protocol", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare off as false

    @field_validator("proxy_protocol_trusted", mode="before")
    @classmethod
    def _cidrs(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):
            return tuple(str(network(str(item))) for item in items)
        return value

    @model_validator(mode="after")
    def _trusted_needed(self) -> ListenerSettings:
        if self.proxy_protocol != "off" and not self.proxy_protocol_trusted:
            raise ValueError(
                f"proxy_protocol: {self.proxy_protocol} needs proxy_protocol_trusted, the "
                "CIDRs of your load balancers (0.0.0.0/0 and ::/0 trust every peer)")
        return self


class ProxyConfig(_Strict):
    """Every setting of ``kiproxy run``; docs/configuration.md is generated from this model."""

    _as_written: str | None = PrivateAttr(default=None)
    """The hash of the configuration a worker's settings were derived from (its own
    metrics port and audit file), so that every worker reports the same ``config_hash``;
    a copy with other values is another configuration, and hashes itself."""

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Self:
        """A copy (:meth:`pydantic.BaseModel.model_copy`); one with ``update`` values
        forgets the hash it was derived from."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._as_written = None
        return copy

    @property
    def every_route(self) -> tuple[RouteSettings | DefaultRouteSettings, ...]:
        """The routes in order, then ``default`` when there is one."""
        return self.routes if self.default is None else (*self.routes, self.default)

    listen: Annotated[str, Flag(metavar="HOST:PORT")] = "127.0.0.1:9192"
    """``HOST:PORT`` of the bootstrap listener."""
    advertised_host: Annotated[str | None, Flag(metavar="HOST")] = None
    """Host named in rewritten metadata; defaults to the listen host."""
    upstream: Annotated[list[str], Flag(metavar="HOST:PORT[,HOST:PORT...]", repeat=True,
                                        commands=_RUN_ONLY)] = Field(default_factory=list)
    """Bootstrap servers of the real cluster, ``HOST:PORT`` each, comma-separated as Kafka's
    ``bootstrap.servers`` or listed (in the file: a YAML list; the flag: repeated)."""
    broker_port_start: Annotated[int | None,
                Flag(metavar="PORT")] = Field(default=None, ge=0, le=65535)
    """Node N is served on ``broker_port_start + N``; defaults to the listen port + 1."""
    node_ports: Annotated[dict[int, int], Flag("--node-port", metavar="NODE=PORT", repeat=True,
                                               parse=_node_ports)] = Field(default_factory=dict)
    """Explicit node-id -> port overrides."""
    plugins_dir: Annotated[str | None, PLUGINS_DIR] = None
    """Directory searched first for interceptor modules."""
    interceptor: InterceptorSettings = Field(default_factory=InterceptorSettings)
    """The one interceptor for every batch: shorthand for one route that matches everything.
    Without ``class`` it still sets ``workers`` and ``compression`` for the routes."""
    routes: tuple[RouteSettings, ...] = ()
    """Ordered; the first whose ``match`` holds runs its chain (see the routing page)."""
    default: DefaultRouteSettings | None = None
    """The chain for batches no route matched; unset: they pass through untouched."""
    listener: ListenerSettings = Field(default_factory=ListenerSettings)
    """The client listener's name and its PROXY protocol settings."""
    observers: list[ObserverSettings] = Field(default_factory=list)
    """Observer plugins; each sees every request and response on a thread of its own."""
    observer_queue_size: int = Field(default=100_000, gt=0)
    """Events buffered per observer; beyond it events are dropped and counted."""
    reload: ReloadSettings = Field(default_factory=ReloadSettings)
    """Hot reload: the file watch (SIGHUP and ``POST /reload`` need no setting)."""
    admin: AdminSettings = Field(default_factory=AdminSettings)
    """Who may call ``POST /reload`` on the metrics listener."""
    audit: AuditSettings = Field(default_factory=AuditSettings)
    """The built-in audit log."""
    dead_letter_sink: DeadLetterSinkSettings = Field(default_factory=DeadLetterSinkSettings)
    """The producer that copies refused records to the routes' ``dead_letter`` topics."""
    audit_sink: AuditSinkSettings = Field(default_factory=AuditSinkSettings)
    """The producer that sends the audit events to ``audit.topic``."""
    metrics_listen: Annotated[str | None, Flag(metavar="HOST:PORT")] = None
    """``HOST:PORT`` serving ``/metrics``, ``/livez`` (``/healthz``), ``/readyz``,
    ``/config`` and ``POST /reload`` (see ``admin``); off when unset."""
    log_level: Annotated[str, Flag(metavar="LEVEL")] = "INFO"
    """``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL``."""
    log_format: Annotated[str, Flag(metavar="FORMAT")] = "text"
    """``text`` (key=value pairs) or ``json`` (one JSON object per line)."""
    max_frame_size: Annotated[int,
                Flag(metavar="BYTES")] = Field(default=DEFAULT_MAX_FRAME_SIZE, gt=0)
    """Largest request frame accepted from a client, in bytes."""
    max_response_size: int = Field(default=DEFAULT_MAX_FRAME_SIZE * 2, gt=0)
    """Largest response frame accepted from a broker, in bytes."""
    max_in_flight: Annotated[int, Flag(metavar="N")] = Field(default=100, gt=0)
    """Responses owed to one client before the proxy stops reading its requests."""
    upstream_connect_timeout_ms: int = Field(default=10000, gt=0)
    """How long connecting to a broker may take before the client connection is closed."""
    wait_for_upstream: Annotated[bool, Flag(set_to=True, commands=_RUN_ONLY)] = False
    """At start, keep trying the upstream until it answers (``/readyz`` is false until
    then) instead of exiting when no bootstrap server answers within
    ``upstream_startup_timeout_ms``; for orchestrated start-up."""
    upstream_startup_timeout_ms: Annotated[int,
                Flag(metavar="MS", commands=_RUN_ONLY)] = Field(default=10000, gt=0)
    """How long ``kiproxy run`` tries the upstream bootstrap servers before it exits."""
    workers: Annotated[int, Flag(metavar="N", commands=_RUN_ONLY)] = Field(default=1, ge=1, le=256)
    """Processes serving the same listeners (SO_REUSEPORT); each is one event loop."""
    max_connections: Annotated[int, Flag(metavar="N")] = Field(default=10000, gt=0)
    """Client connections open at once; more are closed on accept (and logged)."""
    max_buffered_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(default=8 * 2**20, gt=0)
    """Response bytes buffered for a client that does not read; its reads pause beyond it."""
    max_decompressed_batch_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        default=DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES, gt=0, strict=True)
    """Largest decompressed records block of one batch (32 MiB); decompression stops
    there and the partition is refused with INVALID_RECORD. See docs/limits.md."""
    max_decompression_ratio: Annotated[int,
                Flag(metavar="N")] = Field(default=DEFAULT_MAX_DECOMPRESSION_RATIO, ge=0,
                                         strict=True)
    """Largest decompressed/compressed ratio of a records block once past 4 MiB of
    output (256; 0: no ratio check); refused like the above."""
    max_plugin_output_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        default=DEFAULT_MAX_PLUGIN_OUTPUT_BYTES, gt=0, strict=True)
    """Most bytes of records (encoded, before compression) a plugin may return for one
    batch (32 MiB); more is refused with INVALID_RECORD. See docs/limits.md."""
    max_plugin_output_ratio: Annotated[int, Flag(metavar="N")] = Field(
        default=DEFAULT_MAX_PLUGIN_OUTPUT_RATIO, ge=0, strict=True)
    """Most times the bytes it was given a plugin may return for one batch, once past
    4 MiB returned (16; 0: no ratio check); refused like the above."""
    max_decode_memory: Annotated[int,
                Flag(metavar="BYTES")] = Field(default=256 * 2**20, gt=0, strict=True)
    """Process-wide bytes of large batches being decoded or held decoded (256 MiB);
    further decodes wait, and their connections stop being read meanwhile."""
    max_inline_encode_ms: Annotated[float,
                Flag(metavar="MS")] = Field(default=DEFAULT_INLINE_ENCODE_SECONDS * 1000, ge=0,
                                        le=1000, strict=True)
    """CPU a transformed batch is expected to take to re-compress, at most, for it to be
    re-compressed on the event loop (1 ms; learnt per codec and level); more goes to a
    decode thread. See docs/limits.md."""
    max_client_buffered_bytes: Annotated[int,
                Flag(metavar="BYTES")] = Field(default=256 * 2**20, gt=0, strict=True)
    """Process-wide bytes of partial request frames held (256 MiB); past it a connection
    receiving more is paused, except one: the one holding the most (the first to get
    there, among clients sending at the same pace)."""
    idle_timeout_ms: Annotated[int, Flag(metavar="MS")] = Field(default=600_000, ge=0)
    """Close client connections with no traffic and nothing owed for this long (0: never)."""
    tls: TlsSettings = Field(default_factory=TlsSettings)
    """TLS on the client-facing listeners."""
    upstream_tls: UpstreamTlsSettings = Field(default_factory=UpstreamTlsSettings)
    """TLS to the brokers."""
    shutdown_grace_ms: int = Field(default=10000, ge=0)
    """How long in-flight requests may take to finish on SIGTERM/SIGINT."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_host_port(value, "")
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value, "")
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value.lower() not in {"text", "json"}:
            raise ValueError(f"{value!r} is not text or json")
        return value.lower()

    @field_validator("upstream", mode="before")
    @classmethod
    def _upstream(cls, value: object) -> object:
        return bootstrap_servers(value)

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"{value!r} is not DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return value.upper()

    @property
    def listen_address(self) -> tuple[str, int]:
        """The bootstrap listener's ``(host, port)``."""
        return parse_host_port(self.listen)

    @model_validator(mode="after")
    def _routes(self) -> ProxyConfig:
        if self.interceptor.class_name is not None:
            for key, given in (("routes", bool(self.routes)), ("default", self.default)):
                if given:
                    raise ValueError(
                        f"interceptor.class and {key} cannot both be set: interceptor.class "
                        "is shorthand for one route that matches everything; move it into "
                        f"{key} as a chain link")
        names: dict[str, int] = {}
        for i, route in enumerate(self.routes):
            name = route.name if route.name is not None else str(i)
            if name in names:
                raise ValueError(f"routes[{i}].name: {name!r} is already the name of "
                                 f"routes[{names[name]}]; route names must be unique")
            names[name] = i
        if self.default is not None and self.default.name in names:
            raise ValueError(f"default.name: {self.default.name!r} is already the name of "
                             f"routes[{names[self.default.name]}]")
        return self

    def features(self) -> list[tuple[str, str]]:
        """``(key, feature)`` of the optional features this configuration uses, each of
        which may need an extra (:mod:`kiproxy.interceptors.extras`)."""
        uses = [("audit.topic", "audit.topic")] if self.audit.topic is not None else []
        spec = self.interceptor.class_name
        feature = None if spec is None else interceptor_feature(spec)
        if feature is not None:
            uses.append((f"interceptor.class ({spec})", feature))
        return uses + route_features(self.routes, self.default)

    def route_warnings(self) -> list[str]:
        """Routes that can never match, one line each (log them as warnings at start)."""
        return route_warnings(self.routes, self.default, [self.listener.name])

    @model_validator(mode="after")
    def _node_ports_apart(self) -> ProxyConfig:
        taken: dict[int, str] = {}
        listen_port = parse_host_port(self.listen)[1]
        if listen_port:
            taken[listen_port] = "the listen port"
        for node, port in sorted(self.node_ports.items()):
            if port in taken:
                raise ValueError(f"node_ports: node {node} is given port {port}, "
                                 f"{taken[port]}; each node needs a port of its own")
            taken[port] = f"node {node}'s"
        return self

    @model_validator(mode="after")
    def _tls_pairs(self) -> ProxyConfig:
        if (self.tls.cert is None) != (self.tls.key is None):
            raise ValueError("tls.cert and tls.key must be given together")
        if self.tls.client_ca is not None and self.tls.cert is None:
            raise ValueError("tls.client_ca needs tls.cert and tls.key")
        if (self.upstream_tls.cert is None) != (self.upstream_tls.key is None):
            raise ValueError("upstream_tls.cert and upstream_tls.key must be given together")
        if self.tls.cert is not None and self.listener.proxy_protocol != "off":
            raise ValueError(
                f"listener.proxy_protocol: {self.listener.proxy_protocol} cannot be combined "
                "with tls.cert yet (the PROXY header comes before the TLS handshake); "
                "terminate TLS at the load balancer, or set proxy_protocol: off")
        return self

    @property
    def metrics_listen_address(self) -> tuple[str, int]:
        """The metrics endpoint's ``(host, port)``."""
        assert self.metrics_listen is not None
        return parse_host_port(self.metrics_listen)

    def decompression_limits(self) -> DecompressionLimits:
        """``max_decompressed_batch_bytes`` and ``max_decompression_ratio`` as one value."""
        return DecompressionLimits(max_bytes=self.max_decompressed_batch_bytes,
                                   max_ratio=self.max_decompression_ratio)

    def plugin_output_limits(self) -> OutputLimits:
        """``max_plugin_output_bytes`` and ``max_plugin_output_ratio`` as one value (the
        default object itself when they are the defaults, which the verdict need not
        hand on: see :func:`~kiproxy.interceptors.verdict.output_limits`)."""
        limits = OutputLimits(max_bytes=self.max_plugin_output_bytes,
                              max_ratio=self.max_plugin_output_ratio)
        return DEFAULT_OUTPUT_LIMITS if limits == DEFAULT_OUTPUT_LIMITS else limits

    @property
    def upstream_addresses(self) -> list[tuple[str, int]]:
        """The upstream bootstrap servers as ``(host, port)``."""
        return [parse_host_port(u) for u in self.upstream]


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> ProxyConfig:
    """Read the YAML file at ``path`` (if any), apply ``overrides`` and validate.

    ``overrides`` uses the config's keys; nested keys are written ``interceptor.class``.
    A file that holds no settings (empty, or comments only) is refused, as one caught
    half written would otherwise drop every setting it had, at start or at a reload.
    Raises :class:`ConfigError` with one line per problem, each naming the key path,
    what is wrong and, for an unknown key, the closest valid one - or naming each extra
    that a feature in use needs and that is not installed, with what to install.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as stream:  # YAML errors then name the file
                loaded = yaml.safe_load(stream)
        except OSError as exc:
            raise ConfigError(f"cannot read the file: {exc.strerror}", path) from None
        except yaml.YAMLError as exc:
            flat = " ".join(str(exc).split())
            raise ConfigError(f"not valid YAML: {flat}", path) from None
        if loaded is None:  # empty, or comments only: a file half written, or the wrong one
            raise ConfigError("the file holds no settings (it is empty, or only comments); "
                              "a configuration file names at least one, so that a file "
                              "caught while it is being rewritten is not read as every "
                              "setting's default", path)
        if not isinstance(loaded, dict):
            raise ConfigError("the file must be a mapping of settings (KEY: VALUE lines), "
                              f"not {type(loaded).__name__}", path)
        data = loaded
    for dotted, value in overrides.items():
        if value is None:
            continue
        target = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{part}: expected a mapping of settings, got "
                                  f"{target!r}", path)
        target[leaf] = value
    for note in expand_shorthands(data):
        log.warning("config%s: %s", f" {path}" if path else "", note)
    try:
        config = ProxyConfig.model_validate(data)
    except ValidationError as exc:
        flags = frozenset(k for k, v in overrides.items() if v is not None) if path else frozenset()
        raise ConfigError("\n".join(describe(exc, ProxyConfig, flags)), path) from None
    missing = missing_extras(config.features())
    if missing:
        raise ConfigError("\n".join(missing), path)
    return config
