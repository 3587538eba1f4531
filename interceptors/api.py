"""The public plugin API: what an interceptor receives, returns and raises.

An interceptor sees one topic-partition batch at a time. It returns the batch
(unchanged, or transformed with the same number of records) or raises
:class:`RejectBatch`. Values are immutable; derive changed copies with the
``with_*`` helpers.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol

from typing_extensions import TypeVar

from kiproxy.interceptors.errors import ERROR_CODES, ErrorCode, error_code
from kiproxy.interceptors.identity import UNKNOWN_CLIENT, ClientIdentity
from kiproxy.interceptors.settings import PluginSettings, parse_settings, settings_model
from kiproxy.protocol._codec import SlotsMaker
from kiproxy.protocol.records import Header, Record, header_key_text, upper_values

__all__ = [
    "ERROR_CODES",
    "AcknowledgedBatch",
    "ClientIdentity",
    "ErrorCode",
    "Header",
    "InterceptContext",
    "MetricSample",
    "PluginFactory",
    "PluginSettings",
    "ProduceRequestInterceptor",
    "Record",
    "RecordBatch",
    "RejectBatch",
    "error_code",
    "header_key_text",
]

class RejectBatch(Exception):
    """Raise from ``intercept`` to reject the whole topic-partition batch.

    The producer receives ``error`` (a Kafka error name or code) with ``message``
    as the partition's ``error_message``, and ``record_errors`` - ``(record
    index, message)`` pairs - on Produce versions that carry them (v8+). Nothing
    of the batch is stored.

    The default, POLICY_VIOLATION (44), is the code the most clients name and
    none retries: aiokafka 0.14 does not know INVALID_RECORD (87) and shows
    ``UnknownError``. Pass ``error="INVALID_RECORD"`` for records that are
    malformed rather than refused (docs/rejections.md has what each client shows).
    """

    def __init__(
        self,
        message: str,
        error: str | int = "POLICY_VIOLATION",
        record_errors: Sequence[tuple[int, str | None]] = (),
    ) -> None:
        super().__init__(message)
        if message is None:  # "None" would be what the producer is told
            raise TypeError("RejectBatch needs a message: the reason the producer is told")
        self.message = message if isinstance(message, str) else str(message)
        """The reason (``RejectBatch(exc)`` gives the exception's text)."""
        self.error_code = error_code(error)
        if self.error_code == 0:
            # Code 0 is success: the producer would be told its records were stored.
            raise ValueError("RejectBatch needs an error code; 0 (NONE) means success")
        self.record_errors = tuple(record_errors)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordBatch:
    """One topic-partition batch of a produce request, as an interceptor sees it.

    ``records`` is what an interceptor may change (keeping the count); the
    producer facts are read-only: the proxy keeps them on the wire whatever the
    interceptor returns, so idempotent and transactional producers keep working.
    """

    topic: str
    """The topic the batch is produced to."""
    partition: int
    """The partition index."""
    records: tuple[Record, ...]
    """The records, in order."""
    producer_id: int = -1
    """The idempotent/transactional producer id, or -1."""
    producer_epoch: int = -1
    """The producer epoch, or -1."""
    base_sequence: int = -1
    """Sequence number of the first record, or -1."""
    transactional: bool = False
    """Whether the batch is part of a transaction."""
    compression: str = "none"
    """The codec the batch arrived with (and is re-encoded with): none, gzip, snappy, lz4, zstd."""

    def with_records(self, records: Iterable[Record]) -> RecordBatch:
        """A copy of this batch holding ``records`` instead."""
        return batch_from_fields(self.topic, self.partition, tuple(records), self.producer_id,
                                 self.producer_epoch, self.base_sequence, self.transactional,
                                 self.compression)

    def with_upper_case(self, *, keys: bool = False) -> RecordBatch:
        """This batch with every non-null value (and key, with ``keys``) upper-cased.

        ``bytes.upper()`` semantics (ASCII letters only), in compiled code that reads
        each value straight from the decoded batch. Records with nothing to change are
        kept as they are, and the batch itself is returned when no record changes, so
        it is forwarded as its original bytes.
        """
        records = upper_values(self.records, keys)
        return self if records is self.records else self.with_records(records)

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True, slots=True, kw_only=True)
class InterceptContext:
    """Who sent the batch and how; the same for every batch of one request.

    ``identity`` is the stable, complete answer to "who" (original address behind
    a load balancer, listener, TLS subject and SANs, SASL mechanism and
    principal); ``client_id``, ``client_address`` and ``principal`` repeat its
    most used facts.
    """

    client_id: str | None
    """The producer's ``client.id``."""
    client_address: str
    """``host:port`` the producer connects from."""
    principal: str | None
    """The authenticated principal, when the proxy knows it."""
    api_version: int
    """The Produce request version."""
    acks: int
    """0, 1 or -1 (all)."""
    transactional_id: str | None
    """The transactional id, for transactional producers."""
    deadline: float
    """``time.monotonic()`` by which ``intercept`` must have returned."""
    received_at_ms: int = 0
    """When the proxy received the request, in ms since the epoch."""
    proxy_host: str = ""
    """The host name of the proxy handling the request."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the runtime knows (kept for forward compatibility)."""
    identity: ClientIdentity = UNKNOWN_CLIENT
    """What the proxy knows of the client connection (see :class:`ClientIdentity`);
    ``UNKNOWN_CLIENT`` where no connection stands behind the batch (replay, tests)."""


