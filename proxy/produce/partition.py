"""One topic-partition of a ProduceRequest: decode, intercept, re-encode.

Contract: :meth:`PartitionHandler.decide` takes one
:class:`~kiproxy.proxy.produce.job.PartitionJob` and decodes the partition's record
batches where its :class:`~kiproxy.protocol.partition_batches.PartitionBatches` (its
headers, read once by the pipeline) says they lie (off the loop for large ones,
within the decode budget), hands each data batch to its route's chain
(:func:`~kiproxy.proxy.routes.chain.run_chain`; the ``interceptor:`` shorthand
is a chain of one link) and answers with one immutable
:class:`~kiproxy.proxy.produce.job.Decision`: no records when nothing changed (the
partition stays as it lies in the request frame, decoded there without a copy), the
re-encoded batches (original codec, every producer field kept) when some interceptor
transformed one, or a :class:`Rejection` for the whole partition.
Control batches pass untouched. Fail closed: a batch that cannot be decoded
(old format, unknown codec, corrupt, over the decompression limits) rejects
the partition. What counts as unchanged, transformed or rejected is decided by
:func:`kiproxy.interceptors.verdict.judge` alone; plugin faults are metered
here, and every rejection (policy or fault) is logged by the settle step, in one
place, from the :class:`~kiproxy.proxy.produce.response.Rejection` it carries.

The handler owns the partition's :class:`~kiproxy.proxy.produce.offload.DecodeLease` and
releases it when the partition is done. A transformed batch large enough to be
re-encoded on a decode thread is not waited for: once the interceptor has seen
every batch of the partition, :meth:`PartitionHandler.decide` answers with a task
that finishes the re-encoding (the pipeline awaits these in partition order), so a
request's next partition is decoded and intercepted while this one compresses.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from typing import TYPE_CHECKING, NamedTuple, cast

from kiproxy.interceptors.api import (
    AcknowledgedBatch,
    InterceptContext,
    RecordBatch,
    batch_from_fields,
    context_from_fields,
)
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.interceptors.verdict import Rejected, Transformed, Unchanged, encoding_fault
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression
from kiproxy.protocol.errors import (
    CorruptBatch,
    DecompressionLimitExceeded,
    UnsupportedCompression,
    UnsupportedMagic,
)
from kiproxy.protocol.log_limit import MORE_LIKE_IT, RateLimitedLog
from kiproxy.protocol.records import CompressionLevels, DecodedBatch, Record
from kiproxy.proxy.produce.job import FORWARDED, Decision, PartitionJob
from kiproxy.proxy.produce.response import Observation, Rejection
from kiproxy.proxy.routes.chain import ChainResult, run_chain

if TYPE_CHECKING:
    import logging

    from prometheus_client.metrics import Histogram

    from kiproxy.interceptors.identity import ClientIdentity
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.produce.offload import DecodeLease
    from kiproxy.proxy.routes.runtime import LoadedChain

__all__ = ["DECODE_LINK", "PartitionHandler"]

CORRUPT_MESSAGE = ErrorCode.CORRUPT_MESSAGE
UNSUPPORTED_FOR_MESSAGE_FORMAT = ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT
UNSUPPORTED_COMPRESSION_TYPE = ErrorCode.UNSUPPORTED_COMPRESSION_TYPE
INVALID_RECORD = ErrorCode.INVALID_RECORD


_CODEC_NAMES = {codec: codec.name.lower() for codec in Compression}


def _refused(job: PartitionJob, code: int, message: str, reason: str) -> Decision:
    return Decision(rejection=Rejection(
        topic=job.topic_key, partition=job.partition, error_code=code, message=message,
        reason=reason, route=job.route))


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


class _Encoding(NamedTuple):
    """A partition the interceptor is done with whose re-encoding is still running: its
    pieces, and its decision but for the records."""

    pieces: list[Piece]
    decision: Decision
    kept: list[DecodedBatch]
    """The partition's batches when the route keeps refused records (``dead_letter``),
    else none: what a refusal for unencodable records copies."""


class PartitionHandler:
    """Runs one topic-partition's batches through a route's chain."""

    def __init__(self, *, compression_levels: CompressionLevels | None = None,
                 proxy_host: str | None = None, metrics: Metrics | None = None,
                 log: logging.Logger) -> None:
        self.compression_levels = compression_levels or DEFAULT_LEVELS
        """Levels a batch the interceptor changed is re-compressed with (its own codec)."""
        self.proxy_host = proxy_host or socket.gethostname()
        self.metrics = metrics
        self.log = log
        self._limit_warnings = RateLimitedLog(log)
        self._timers: dict[str, Histogram] = {}
        """Route name -> its ``kiproxy_interceptor_duration_seconds`` child: ``labels()``
        costs about as much again as ``observe()``, so it is looked up once a route."""

    async def decide(self, job: PartitionJob,
                     lease: DecodeLease) -> Decision | asyncio.Task[Decision]:
        """Decode ``job``'s batches, run each through its chain and re-encode what it
        changed; ``lease`` is released once the partition is done.

        The answer is a task when re-encoding still runs on a decode thread (the
        interceptor has seen every batch): await it for the partition's decision.
        """
        try:
            decided = await self._decode_and_intercept(job, lease)
        except BaseException:
            lease.release()
            raise
        if isinstance(decided, _Encoding):
            task = asyncio.ensure_future(self._finish(job, decided, lease))
            # A task cancelled before its first step never runs _finish's ``finally``:
            # give the reservation back when it ends, however it ends (both idempotent).
            pieces = decided.pieces

            def settled(_: object) -> None:
                _discard(pieces)
                lease.release()

            task.add_done_callback(settled)
            return task
        lease.release()
        assert job.chain is not None
        if job.chain.route.observe and decided.rejection is not None:
            return _observed_refusal(decided.rejection, job.batches.records)
        return decided

    async def _finish(self, job: PartitionJob, encoding: _Encoding,
                      lease: DecodeLease) -> Decision:
        """The partition's decision once every re-encoding has finished."""
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
                    return self._unencodable(job, exc, encoding.kept)
            decision = encoding.decision
            return Decision(records=b"".join(out), changed=True,
                            acknowledged=decision.acknowledged, observed=decision.observed,
                            watched=decision.watched)
        finally:
            _discard(pieces)
            lease.release()

    async def _decode_and_intercept(self, job: PartitionJob,
                                    lease: DecodeLease) -> Decision | _Encoding:
        if job.batches.start == job.batches.end:  # null or empty: nothing to look at
            return FORWARDED
        try:
            decoded = await lease.decode_partition(job.facts.frame, job.batches)
        except UnsupportedMagic as exc:
            return _refused(job, UNSUPPORTED_FOR_MESSAGE_FORMAT, str(exc), "old_format")
        except UnsupportedCompression as exc:
            return _refused(job, UNSUPPORTED_COMPRESSION_TYPE, str(exc),
                            "unsupported_compression")
        except DecompressionLimitExceeded as exc:
            self._warn_limit(job, exc)
            return _refused(job, INVALID_RECORD, str(exc), "decompression_limit")
        except CorruptBatch as exc:
            return _refused(job, CORRUPT_MESSAGE, f"corrupt batch: {exc}", "corrupt")

        out: list[Piece] = []
        try:
            return await self._intercept_batches(job, lease, decoded, out)
        except BaseException:
            _discard(out)
            raise

    async def _intercept_batches(self, job: PartitionJob, lease: DecodeLease,
                                 batches: list[DecodedBatch],
                                 out: list[Piece]) -> Decision | _Encoding:
        chain = job.chain
        assert chain is not None
        facts = job.facts
        topic, partition = job.topic, job.partition
        who = job.client.identity
        timeout = chain.links[0].timeout
        hooked = bool(chain.hooks)
        observing = chain.route.observe
        sample = chain.route.observe_sample if observing else 1.0
        keep = chain.route.dead_letter is not None  # refused records are copied
        watched = False
        watching = observing or chain.observe_links  # a judged batch is watched
        copy = chain.route.dead_letter_observed
        links = chain.links
        acked: list[AcknowledgedBatch] = []
        observed: list[Observation] = []
        changed = False
        threaded = False
        record_offset = 0
        for decoded in batches:
            h = decoded.header
            if h.is_control:
                out.append(decoded.raw)
                continue
            if sample < 1.0 and random.random() >= sample:  # not evaluated: as received
                out.append(decoded.raw)
                record_offset += len(decoded.records)
                continue
            view = batch_from_fields(topic, partition, decoded.records, h.producer_id,
                                     h.producer_epoch, h.base_sequence, h.is_transactional,
                                     _CODEC_NAMES[h.compression])
            ctx = context_from_fields(who.client_id, who.client_address, who.principal,
                                      facts.version, facts.acks, facts.transactional_id,
                                      time.monotonic() + timeout, facts.received_at_ms,
                                      self.proxy_host, {}, who)
            decided = await self._run(chain, view, ctx)
            watched = watched or watching
            if decided.observed:
                observed.extend(_observation(o.link, o.verdict, view, copy)
                                for o in decided.observed)
            verdict = decided.verdict
            if observing:  # recorded; the batch goes on exactly as it came
                if not isinstance(verdict, Unchanged):
                    link = links[len(links) - 1 if decided.rejected_by is None
                                 else decided.rejected_by].name
                    observed.append(_observation(link, verdict, view, copy))
                verdict = Unchanged(view)
            if isinstance(verdict, Rejected):
                _discard(out)
                records = _sent(batches) if keep else ()
                return Decision(rejection=Rejection(
                    topic=job.topic_key, partition=partition, error_code=verdict.code,
                    message=verdict.message,
                    record_errors=tuple((record_offset + i, m)
                                        for i, m in verdict.record_errors),
                    route=job.route, link=links[decided.rejected_by or 0].name,
                    fault=verdict.fault, exception=verdict.exception, records=records),
                    observed=tuple(observed), watched=watched)
            if isinstance(verdict, Unchanged):
                out.append(decoded.raw)
                transformed = False
            else:
                try:
                    piece = lease.start_encode(h, tuple(verdict.batch.records),
                                               self.compression_levels, decoded.block_size)
                except Exception as exc:
                    _discard(out)
                    return self._unencodable(job, exc, batches if keep else [])
                out.append(piece)
                threaded = threaded or not isinstance(piece, bytes)
                changed = transformed = True
            if hooked:
                acked.append(AcknowledgedBatch(topic=topic, partition=partition,
                                               record_count=len(decoded.records),
                                               transformed=transformed))
            record_offset += len(decoded.records)
        if not changed:
            if not (acked or observed or watched):
                return FORWARDED
            return Decision(acknowledged=tuple(acked), observed=tuple(observed),
                            watched=watched)
        joined = None if threaded else b"".join(cast("list[bytes | memoryview]", out))
        decision = Decision(records=joined, changed=True, acknowledged=tuple(acked),
                            observed=tuple(observed), watched=watched)
        return _Encoding(out, decision, batches if keep else []) if threaded else decision

    def _warn_limit(self, job: PartitionJob, exc: DecompressionLimitExceeded) -> None:
        """One WARNING per client host per interval: a bomb, or a limit set too low."""
        client = job.client
        who: ClientIdentity = client.identity
        self._limit_warnings.warning(
            who.client_host, "refused %s[%d] from %s (client_id %r): %s", job.topic,
            job.partition, who.client_address, who.client_id, exc, more=MORE_LIKE_IT,
            extra=client.log_context)

    async def _run(self, chain: LoadedChain, view: RecordBatch,
                   ctx: InterceptContext) -> ChainResult:
        """The chain's verdict on one batch (:func:`~kiproxy.proxy.routes.chain.run_chain`,
        each link judged by :func:`~kiproxy.interceptors.verdict.judge`), metered by route:
        its time, and every plugin fault under the fault's own name as ``reason``."""
        metrics = self.metrics
        route = chain.route.name
        if metrics is None:  # nothing to meter: no clock read
            return await run_chain(route, chain.links, view, ctx)
        started = time.perf_counter()
        decided = await run_chain(route, chain.links, view, ctx)
        verdict = decided.verdict
        fault = verdict.fault if isinstance(verdict, Rejected) else None
        if fault != "raised":
            timer = self._timers.get(route)
            if timer is None:
                timer = self._timers[route] = metrics.interceptor_seconds.labels(route)
            timer.observe(time.perf_counter() - started)
        if fault is not None:
            metrics.interceptor_errors.labels(fault, route).inc()
        return decided

    def _unencodable(self, job: PartitionJob, exc: Exception,
                     kept: list[DecodedBatch]) -> Decision:
        """Records the plugin returned that cannot be encoded (not Records, a header key
        with a surrogate that stands for no byte, a timestamp out of range): the plugin's
        fault, so the partition is rejected like a raise, and counted as its
        ``return_type`` fault; the records of ``kept`` (the batches as the producer sent
        them, or none) are what a dead-letter copy holds. The chain's records are
        encoded once all its links have run, so the refusal names a link only when the
        chain has one."""
        chain = job.chain
        assert chain is not None
        if self.metrics is not None:
            self.metrics.interceptor_errors.labels("return_type", chain.route.name).inc()
        link = chain.links[0].name if len(chain.links) == 1 else None
        name = link if job.route is None and link is not None else f"of route {chain.name}"
        rejected = encoding_fault(name, exc)
        return Decision(rejection=Rejection(
            topic=job.topic_key, partition=job.partition, error_code=rejected.code,
            message=rejected.message, route=job.route, link=link, fault="encode",
            records=_sent(kept)))


