"""The consume-side plugin API: what a fetch-side hook receives, returns and raises.

Contract. A :class:`FetchResponseInterceptor` sees each record batch of a Fetch
response on a topic its route selects, one :class:`ConsumedBatch` at a time (a
fetched partition holds one or more batches, as the broker stored them), with a
:class:`ConsumeContext` saying who is fetching (the same
:class:`~kiproxy.interceptors.identity.ClientIdentity` the produce side has). It
returns the batch, unchanged or with the same number of records whose keys, values
and headers may differ; offsets (``offset_delta``) and timestamps are the log's and
must stay as they are. It may raise :class:`RefuseFetch` (or anything else, or miss
its deadline): that partition's answer ends before the batch (the batches before it
are sent, and the consumer fetches from it next), and when it is the answer's first
batch the partition is answered with an error a consumer retries
(``UNKNOWN_SERVER_ERROR`` by default) and no records; other partitions and the
connection are unaffected.

A hook may also read and return a batch's records as one **block** - the bytes Kafka
stores, record after record, once decompressed - with ``on_consume_block(block, ctx)``
(a :class:`ConsumedBlock`); the proxy then builds no object per record. It returns a
new block holding the same records in the same order (offset deltas and timestamps
unchanged; the proxy checks them, and a block that does not hold them is a refused
partition like any bad return), ``block.data`` itself for "unchanged", or None to be
handed the same batch as records by ``on_consume``. Hooks of both kinds run in one
chain; after the first that answers None, the rest get records.

A hook that works best on many blocks at once (a cipher spread over threads, a
vectorised library) may also have ``on_consume_blocks(blocks, ctx)``: given every
batch of a fetched partition that would be handed to it as a block (in log order, as
a sequence of :class:`ConsumedBlock`; compressed ones decompressed while
``max_decode_memory`` has room to hold them, the later ones handed one by one), it
answers a sequence with one answer per block, each as ``on_consume_block`` would
answer it (or a :class:`RefuseFetch` for a block it would raise it for). The proxy
calls it instead of ``on_consume_block`` when its link is the first of the chain (the
last on produce); a block answered None is handed to the same link as records
(``on_consume``). A raised exception, a missed deadline (``timeout_ms`` for the one
call) or an answer that is not one per block refuses the partition from its first
batch; a single bad answer (a block without the batch's record count, offset deltas
and timestamps, or a refusal) ends the partition's answer before that batch.

What never reaches the hook: control batches (transaction markers), legacy (magic 0
and 1) message sets, and the partial last batch a broker may send at ``max_bytes``;
they reach the consumer as the broker sent them.

One class may implement both hooks: subclass :class:`ProduceRequestInterceptor
<kiproxy.interceptors.api.ProduceRequestInterceptor>` and
:class:`FetchResponseInterceptor`, and one configured instance serves both (the
``record_encryption`` built-in encrypts in ``intercept`` and decrypts in
``on_consume``). In a chain of several links, produce runs the links in order and
consume in reverse order, so the last transformation applied is undone first.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic

from kiproxy.interceptors.api import MetricSample, SettingsT, _validating
from kiproxy.interceptors.errors import ErrorCode, error_code
from kiproxy.interceptors.identity import UNKNOWN_CLIENT, ClientIdentity
from kiproxy.interceptors.settings import settings_model
from kiproxy.protocol.records import Record

__all__ = ["ConsumeContext", "ConsumedBatch", "ConsumedBlock", "FetchResponseInterceptor",
           "RefuseFetch"]


class RefuseFetch(Exception):
    """Raise from ``on_consume`` or ``on_consume_block`` (or answer it for one block from
    ``on_consume_blocks``) to end the partition's answer before this batch: the
    batches before it are sent, and the consumer fetches from this one next. When it
    is the answer's first batch, the partition is answered with ``error`` and no
    records (the consumer fetches the same offset again after its backoff).

    The default, UNKNOWN_SERVER_ERROR (-1), is retried by the Java client,
    librdkafka, kafka-python and aiokafka with a warning. The Java client throws
    IllegalStateException from ``poll()`` on most other codes (POLICY_VIOLATION
    included; see docs/interceptors.md): keep the default on a topic a Java consumer
    reads. ``error`` is a name or the
    number of one of :class:`~kiproxy.interceptors.errors.ErrorCode`; any other is
    refused (ValueError), because a consumer may move its position on another code and
    skip records (OFFSET_OUT_OF_RANGE, 1, resets its offset). A Fetch response has no
    error message field: ``message`` goes to the proxy's log.
    """

    def __init__(self, message: str, error: str | int = "UNKNOWN_SERVER_ERROR") -> None:
        super().__init__(message)
        self.message = message
        try:
            code: int | None = error_code(error)
        except ValueError:
            code = None
        if code == 0:
            raise ValueError("RefuseFetch needs an error code; 0 (NONE) means success")
        if code is None or code not in _REFUSAL_CODES:
            raise ValueError(
                f"RefuseFetch(error={error!r}): a fetch refusal carries one of "
                f"{', '.join(f'{e.name} ({int(e)})' for e in ErrorCode)}, by name or "
                "number; a consumer may move its position on another code and skip "
                "records (OFFSET_OUT_OF_RANGE, 1, resets its offset)")
        self.error_code = code


_REFUSAL_CODES = frozenset(int(e) for e in ErrorCode)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumedBatch:
    """One record batch of a Fetch response, as a fetch-side hook sees it.

    ``records`` is what the hook may change (same count, same offset deltas and
    timestamps); the rest says where the batch lies in the log and is kept on the
    wire whatever the hook returns.
    """

    topic: str
    """The topic the batch was fetched from."""
    partition: int
    """The partition index."""
    base_offset: int
    """The offset of the batch's first record (a record's offset is
    ``base_offset + record.offset_delta``)."""
    records: tuple[Record, ...]
    """The records, in offset order."""
    producer_id: int = -1
    """The producer id that wrote the batch, or -1."""
    producer_epoch: int = -1
    """Its epoch, or -1."""
    transactional: bool = False
    """Whether the batch was written in a transaction."""
    compression: str = "none"
    """The batch's codec (a changed batch is re-encoded with it)."""

    def with_records(self, records: Iterable[Record]) -> ConsumedBatch:
        """A copy of this batch holding ``records`` instead."""
        return ConsumedBatch(
            topic=self.topic, partition=self.partition, base_offset=self.base_offset,
            records=tuple(records), producer_id=self.producer_id,
            producer_epoch=self.producer_epoch, transactional=self.transactional,
            compression=self.compression)

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumedBlock:
    """One record batch of a Fetch response as its records block, for ``on_consume_block``.

    ``data`` is the batch's records once decompressed, in Kafka's record encoding
    (length, attributes, timestamp delta, offset delta, key, value, headers, as varints
    and byte strings): a read-only view valid only until the hook returns (``bytes(data)``
    keeps a copy). The other fields are those of :class:`ConsumedBatch`.
    """

    topic: str
    """The topic the batch was fetched from."""
    partition: int
    """The partition index."""
    base_offset: int
    """The offset of the batch's first record."""
    base_timestamp: int
    """The timestamp each record's timestamp delta is added to."""
    record_count: int
    """How many records ``data`` holds (and the returned block must hold)."""
    data: memoryview
    """The records block (see the class docstring)."""
    producer_id: int = -1
    """The producer id that wrote the batch, or -1."""
    producer_epoch: int = -1
    """Its epoch, or -1."""
    transactional: bool = False
    """Whether the batch was written in a transaction."""
    compression: str = "none"
    """The batch's codec (a changed block is compressed again with it)."""

    def __len__(self) -> int:
        return self.record_count


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumeContext:
    """Who is fetching and how; the same for every batch of one Fetch response."""

    client_id: str | None
    """The consumer's ``client.id``."""
    client_address: str
    """``host:port`` the consumer connects from."""
    principal: str | None
    """The authenticated principal, when the proxy knows it."""
    api_version: int
    """The Fetch version."""
    deadline: float
    """``time.monotonic()`` by which ``on_consume`` must have returned."""
    proxy_host: str = ""
    """The host name of the proxy handling the response."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the runtime knows (kept for forward compatibility)."""
    identity: ClientIdentity = UNKNOWN_CLIENT
    """What the proxy knows of the consumer's connection (see :class:`ClientIdentity`)."""