batch_from_fields: Callable[[str, int, tuple[Record, ...], int, int, int, bool, str],
                            RecordBatch] = SlotsMaker(RecordBatch)
"""A :class:`RecordBatch` from every field's value, in declaration order, made in compiled
code without ``__init__`` (:class:`~kiproxy.protocol._codec.SlotsMaker`): the proxy makes
one per batch it hands to a plugin, where the frozen class's own ``__init__`` costs a
one-record request several per cent of its instructions. Plugins use the class."""

context_from_fields: Callable[
    [str | None, str, str | None, int, int, str | None, float, int, str, Mapping[str, Any],
     ClientIdentity], InterceptContext] = SlotsMaker(InterceptContext)
"""An :class:`InterceptContext` from every field's value, in declaration order, as
:data:`batch_from_fields` makes a batch (``extra`` given: a new mapping each time)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AcknowledgedBatch:
    """What ``on_acknowledgement`` learns about a batch the broker answered."""

    topic: str
    partition: int
    record_count: int
    transformed: bool
    """Whether the interceptor changed the batch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSample:
    """One value of a plugin's own metric, as :meth:`ProduceRequestInterceptor.metrics` gives it.

    The proxy serves it on ``/metrics`` as ``kiproxy_interceptor_<name>`` (a counter
    gets Prometheus' ``_total`` suffix) with ``labels`` plus ``interceptor``, the
    name the configuration loaded the plugin by.
    """

    name: str
    """The metric's name, ``[a-z_][a-z0-9_]*`` (``schema_registry_lookups``)."""
    kind: Literal["counter", "gauge"]
    """``counter`` (only goes up) or ``gauge``."""
    help: str
    """One line saying what it counts."""
    labels: Mapping[str, str]
    """The sample's labels; every sample of one name has the same label names."""
    value: float
    """The value now."""


class PluginFactory(Protocol):
    """Loads another interceptor the way the runtime loaded this one (same plugins dir).

    Given to a composite interceptor's ``configure(config, *, plugins=...)`` (see
    :meth:`ProduceRequestInterceptor.configure`); returns the configured instance.
    """

    def __call__(self, spec: str, config: Mapping[str, Any], /) -> Any:
        """Resolve ``spec`` (``MODULE:CLASS`` or an entry-point name), create and configure it."""


SettingsT = TypeVar("SettingsT", default=Mapping[str, Any])
"""What ``configure`` receives: the config mapping, or the plugin's settings model."""


def _validating(configure: Callable[..., Any], model: type[Any]) -> Callable[..., Any]:
    """``configure`` that validates a config mapping into ``model`` before it runs."""

    @functools.wraps(configure)
    def configure_settings(self: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        return configure(self, parse_settings(model, config), *args, **kwargs)

    configure_settings.__kiproxy_settings__ = model  # type: ignore[attr-defined]
    return configure_settings


class ProduceRequestInterceptor(abc.ABC, Generic[SettingsT]):
    """Base class of interceptor plugins.

    ``intercept`` may be a plain method or ``async def``. One instance serves
    every connection, on the proxy's event loop: a plain ``intercept`` must not
    block (do I/O in an ``async def``).

    Typed settings: a plugin that names a pydantic model as the type argument
    (``class Redact(ProduceRequestInterceptor[RedactSettings])``, the model
    usually a :class:`PluginSettings`) gets that model, validated, in
    ``configure``: an unknown key, a wrong type or a failed validator stops the
    load with the key named, as the proxy's own settings do. ``configure`` called
    with a mapping (in a test) validates it the same way.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        model = settings_model(cls)
        own = cls.__dict__.get("configure")
        if model is not None and own is not None \
                and getattr(own, "__kiproxy_settings__", None) is None:
            cls.configure = _validating(own, model)  # type: ignore[method-assign]

    def configure(self, config: SettingsT) -> None:
        """Receive the ``interceptor.config`` once, before any batch: the mapping, or the
        settings model validated from it (see the class docstring).

        An interceptor that loads others (a chain, a router) may declare a keyword
        parameter ``plugins: PluginFactory``: the loader then passes a factory that
        loads them from the same plugins directory as this one.
        """

    @abc.abstractmethod
    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Return ``batch`` (unchanged or transformed, same record count) or raise RejectBatch."""

    def on_acknowledgement(
        self, batch: AcknowledgedBatch, base_offset: int, error: int | None
    ) -> None:
        """Called after the broker answered a forwarded batch (``error`` None on success)."""

    def metrics(self) -> Iterable[MetricSample]:
        """The plugin's own metrics, read when ``/metrics`` is scraped (none by default).

        Called on the proxy's event loop: return counters the plugin keeps, do no I/O.
        """
        return ()

    def close(self) -> Awaitable[None] | None:
        """Release resources on shutdown (may be ``async def``; the runtime awaits it)."""
