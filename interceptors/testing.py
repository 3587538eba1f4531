"""The plugin test kit: build batches, run an interceptor by the proxy's rules, read the outcome.

:func:`run_interceptor` hands a batch to an interceptor through
:func:`kiproxy.interceptors.verdict.judge` - the very function the proxy, its
isolation workers and replay call - so the :class:`Outcome` it returns is what
the proxy would do with that batch: forward it unchanged, forward the
transformed records, or reject it (error name, code, message, record errors).
Every rule comes with it: a ``RejectBatch``, any other exception, a returned
batch with another record count or something that is not a batch, an
``async def intercept`` (awaited on an event loop, as the proxy does) and the
deadline (``timeout_ms``, the proxy's ``interceptor.timeout_ms``, 5000 by
default). With ``mode="observe"`` (a route's ``mode: observe``) the outcome
is the proxy's in observe mode - the batch forwarded as it came - and
:attr:`Outcome.would` is what the verdict would have done when enforced.

:func:`load` loads a plugin by ``MODULE:CLASS`` (or an entry-point name) with
the proxy's loader, from a plugins directory and with a config, so the names
in rejection messages are the proxy's too. :func:`make_batch`,
:func:`make_record` and :func:`make_context` build inputs with defaults a
producer would send; text is encoded as UTF-8.

Fetch-side hooks: :func:`run_consume` hands a
:class:`~kiproxy.interceptors.consume.ConsumedBatch` (:func:`make_consumed_batch`) to
``on_consume`` through :func:`~kiproxy.interceptors.consume_verdict.judge_consume`, the
function the proxy's fetch path calls, and returns the batch a consumer would get or the
:class:`~kiproxy.interceptors.consume_verdict.ConsumeRefusal` its partition would be
answered with. A hook with ``on_consume_blocks`` or ``on_consume_block`` gets the batch
as a records block first, as the proxy gives it to a chain's first link (judged by
``judge_consume_blocks``, a partition of this one batch, or ``judge_consume_block``);
the block it returns comes back decoded as the batch's records.

The pytest fixtures over these (``make_batch``, ``make_record``,
``kiproxy_run``, ``kiproxy_load``) are in :mod:`kiproxy.interceptors.pytest_plugin`,
registered for pytest when kiproxy is installed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import inspect
import socket
import threading
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kiproxy.interceptors.api import Header, InterceptContext, Record, RecordBatch
from kiproxy.interceptors.consume import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    consume_block_hook,
    consume_blocks_hook,
    produce_hook,
)
from kiproxy.interceptors.consume_verdict import (
    ConsumeRefusal,
    consume_encodable,
    judge_consume,
    judge_consume_block,
    judge_consume_blocks,
)
from kiproxy.interceptors.flags import DEFAULT_TIMEOUT_MS as DEFAULT_TIMEOUT_MS
from kiproxy.interceptors.loader import PluginLoadError as PluginLoadError
from kiproxy.interceptors.loader import load_interceptor
from kiproxy.interceptors.verdict import Mode, Outcome, encodable, judge
from kiproxy.protocol.records import decode_records, encode_records

__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "ConsumeRefusal",
    "Mode",
    "Outcome",
    "Plugin",
    "PluginLoadError",
    "load",
    "make_batch",
    "make_consume_context",
    "make_consumed_batch",
    "make_context",
    "make_record",
    "run_consume",
    "run_consume_blocks",
    "run_interceptor",
    "run_interceptor_async",
]


_T = TypeVar("_T")

Bytes = bytes | bytearray | str | None
"""A key, value or header value: bytes, text (encoded as UTF-8) or None (null)."""


def _bytes(data: Bytes) -> bytes | None:
    if data is None:
        return None
    return data.encode() if isinstance(data, str) else bytes(data)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def make_record(
    value: Bytes = b"value",
    *,
    key: Bytes = None,
    headers: Iterable[Header | tuple[str, Bytes]] | Mapping[str, Bytes] = (),
    timestamp: int | None = None,
    offset_delta: int = 0,
) -> Record:
    """One record: ``value`` and ``key`` as bytes or text, headers as pairs or a mapping.

    ``timestamp`` (ms since the epoch) defaults to now.
    """
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return Record(
        key=_bytes(key), value=_bytes(value),
        headers=[h if isinstance(h, Header) else Header(h[0], _bytes(h[1])) for h in pairs],
        timestamp=_now_ms() if timestamp is None else timestamp, offset_delta=offset_delta,
    )


def make_batch(
    *values: Bytes | Record,
    records: Iterable[Record] | None = None,
    topic: str = "test-topic",
    partition: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    transactional: bool = False,
    compression: str = "none",
) -> RecordBatch:
    """A topic-partition batch as the proxy hands it to an interceptor.

    Positional ``values`` become records (a value as bytes or text, or a
    :class:`Record`), numbered by offset delta 0, 1, ... and stamped with one
    timestamp; or pass ``records``. A :class:`Record` keeps its offset delta, unless
    every record of the batch has 0 (:func:`make_record`'s default, which no batch of
    two records or more has in Kafka): then they are numbered 0, 1, ... With neither,
    the batch holds one record. The producer fields default to a plain (not
    idempotent) producer's.
    """
    if records is None:
        stamp = _now_ms()
        records = [v if isinstance(v, Record)
                   else make_record(v, timestamp=stamp, offset_delta=i)
                   for i, v in enumerate(values or (b"value",))]
    elif values:
        raise TypeError("make_batch takes values or records=, not both")
    records = tuple(records)
    if len(records) > 1 and not any(r.offset_delta for r in records):
        records = tuple(r.with_offset_delta(i) for i, r in enumerate(records))
    return RecordBatch(topic=topic, partition=partition, records=records,
                       producer_id=producer_id, producer_epoch=producer_epoch,
                       base_sequence=base_sequence, transactional=transactional,
                       compression=compression)


def make_context(**fields: Any) -> InterceptContext:
    """An :class:`InterceptContext` as the proxy fills it for a Produce v9, acks=all client.

    Any field can be given; ``deadline`` is set by :func:`run_interceptor` from ``timeout_ms``.
    """
    defaults: dict[str, Any] = {
        "client_id": "kiproxy-test", "client_address": "127.0.0.1:50000", "principal": None,
        "api_version": 9, "acks": -1, "transactional_id": None,
        "deadline": time.monotonic() + DEFAULT_TIMEOUT_MS / 1000,
        "received_at_ms": _now_ms(), "proxy_host": socket.gethostname(),
    }
    return InterceptContext(**{**defaults, **fields})


def make_consumed_batch(batch: RecordBatch | None = None, *, base_offset: int = 0,
                        **fields: Any) -> ConsumedBatch:
    """A fetched batch as the proxy hands it to ``on_consume``: ``batch`` (default
    :func:`make_batch` of ``fields``) as the broker would return it at ``base_offset``."""
    source = batch if batch is not None else make_batch(**fields)
    return ConsumedBatch(topic=source.topic, partition=source.partition,
                         base_offset=base_offset, records=source.records,
                         producer_id=source.producer_id, producer_epoch=source.producer_epoch,
                         transactional=source.transactional, compression=source.compression)


def make_consume_context(**fields: Any) -> ConsumeContext:
    """A :class:`ConsumeContext` as the proxy fills it for a Fetch v17 consumer."""
    defaults: dict[str, Any] = {
        "client_id": "kiproxy-test", "client_address": "127.0.0.1:50000", "principal": None,
        "api_version": 17, "deadline": time.monotonic() + DEFAULT_TIMEOUT_MS / 1000,
        "proxy_host": socket.gethostname(),
    }
    return ConsumeContext(**{**defaults, **fields})


def run_consume(interceptor: Any, batch: ConsumedBatch, ctx: ConsumeContext | None = None, *,
                timeout_ms: int = DEFAULT_TIMEOUT_MS, name: str | None = None
                ) -> ConsumedBatch | ConsumeRefusal:
    """Hand ``batch`` to ``interceptor.on_consume`` by the proxy's rules: the batch the
    consumer would get, or why its partition would be refused. Never raises for anything
    the plugin does; a ``batch`` that is not a :class:`ConsumedBatch` is the test's
    mistake, a ``TypeError``."""
    if not isinstance(batch, ConsumedBatch):  # else the plugin is refused for it
        raise TypeError(f"run_consume takes a ConsumedBatch, not {type(batch).__name__}; "
                        "make_consumed_batch(batch) makes one of a batch make_batch built")
    out = run_consume_blocks(interceptor, [batch], ctx, timeout_ms=timeout_ms, name=name)
    return out if isinstance(out, ConsumeRefusal) else out[0]


def run_consume_blocks(interceptor: Any, batches: Sequence[ConsumedBatch],
                       ctx: ConsumeContext | None = None, *,
                       timeout_ms: int = DEFAULT_TIMEOUT_MS, name: str | None = None
                       ) -> list[ConsumedBatch | ConsumeRefusal] | ConsumeRefusal:
    """Hand ``batches`` (one fetched partition's, in log order) to ``interceptor`` as the
    proxy hands them to a chain's first link: to ``on_consume_blocks`` all at once when
    it has one (else each to ``on_consume_block``), and each batch answered None to
    ``on_consume``. The batch the consumer would get or the refusal, for each batch;
    or the :class:`ConsumeRefusal` of the whole partition (the call raised, ran out of
    time or did not answer once per block). Where the proxy ends the partition's answer
    at the first refused batch, this goes on, so that a test sees every answer."""
    for batch in batches:
        if not isinstance(batch, ConsumedBatch):
            raise TypeError(f"run_consume_blocks takes ConsumedBatch objects, not "
                            f"{type(batch).__name__}; make_consumed_batch(batch) makes one")
    if isinstance(interceptor, Plugin):
        name = name or interceptor.name
        interceptor = interceptor.interceptor
    timeout = timeout_ms / 1000
    context = dataclasses.replace(ctx or make_consume_context(),
                                  deadline=time.monotonic() + timeout)
    return _run_to_end(_consume(interceptor, list(batches), context,
                                name=name or type(interceptor).__name__, timeout=timeout))


async def _consume(interceptor: Any, batches: list[ConsumedBatch], ctx: ConsumeContext, *,
                   name: str, timeout: float
                   ) -> list[ConsumedBatch | ConsumeRefusal] | ConsumeRefusal:
    """``batches`` (one partition's) through ``interceptor`` as the proxy's fetch path
    runs a chain's first link: as records blocks first when it has ``on_consume_blocks``
    (all in one call) or ``on_consume_block`` (one by one), else (or on None) as
    records."""
    whole = consume_blocks_hook(interceptor) is not None
    blocks = {i: _block_of(batch) for i, batch in enumerate(batches) if batch.records
              and (whole or consume_block_hook(interceptor) is not None)}
    answers: dict[int, bytes | memoryview | ConsumeRefusal | None] = {}
    if whole and blocks:
        judged = await judge_consume_blocks(interceptor, list(blocks.values()), ctx,
                                            name=name, timeout=timeout)
        if isinstance(judged, ConsumeRefusal):
            return judged
        answers = dict(zip(blocks, judged, strict=True))
    out: list[ConsumedBatch | ConsumeRefusal] = []
    for i, batch in enumerate(batches):
        block = blocks.get(i)
        if block is not None:
            answer = answers[i] if whole else await judge_consume_block(
                interceptor, block, batch.records, ctx, name=name, timeout=timeout)
            if isinstance(answer, ConsumeRefusal):
                out.append(answer)
                continue
            if answer is block.data:
                out.append(batch)
                continue
            if answer is not None:
                out.append(batch.with_records(decode_records(
                    bytes(answer), 0, len(answer), len(batch.records), block.base_timestamp)))
                continue
        out.append(consume_encodable(await judge_consume(interceptor, batch, ctx, name=name,
                                                         timeout=timeout), batch, name))
    return out


def _block_of(batch: ConsumedBatch) -> ConsumedBlock:
    """``batch`` as the records block the proxy hands a block hook."""
    base = batch.records[0].timestamp
    return ConsumedBlock(
        topic=batch.topic, partition=batch.partition, base_offset=batch.base_offset,
        base_timestamp=base, record_count=len(batch.records),
        data=memoryview(encode_records(batch.records, base, False)[0]),
        producer_id=batch.producer_id, producer_epoch=batch.producer_epoch,
        transactional=batch.transactional, compression=batch.compression)


@dataclass(frozen=True, slots=True)
class Plugin:
    """An interceptor loaded as the proxy loads it, and the name the proxy's messages use."""

    interceptor: Any
    """The configured instance."""
    name: str
    """The spec it was loaded by (``module:Class``)."""

    def run(self, batch: RecordBatch, ctx: InterceptContext | None = None, *,
            timeout_ms: int = DEFAULT_TIMEOUT_MS, mode: Mode = "enforce") -> Outcome:
        """:func:`run_interceptor` on this plugin."""
        return run_interceptor(self, batch, ctx, timeout_ms=timeout_ms, mode=mode)

    def consume(self, batch: ConsumedBatch, ctx: ConsumeContext | None = None, *,
                timeout_ms: int = DEFAULT_TIMEOUT_MS) -> ConsumedBatch | ConsumeRefusal:
        """:func:`run_consume` on this plugin."""
        return run_consume(self, batch, ctx, timeout_ms=timeout_ms)

    def consume_blocks(self, batches: Sequence[ConsumedBatch],
                       ctx: ConsumeContext | None = None, *,
                       timeout_ms: int = DEFAULT_TIMEOUT_MS
                       ) -> list[ConsumedBatch | ConsumeRefusal] | ConsumeRefusal:
        """:func:`run_consume_blocks` on this plugin."""
        return run_consume_blocks(self, batches, ctx, timeout_ms=timeout_ms)

    def close(self) -> None:
        """Run the interceptor's ``close()`` as the proxy does at shutdown: an ``async def
        close()`` is awaited, on the event loop the plugin ran on."""
        close = getattr(self.interceptor, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                _run_to_end(result)

    def __enter__(self) -> Plugin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(spec: str, *, plugins_dir: str | Path | None = None,
         config: Mapping[str, Any] | None = None) -> Plugin:
    """Load and configure ``spec`` with the proxy's loader (raises ``PluginLoadError``)."""
    return Plugin(load_interceptor(spec, plugins_dir, config), spec)


def _judge_args(interceptor: Any, batch: RecordBatch, ctx: InterceptContext | None,
                timeout_ms: int, name: str | None) -> tuple[Any, RecordBatch,
                                                            InterceptContext, str, float]:
    if isinstance(interceptor, Plugin):
        name = name or interceptor.name
        interceptor = interceptor.interceptor
    if produce_hook(interceptor) is None:  # else it is "refused" for a missing method
        raise TypeError(f"{type(interceptor).__name__} has no intercept(): it is a "
                        "fetch-side hook only; run_consume runs its on_consume")
    timeout = timeout_ms / 1000
    # As in the proxy, the deadline starts when the batch is handed over.
    context = dataclasses.replace(ctx or make_context(), deadline=time.monotonic() + timeout)
    return interceptor, batch, context, name or type(interceptor).__name__, timeout


async def run_interceptor_async(
    interceptor: Any, batch: RecordBatch, ctx: InterceptContext | None = None, *,
    timeout_ms: int = DEFAULT_TIMEOUT_MS, name: str | None = None, mode: Mode = "enforce",
) -> Outcome:
    """:func:`run_interceptor` for a test that already runs on an event loop."""
    plugin, batch, context, label, timeout = _judge_args(interceptor, batch, ctx, timeout_ms,
                                                         name)
    verdict = await judge(plugin, batch, context, name=label, timeout=timeout)
    if mode == "enforce":  # observed, a batch goes on as it came: nothing is encoded
        verdict = encodable(verdict, batch, label)
    return Outcome.of(verdict, mode, batch)


_loops = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop for plugins, kept across calls as the proxy's is."""
    loop: asyncio.AbstractEventLoop | None = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
        atexit.register(loop.close)
    return loop


def run_interceptor(
    interceptor: Any, batch: RecordBatch, ctx: InterceptContext | None = None, *,
    timeout_ms: int = DEFAULT_TIMEOUT_MS, name: str | None = None, mode: Mode = "enforce",
) -> Outcome:
    """Hand ``batch`` to ``interceptor`` by the proxy's rules and say what becomes of it.

    ``interceptor`` is an instance or a :class:`Plugin` from :func:`load`;
    ``ctx`` defaults to :func:`make_context`'s; ``timeout_ms`` is the deadline;
    ``name`` names the plugin in messages (default: the spec it was loaded by,
    or its class name); ``mode`` is the route's (``observe``: the outcome is
    ``unchanged`` and :attr:`Outcome.would` holds the observed verdict's). Never
    raises for anything the plugin does; an ``interceptor`` with no ``intercept``
    (a fetch-side hook only, for :func:`run_consume`) is the test's mistake, a
    ``TypeError``.
    """
    return _run_to_end(run_interceptor_async(interceptor, batch, ctx, timeout_ms=timeout_ms,
                                             name=name, mode=mode))


def _run_to_end(awaitable: Awaitable[_T]) -> _T:
    """Await ``awaitable`` on this thread's plugin loop (:func:`_thread_loop`)."""
    async def wait() -> _T:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _thread_loop().run_until_complete(wait())
    # Called from a coroutine: that loop is busy here, so a thread of our own runs the plugin.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: _thread_loop().run_until_complete(wait())).result()