def _sent(batches: list[DecodedBatch]) -> tuple[Record, ...]:
    """A partition's records as the producer sent them (its data batches'), in order."""
    return tuple(r for b in batches if not b.header.is_control for r in b.records)


DECODE_LINK = "(decode)"
"""The ``link`` label of what the proxy's own decoding would have refused."""


def _observed_refusal(rejection: Rejection, records: int) -> Decision:
    """A partition an observing route's decoding refused (old format, corrupt, over the
    limits): forwarded as received, like a partition no route matches, and recorded as
    what enforcing would have done."""
    return Decision(watched=True, observed=(Observation(
        link=rejection.link or DECODE_LINK, outcome="rejected", error_code=rejection.error_code,
        message=rejection.message, reason=rejection.reason, record_count=records),))


def _observation(link: str, verdict: Transformed | Rejected, batch: RecordBatch,
                 copy: bool) -> Observation:
    """An observed verdict as recorded: what the producer would have been told."""
    if isinstance(verdict, Transformed):
        return Observation(link=link, outcome="transformed", record_count=len(batch.records))
    return Observation(link=link, outcome="rejected", error_code=verdict.code,
                       message=verdict.message, reason=verdict.fault or verdict.error,
                       record_count=len(batch.records), record_errors=verdict.record_errors,
                       records=tuple(batch.records) if copy else ())


