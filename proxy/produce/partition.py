"""One topic-partition of a ProduceRequest: decode, intercept, re-encode.

Contract: :meth:`PartitionHandler.handle` decodes a partition's record batches
(off the loop for large ones, within the decode budget), hands each data batch
to the single interceptor - or to a route's chain
(:func:`~kiproxy.proxy.routes.runtime.run_route`) - and answers with a
:class:`PartitionResult`: no records when nothing changed (the partition stays
as it lies in the request frame, decoded there without a copy), the re-encoded
batches (original codec, every producer field kept) when some interceptor
transformed one, or a :class:`Rejection` for the whole partition.
Control batches pass untouched. Fail closed: a batch that cannot be decoded
(old format, unknown codec, corrupt, over the decompression limits) rejects
the partition. What counts as unchanged, transformed or rejected is decided by
:func:`kiproxy.interceptors.verdict.judge` alone; plugin faults are metered and
logged here, policy rejections by the pipeline once per request.

The handler owns the partition's :class:`~kiproxy.proxy.produce.offload.DecodeLease` and
releases it when the partition is done. A transformed batch large enough to be
re-encoded on a decode thread is not waited for: once the interceptor has seen
every batch of the partition, :meth:`PartitionHandler.handle` answers with a task
that finishes the re-encoding (the pipeline awaits these in partition order), so a
request's next partition is decoded and intercepted while this one compresses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kiproxy.interceptors.api import AcknowledgedBatch, InterceptContext, RecordBatch
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.interceptors.verdict import Rejected, Transformed, Unchanged, judge
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression
from kiproxy.protocol.errors import (
    CorruptBatch,
    DecompressionLimitExceeded,
    UnsupportedCompression,
    UnsupportedMagic,
)
from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.protocol.produce_request import PartitionSpan, ProduceLayout
from kiproxy.protocol.records import CompressionLevels
from kiproxy.proxy.observe.verdict_log import VerdictLog
from kiproxy.proxy.produce.response import Rejection
from kiproxy.proxy.routes.runtime import LoadedChain, run_route

if TYPE_CHECKING:
    import logging

    from kiproxy.interceptors.identity import ClientIdentity
    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.produce.offload import DecodeLease

__all__ = ["PartitionHandler", "PartitionResult"]

CORRUPT_MESSAGE = ErrorCode.CORRUPT_MESSAGE
UNSUPPORTED_FOR_MESSAGE_FORMAT = ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT
UNSUPPORTED_COMPRESSION_TYPE = ErrorCode.UNSUPPORTED_COMPRESSION_TYPE
INVALID_RECORD = ErrorCode.INVALID_RECORD

_FAULT_METRICS = {"timeout": "timeout", "raised": "raised", "record_count": "record_count"}
"""kiproxy_interceptor_errors reason per plugin fault (a wrong return type has none)."""


_CODEC_NAMES = {codec: codec.name.lower() for codec in Compression}


def _log_fields(ctx: InterceptContext, topic: str, partition: int,
                route: str | None = None) -> dict[str, object]:
    return {"client_address": ctx.client_address, "client_id": ctx.client_id,
            "principal": ctx.principal, "topic": topic, "partition": partition,
            "route": route}


@dataclass(slots=True)
class PartitionResult:
    """What the proxy decided for one topic-partition of a ProduceRequest."""

    records: bytes | None
    """The re-encoded records when ``changed``; None otherwise (refused, or forwarded as
    they lie in the request frame)."""
    changed: bool = False
    """The interceptor transformed at least one batch: ``records`` were re-encoded."""
    acknowledged: list[AcknowledgedBatch] = dataclasses.field(default_factory=list)
    """The batches the acknowledgement hook hears about once the broker answered."""
    rejection: Rejection | None = None
    """Why the partition is not forwarded, when it is not."""


def _refused(topic_key: Any, partition: int, code: int, message: str,
             reason: str) -> PartitionResult:
    return PartitionResult(None, rejection=Rejection(topic_key, partition, code, message,
                                                     reason=reason))


Piece = bytes | memoryview | asyncio.Future[bytes]
"""One batch of a partition on its way out: its bytes (a view into the request frame when
unchanged), or its re-encoding on a thread."""


def _discard(pieces: list[Piece]) -> None:
    """Let go of re-encodings nobody will read (their exceptions retrieved)."""
    for piece in pieces:
        if not isinstance(piece, asyncio.Future):
            continue
        if not piece.done():
            piece.cancel()
        elif not piece.cancelled():
            piece.exception()


@dataclass(slots=True)
class _Encoding:
    """A partition the interceptor is done with whose re-encoding is still running."""

    pieces: list[Piece]
    acknowledged: list[AcknowledgedBatch]
    client: RequestingClient
    chain: LoadedChain | None
    topic: str
    topic_key: Any
    partition: int



class PartitionHandler:
    """Runs one topic-partition's batches through the interceptor or a route's chain."""

    def __init__(self, interceptor: Any | None, *, name: str, timeout: float,
                 route_name: str | None, log: logging.Logger,
                 compression_levels: CompressionLevels | None = None,
                 proxy_host: str | None = None, metrics: Metrics | None = None) -> None:
        self.interceptor = interceptor
        """The single interceptor (None when batches go through routes' chains)."""
        self.name = name
        self.timeout = timeout
        self.route_name = route_name
        """The route the single interceptor's partitions are tallied under."""
        self.compression_levels = compression_levels or DEFAULT_LEVELS
        """Levels a batch the interceptor changed is re-compressed with (its own codec)."""
        self.proxy_host = proxy_host or socket.gethostname()
        self.metrics = metrics
        self.log = log
        self.verdict_log = VerdictLog(log)
        self.acknowledges = False
        """The single interceptor has an ``on_acknowledgement`` hook (a chain knows its
        own): only then are the batches it will hear about written down."""
        self._limit_warnings = RateLimitedLog(log)

    async def handle(
        self,
        client: RequestingClient,
        request: Any,
        version: int,
        topic: str,
        topic_key: Any,
        part: PartitionSpan,
        frame: bytes,
        received_at_ms: int,
        lease: DecodeLease,
        chain: LoadedChain | None = None,
    ) -> PartitionResult | asyncio.Task[PartitionResult]:
        """Decode, intercept (the one interceptor, or ``chain``) and re-encode one
        topic-partition's batches; release ``lease`` when done.

        The answer is a task when re-encoding still runs on a decode thread (the
        interceptor has seen every batch): await it for the partition's result.
        """
        route = chain.name if chain is not None else None  # the shorthand's lines as before
        finishing = False
        try:
            if part.data_end == part.data_start:  # null or empty: nothing to look at
                return PartitionResult(None)
            result = await self._decode_and_intercept(client, request, version, topic,
                                                      topic_key, part, frame, received_at_ms,
                                                      lease, chain)
            if isinstance(result, _Encoding):
                task = asyncio.ensure_future(self._finish(result, lease, route))
                finishing = True
                return task
            if result.rejection is not None:
                result.rejection.route = route
            return result
        finally:
            if not finishing:
                lease.release()

    async def _finish(self, encoding: _Encoding, lease: DecodeLease,
                      route: str | None) -> PartitionResult:
        """The partition's result once every re-encoding has finished."""
        pieces = encoding.pieces
        try:
            out = []
            for piece in pieces:
                if not isinstance(piece, asyncio.Future):
                    out.append(piece)
                    continue
                try:
                    out.append(await piece)
                except Exception as exc:
                    result = self._unencodable(encoding.client, encoding.chain, encoding.topic,
                                               encoding.topic_key, encoding.partition, exc)
                    assert result.rejection is not None
                    result.rejection.route = route
                    return result
            return PartitionResult(b"".join(out), changed=True,
                                   acknowledged=encoding.acknowledged)
        finally:
            _discard(pieces)
            lease.release()

    def _unencodable(self, client: RequestingClient, chain: LoadedChain | None, topic: str,
                     topic_key: Any, partition: int, exc: Exception) -> PartitionResult:
        """Records the plugin returned that cannot be encoded (not Records, a header key
        that is not UTF-8, a timestamp out of range): the plugin's fault, so the
        partition is rejected like a raise."""
        who = client.identity
        name = self.name if chain is None else f"of route {chain.name}"
        message = (f"interceptor {name} returned records that cannot "
                   f"be encoded: {type(exc).__name__}: {exc}")
        self.verdict_log.fault(name, "encode", f"{topic}[{partition}]",
                               who.client_address, who.client_id, message,
                               extra=client.log_context,
                               route=chain.name if chain is not None else None)
        return PartitionResult(None, rejection=Rejection(
            topic_key, partition, INVALID_RECORD, message, logged=True))

    async def _decode_and_intercept(
        self, client: RequestingClient, request: ProduceLayout, version: int, topic: str,
        topic_key: Any, part: PartitionSpan, frame: bytes, received_at_ms: int,
        lease: DecodeLease, chain: LoadedChain | None,
    ) -> PartitionResult | _Encoding:
        try:
            batches = await lease.decode(frame, part.data_start, part.data_end)
        except UnsupportedMagic as exc:
            return _refused(topic_key, part.partition, UNSUPPORTED_FOR_MESSAGE_FORMAT, str(exc),
                            "old_format")
        except UnsupportedCompression as exc:
            return _refused(topic_key, part.partition, UNSUPPORTED_COMPRESSION_TYPE, str(exc),
                            "unsupported_compression")
        except DecompressionLimitExceeded as exc:
            self._warn_limit(client, topic, part.partition, exc)
            return _refused(topic_key, part.partition, INVALID_RECORD, str(exc),
                            "decompression_limit")
        except CorruptBatch as exc:
            return _refused(topic_key, part.partition, CORRUPT_MESSAGE, f"corrupt batch: {exc}",
                            "corrupt")

        out: list[Piece] = []
        try:
            return await self._intercept_batches(client, request, version, topic, topic_key,
                                                 part, received_at_ms, lease, chain, batches,
                                                 out)
        except BaseException:
            _discard(out)
            raise

    async def _intercept_batches(
        self, client: RequestingClient, request: ProduceLayout, version: int, topic: str,
        topic_key: Any, part: PartitionSpan, received_at_ms: int, lease: DecodeLease,
        chain: LoadedChain | None, batches: list[Any], out: list[Piece],
    ) -> PartitionResult | _Encoding:
        who = client.identity
        timeout = self.timeout if chain is None else chain.links[0].timeout
        hooked = self.acknowledges or (chain is not None and bool(chain.hooks))
        acked: list[AcknowledgedBatch] = []
        changed = False
        threaded = False
        record_offset = 0
        for decoded in batches:
            h = decoded.header
            if h.is_control:
                out.append(decoded.raw)
                continue
            view = RecordBatch(
                topic=topic, partition=part.partition, records=decoded.records,
                producer_id=h.producer_id, producer_epoch=h.producer_epoch,
                base_sequence=h.base_sequence, transactional=h.is_transactional,
                compression=_CODEC_NAMES[h.compression],
            )
            ctx = InterceptContext(
                client_id=who.client_id, client_address=who.client_address,
                principal=who.principal, api_version=version, acks=request.acks,
                transactional_id=request.transactional_id,
                deadline=time.monotonic() + timeout, received_at_ms=received_at_ms,
                proxy_host=self.proxy_host, identity=who,
            )
            if chain is None:
                result = await self._intercept(view, ctx, topic, part.partition, record_offset)
            else:
                result = await self._intercept_chain(chain, view, ctx, topic, part.partition,
                                                     record_offset)
            if isinstance(result, Rejection):
                _discard(out)
                result.topic = topic_key
                return PartitionResult(None, rejection=result)
            if isinstance(result, Unchanged):
                out.append(decoded.raw)
                transformed = False
            else:
                try:
                    piece = lease.start_encode(h, tuple(result.batch.records),
                                               self.compression_levels, decoded.block_size)
                except Exception as exc:
                    _discard(out)
                    return self._unencodable(client, chain, topic, topic_key, part.partition, exc)
                out.append(piece)
                threaded = threaded or not isinstance(piece, bytes)
                changed = transformed = True
            if hooked:
                acked.append(AcknowledgedBatch(topic=topic, partition=part.partition,
                                               record_count=len(decoded.records),
                                               transformed=transformed))
            record_offset += len(decoded.records)
        if not changed:
            return PartitionResult(None, acknowledged=acked)
        if threaded:
            return _Encoding(out, acked, client, chain, topic, topic_key, part.partition)
        return PartitionResult(b"".join(cast("list[bytes | memoryview]", out)), changed=True,
                               acknowledged=acked)

    def _warn_limit(self, client: RequestingClient, topic: str, partition: int,
                    exc: DecompressionLimitExceeded) -> None:
        """One WARNING per client host per interval: a bomb, or a limit set too low."""
        who: ClientIdentity = client.identity
        suppressed = self._limit_warnings.allow(who.client_host)
        if suppressed is None:
            return
        more = f" ({suppressed} more from this host since the last warning)" if suppressed else ""
        self.log.warning("refused %s[%d] from %s (client_id %r): %s%s", topic, partition,
                    who.client_address, who.client_id, exc, more, extra=client.log_context)

    async def _intercept(
        self, view: RecordBatch, ctx: InterceptContext, topic: str, partition: int,
        record_offset: int,
    ) -> Unchanged | Transformed | Rejection:
        """The verdict on one batch (:func:`~kiproxy.interceptors.verdict.judge`), metered
        and, for a plugin fault, logged; a rejection's record indices made request-wide."""
        started = time.perf_counter()
        verdict = await judge(self.interceptor, view, ctx, name=self.name, timeout=self.timeout)
        return self._judged(verdict, self.name, started, ctx, topic, partition, record_offset,
                            None)

    async def _intercept_chain(
        self, chain: LoadedChain, view: RecordBatch, ctx: InterceptContext, topic: str,
        partition: int, record_offset: int,
    ) -> Unchanged | Transformed | Rejection:
        """:meth:`_intercept` for a route's chain: each link judged in turn."""
        started = time.perf_counter()
        decided = await run_route(chain, view, ctx)
        return self._judged(decided.verdict, decided.link, started, ctx, topic, partition,
                            record_offset, chain.name)

    def _judged(self, verdict: Unchanged | Transformed | Rejected, name: str, started: float,
                ctx: InterceptContext, topic: str, partition: int, record_offset: int,
                route: str | None) -> Unchanged | Transformed | Rejection:
        metrics = self.metrics
        if metrics is not None and not (isinstance(verdict, Rejected)
                                        and verdict.fault == "raised"):
            metrics.interceptor_seconds.observe(time.perf_counter() - started)
        if not isinstance(verdict, Rejected):
            return verdict
        if verdict.fault is not None:
            if metrics is not None and verdict.fault in _FAULT_METRICS:
                metrics.interceptor_errors.labels(_FAULT_METRICS[verdict.fault]).inc()
            self.verdict_log.rejected(verdict, name, f"{topic}[{partition}]",
                                      ctx.client_address, ctx.client_id,
                                      extra=_log_fields(ctx, topic, partition, route),
                                      route=route)
        return Rejection(topic, partition, verdict.code, verdict.message, tuple(
            (record_offset + i, m) for i, m in verdict.record_errors),
            logged=verdict.fault is not None, route=route)