class FetchResponseInterceptor(abc.ABC, Generic[SettingsT]):
    """Base class of fetch-side hooks (see the module docstring).

    ``on_consume`` may be a plain method or ``async def``; it runs on the proxy's event
    loop, so a plain one must not block: it holds up every connection while it runs,
    and one that returns past ``timeout_ms`` is refused all the same. Typed settings
    work as for
    :class:`~kiproxy.interceptors.api.ProduceRequestInterceptor`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        model = settings_model(cls)
        own = cls.__dict__.get("configure")
        if model is not None and own is not None \
                and getattr(own, "__kiproxy_settings__", None) is None:
            cls.configure = _validating(own, model)  # type: ignore[method-assign]

    def configure(self, config: SettingsT) -> None:
        """Receive the configuration once, before any batch."""

    @abc.abstractmethod
    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext
                   ) -> ConsumedBatch | Awaitable[ConsumedBatch]:
        """Return ``batch`` (unchanged or with changed records, same count) or raise
        :class:`RefuseFetch`."""

    # ``on_consume_block(block, ctx)`` and ``on_consume_blocks(blocks, ctx)`` are
    # optional and not declared here: the proxy looks for them on the instance (see the
    # module docstring), so a hook without them costs no call per batch.

    def metrics(self) -> Iterable[MetricSample]:
        """The plugin's own metrics (none by default); see the produce API."""
        return ()

    def close(self) -> Awaitable[None] | None:
        """Release resources on shutdown (may be ``async def``)."""


def consume_block_hook(interceptor: Any) -> Any | None:
    """The bound ``on_consume_block`` of ``interceptor``, or None when it has none."""
    hook = getattr(interceptor, "on_consume_block", None)
    return hook if callable(hook) else None


def consume_blocks_hook(interceptor: Any) -> Any | None:
    """The bound ``on_consume_blocks`` of ``interceptor``, or None when it has none."""
    hook = getattr(interceptor, "on_consume_blocks", None)
    return hook if callable(hook) else None


def consume_hook(interceptor: Any) -> Any | None:
    """The bound ``on_consume`` of ``interceptor``, or None when it has no fetch-side hook."""
    hook = getattr(interceptor, "on_consume", None)
    return hook if callable(hook) else None


def produce_hook(interceptor: Any) -> Any | None:
    """The bound ``intercept`` of ``interceptor``, or None for a fetch-side-only hook."""
    hook = getattr(interceptor, "intercept", None)
    return hook if callable(hook) else None
