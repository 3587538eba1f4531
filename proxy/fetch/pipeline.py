"""The fetch-side hook: a Fetch response's hooked partitions decoded, handed to their
route's fetch-side hooks, re-encoded and spliced back.

Contract:

- Only a generation with a fetch-side hook on some route
  (:attr:`~kiproxy.proxy.routes.runtime.LoadedRoutes.consumes`) looks at Fetch
  responses at all; without one a Fetch answer is forwarded as its bytes.
- :meth:`FetchPipeline.rewrite` reads the response's layout
  (:func:`~kiproxy.protocol.fetch_response.read_fetch_response`: positions, no record
  decoded) and selects each topic's route as the produce side does, by the consumer's
  identity and the topic (:meth:`~kiproxy.proxy.routes.table.ClientRoutes.select_fetch`).
  A response with no hooked partition holding records is returned as the same bytes.
- On a hooked partition, every whole magic-2 data batch is handed to the route's
  fetch-side hooks, last link first (as its records block to those with
  ``on_consume_block``, until one answers None; see
  :mod:`~kiproxy.interceptors.consume`). A batch is decoded (on the loop, or on a
  decode thread within ``max_decode_memory`` when large, by the produce side's
  :class:`~kiproxy.proxy.produce.offload.BatchOffload`) only when a link needs its
  records. A block hook gets the block of an uncompressed batch where it lies in the
  answer, its CRC checked, and that of a compressed one decompressed, not decoded
  (where and within the budget a decode would run); a block a hook returns is
  checked against the block it replaces. Control
  batches, legacy (magic 0/1) entries (counted) and the partial last batch the broker
  may send at ``max_bytes`` stay as the broker sent them. A batch no hook changed
  keeps its bytes; a changed one is re-encoded by
  :func:`~kiproxy.protocol.batch_reencode.reencode_batch_parts`, or around its new
  block by :func:`~kiproxy.protocol.records.encode_block_parts` (codec,
  base offset, offset deltas, timestamps and producer fields kept), and the
  partition's ``records`` field is spliced
  (:func:`~kiproxy.protocol.fetch_splice.splice_fetch_pieces`; the answer is written as
  its pieces, not joined into new bytes): every other byte of
  the response - error codes, high watermark, last stable offset, log start offset,
  aborted transactions, preferred read replica, session id, tagged fields - is copied.
- A batch a hook refuses - it raises (:class:`~kiproxy.interceptors.consume.RefuseFetch`
  or anything else), returns something else than a batch of the same shape, or misses
  its deadline (``timeout_ms``, as on the produce side: a plain hook is refused when it
  returns past it) - and a batch that cannot be decoded end the partition's answer
  there: the entries before it are sent (changed or not, as a broker's answer cut at
  ``max_bytes``; every other field as the broker sent it) and the consumer fetches
  from that batch next. When it is the answer's first entry, the partition is
  answered with an error code and no records (``UNKNOWN_SERVER_ERROR`` unless the
  hook named one): consumers retry it; the other partitions and the connection go
  on. A topic id (Fetch v13+) the proxy has not
  learned from a Metadata response is answered ``UNKNOWN_TOPIC_ID`` on its
  partitions with records, so the consumer refreshes its metadata through the proxy.
  An answer in which every partition with records is answered with such an error
  delivers nothing to read: it is held :data:`REFUSED_ANSWER_HOLD_S` before it is
  sent, as a backoff for clients that fetch again at once (aiokafka does on
  ``UNKNOWN_SERVER_ERROR``).
  Each error answered is logged at WARNING (with the hook's traceback when it
  raised), rate-limited per topic and reason.
- An answer's hooks have the longest ``timeout_ms`` of a partition's links, counted
  from when the answer's hooks start: a batch that would start past it is not handed
  to them, and the partition's answer ends before it as above, with no error (counted
  ``deferred``, logged at WARNING rate-limited), so that hooks each on time cannot add
  up past what a consumer waits for one answer. Each partition hands its first batch
  whatever the time, so every fetch moves on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.consume import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    consume_block_hook,
    consume_blocks_hook,
)
from kiproxy.interceptors.consume_verdict import (
    ConsumeRefusal,
    judge_consume,
    judge_consume_block,
    judge_consume_blocks,
    unencodable,
)
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.protocol.batch_reencode import BatchShapeChanged, reencode_batch_parts
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression, CompressionLevels
from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.fetch_batches import (
    FetchedBatch,
    FetchedRecords,
    split_fetched_records,
)
from kiproxy.protocol.fetch_response import (
    FIRST_FLEXIBLE_VERSION,
    LATEST_VERSION,
    OLDEST_VERSION,
    FetchLayout,
    FetchPartition,
    read_fetch_response,
)
from kiproxy.protocol.fetch_splice import splice_fetch_pieces
from kiproxy.protocol.framing import parse_response_header
from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.protocol.parallel import blocks_around, verify_crcs
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    DEFAULT_DECOMPRESSION_LIMITS,
    Record,
    RecordBatchHeader,
    decode_records,
    encode_block_parts,
)
from kiproxy.proxy.fetch.source import BatchSource
from kiproxy.proxy.produce.offload import BatchOffload, DecodeLease

if TYPE_CHECKING:
    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.net.frame_stream import FramePieces
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.routes.chain import LoadedLink
    from kiproxy.proxy.routes.runtime import LoadedRoutes

log = logging.getLogger("kiproxy.fetch")

__all__ = ["FETCH_VERSIONS", "REFUSED_ANSWER_HOLD_S", "FetchPipeline"]

FETCH_VERSIONS = (OLDEST_VERSION, LATEST_VERSION)
"""The Fetch versions whose responses the proxy decodes (what ApiVersions offers when a
fetch-side hook is configured)."""

_CODEC_NAMES = {codec: codec.name.lower() for codec in Compression}

REFUSED_ANSWER_HOLD_S = 0.1
"""How long an answer that delivers no record because the proxy refused partitions is
held before it is sent: a client's own retry backoff (``retry.backoff.ms``, 100 ms), for
the clients that fetch again at once on an error (aiokafka)."""


_Work = tuple[tuple[int, int], str, FetchPartition, "Sequence[LoadedLink]", str]
"""A hooked partition: its place in the answer, topic, layout, links and route name."""


class FetchPipeline:
    """Runs the hooked partitions of Fetch responses through their routes' fetch-side
    hooks (see the module docstring)."""

    def __init__(self, routes: LoadedRoutes | None, *, topic_names: dict[uuid.UUID, str],
                 proxy_host: str = "", compression_levels: CompressionLevels | None = None,
                 offload: BatchOffload | None = None, metrics: Metrics | None = None,
                 max_version: int = LATEST_VERSION) -> None:
        self.routes = routes if routes is not None and routes.consumes else None
        """The routes, when some route has a fetch-side hook; else None."""
        self.hooks = self.routes is not None
        """Fetch responses are looked at (some route has a fetch-side hook)."""
        self.max_version = max_version
        """Highest Fetch version offered when :attr:`hooks` (12 with ``workers`` > 1:
        v13 names topics by id, learned per process)."""
        self.topic_names = topic_names
        self.proxy_host = proxy_host
        self.levels = compression_levels or DEFAULT_LEVELS
        self.offload = offload or BatchOffload(DEFAULT_DECOMPRESSION_LIMITS)
        """Decompression limits, the decode memory budget and the decode threads (the
        produce pipeline's: one budget for the process)."""
        self.metrics = metrics
        self._counters: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._refusals = RateLimitedLog(log)

    def rewrite(self, client: RequestingClient, version: int, frame: bytes
                ) -> bytes | Coroutine[Any, Any, bytes | FramePieces]:
        """The Fetch response ``frame`` (no size prefix) as the consumer gets it: the frame
        itself when no partition is hooked (decided here, without waiting), else a
        coroutine that runs the hooks and returns the frame, or the new one as pieces
        (views of ``frame`` and the changed batches, to be written, not joined)."""
        routes = self.routes
        if routes is None:
            return frame
        _, body = parse_response_header(frame, 1 if version >= FIRST_FLEXIBLE_VERSION else 0)
        layout = read_fetch_response(frame, body, version)
        choose = client.routes(routes.table)
        work: list[_Work] = []
        errors: dict[tuple[int, int], int] = {}
        for ti, topic in enumerate(layout.topics):
            name = topic.name
            if name is None and topic.topic_id is not None:
                name = self.topic_names.get(topic.topic_id)
                if name is None:
                    for pj, part in enumerate(topic.partitions):
                        if part.data_end > part.data_start:
                            errors[ti, pj] = ErrorCode.UNKNOWN_TOPIC_ID
                            self._log_refusal(client, str(topic.topic_id), part.partition,
                                              "unknown_topic_id", "topic id unknown to the "
                                              "proxy; the consumer is told to refresh "
                                              "metadata")
                    continue
            if name is None:
                continue
            route = choose.select_fetch(name)
            if route is None:
                continue
            consumers = routes.chain(route).consumers
            if not consumers:
                continue
            for pj, part in enumerate(topic.partitions):
                if part.error_code == 0 and part.data_end > part.data_start:
                    work.append(((ti, pj), name, part, consumers, route.name))
        if not work and not errors:
            return frame
        return self._run_hooks(client, version, frame, body, layout, work, errors)

    async def _run_hooks(self, client: RequestingClient, version: int, frame: bytes,
                         body: int, layout: FetchLayout, work: list[_Work],
                         errors: dict[tuple[int, int], int]) -> bytes | FramePieces:
        replacements: dict[tuple[int, int], list[bytes | memoryview]] = {}
        if work:
            who = client.identity
            ctx = ConsumeContext(
                client_id=who.client_id, client_address=who.client_address,
                principal=who.principal, api_version=version, deadline=0.0,
                proxy_host=self.proxy_host, identity=who)
            started = time.monotonic()
            outcomes = await asyncio.gather(*(
                self._partition(frame, name, part, consumers, ctx, started)
                for _, name, part, consumers, _ in work))
            for (key, name, part, _, route), outcome in zip(work, outcomes, strict=True):
                if isinstance(outcome, ConsumeRefusal):
                    errors[key] = outcome.code
                    self._log_refusal(client, name, part.partition, outcome.reason,
                                      outcome.message, outcome.exception, route=route)
                elif outcome is not None:
                    replacements[key] = outcome
        if not replacements and not errors:
            return frame
        if errors and not any(part.data_end > part.data_start and (ti, pj) not in errors
                              for ti, topic in enumerate(layout.topics)
                              for pj, part in enumerate(topic.partitions)):
            await asyncio.sleep(REFUSED_ANSWER_HOLD_S)  # nothing to read: as a backoff
        spliced = splice_fetch_pieces(frame, body, version, replacements, layout,
                                      error_codes=errors)
        assert isinstance(spliced, list)  # something is replaced
        return spliced

    async def _partition(self, frame: bytes, topic: str, part: FetchPartition,
                         consumers: Sequence[LoadedLink], ctx: ConsumeContext,
                         started: float
                         ) -> list[bytes | memoryview] | ConsumeRefusal | None:
        """The partition's new ``records`` bytes (as pieces to join), None when no hook
        changed a batch, or why the partition is refused. ``started``: when the answer's
        hooks started (:meth:`_batches` stops handing batches to hooks past its time)."""
        try:
            fetched = split_fetched_records(frame, part.data_start, part.data_end)
        except CorruptBatch as exc:
            return ConsumeRefusal(ErrorCode.UNKNOWN_SERVER_ERROR,
                            f"the broker's records cannot be read: {exc}", "undecodable")
        lease = self.offload.lease()
        try:
            return await self._batches(frame, topic, part, fetched, consumers, ctx, lease,
                                       started)
        finally:
            lease.release()

    async def _batches(self, frame: bytes, topic: str, part: FetchPartition,
                       fetched: FetchedRecords, consumers: Sequence[LoadedLink],
                       ctx: ConsumeContext, lease: DecodeLease, started: float
                       ) -> list[bytes | memoryview] | ConsumeRefusal | None:
        data: list[BatchSource] = []  # the batches hooks are handed, in log order
        for batch in fetched.batches:
            if batch.header is None:
                self._count(topic, "legacy", 0)
            elif not batch.header.is_control:
                data.append(BatchSource(frame, batch, lease))
        if not data:
            return None
        first: list[bytes | memoryview | ConsumeRefusal | None] = []
        if consume_blocks_hook(consumers[0].interceptor) is not None:
            answered = await self._whole(topic, part.partition, data, consumers[0], ctx)
            if isinstance(answered, ConsumeRefusal):
                return self._stopped(topic, part.partition, fetched, data[0].batch, [],
                                     memoryview(frame)[fetched.start:data[0].batch.start],
                                     replace(answered, message=f"{_at(data[0].header)} "
                                             f"and later ones: {answered.message}"))
            first = answered
        budget = max(link.timeout for link in consumers)
        changes: list[tuple[BatchSource, bytes | tuple[bytes, ...]]] = []
        cut: tuple[BatchSource, ConsumeRefusal | None] | None = None
        for i, source in enumerate(data):
            header = source.header
            links, given, blocks = consumers, None, True
            if i < len(first):  # answered by the first link's on_consume_blocks
                answer = first[i]
                if isinstance(answer, ConsumeRefusal):
                    cut = (source, replace(answer, message=f"{_at(header)}: {answer.message}"))
                    break
                if answer is None:
                    blocks = False  # the same link, with records
                else:
                    links = consumers[1:]
                    given = answer if isinstance(answer, bytes) else None
            if links and i and (elapsed := time.monotonic() - started) >= budget:
                # (the first batch is handed to the hooks whatever the time)
                self._deferred(topic, part.partition, fetched, source.batch, ctx, budget,
                               elapsed)
                cut = (source, None)  # as a broker's answer cut at max_bytes
                break
            written: bytes | tuple[bytes, ...] | None = None
            try:
                outcome = await self._chain(topic, part.partition, source, links, ctx,
                                            block=given, blocks=blocks) if links else given
                if isinstance(outcome, bytes) and self._together(source, outcome):
                    written = outcome
                elif outcome is not None and not isinstance(outcome, ConsumeRefusal):
                    try:
                        written = await self._encode(source, outcome)
                    except (CorruptBatch, BatchShapeChanged):
                        raise  # the broker's batch, or its shape: said below
                    except (ValueError, TypeError, OverflowError) as exc:
                        # What the hooks returned cannot be written (a str where bytes
                        # go, a header key no UTF-8 spells, a timestamp out of range);
                        # anything else is the proxy's own fault, and closes as such.
                        outcome = unencodable(_names(links or consumers[:1]), exc)
            except CorruptBatch as exc:
                cut = (source, ConsumeRefusal(ErrorCode.UNKNOWN_SERVER_ERROR,
                                              f"{_at(header)} cannot be decoded: {exc}",
                                              "undecodable"))
                break
            except BatchShapeChanged as exc:
                cut = (source, ConsumeRefusal(ErrorCode.UNKNOWN_SERVER_ERROR,
                                              f"{_at(header)}: {exc}", "shape_changed"))
                break
            if isinstance(outcome, ConsumeRefusal):
                cut = (source, replace(outcome, message=f"{_at(header)}: {outcome.message}"))
                break
            source.done()
            if written is None:
                self._count(topic, "unchanged", header.record_count)
            else:
                changes.append((source, written))
        return self._pieces(frame, topic, part.partition, fetched, changes, cut)

    def _together(self, source: BatchSource, block: bytes) -> bool:
        """Whether ``source``'s new ``block`` is written with the others after the hooks
        (:func:`blocks_around`, the CRCs over threads): that of an uncompressed batch
        small enough to be written on the loop; any other change is written as the
        hooks go (:meth:`_encode`), its time counted in the answer's."""
        return not source.header.attributes & 0x07 \
            and len(block) <= self.offload.inline_plain_bytes

    async def _whole(self, topic: str, partition: int, data: list[BatchSource],
                     link: LoadedLink, ctx: ConsumeContext
                     ) -> list[bytes | memoryview | ConsumeRefusal | None] | ConsumeRefusal:
        """The answers of ``link``'s ``on_consume_blocks`` for the batches of ``data``, up
        to the first whose records block cannot be read (that one and the later ones are
        left to the per-batch path, which says why) or is compressed and finds no room
        in ``max_decode_memory`` now to be decompressed and held with the others (the
        later ones are handed one by one, and wait for the budget as any decode does);
        the CRCs of the uncompressed ones checked in one call. The decompressed blocks
        are reserved while the call runs."""
        plain = [s for s in data if not s.header.attributes & 0x07]
        bad = verify_crcs(plain[0].frame, [(s.batch.start, s.batch.end) for s in plain]) \
            if plain else -1
        blocks: list[ConsumedBlock] = []
        view = memoryview(data[0].frame)
        for source in data:
            if bad >= 0 and source is plain[bad]:
                break
            if not source.header.attributes & 0x07:  # where it lies, its CRC checked above
                source.crc_checked = True
                block = view[source.batch.start + BATCH_HEADER_SIZE:source.batch.end]
            else:  # held, reserved while the call runs, when the budget has room now
                try:
                    held = await source.block_held()
                except CorruptBatch:
                    break
                if held is None:
                    break
                block = held
            blocks.append(_given(topic, partition, source.header, block))
        if not blocks:
            return []
        try:
            return await judge_consume_blocks(link.interceptor, blocks,
                                              _with_deadline(ctx, link.timeout),
                                              name=link.name, timeout=link.timeout,
                                              limits=link.limits)
        finally:  # the per-batch path that follows reserves what it decodes itself
            data[0].lease.release_kept()

    def _pieces(self, frame: bytes, topic: str, partition: int, fetched: FetchedRecords,
                changes: list[tuple[BatchSource, bytes | tuple[bytes, ...]]],
                cut: tuple[BatchSource, ConsumeRefusal | None] | None
                ) -> list[bytes | memoryview] | ConsumeRefusal | None:
        """The partition's new ``records`` as pieces: each of ``changes`` in its place (a
        new block written around now, with the others, or the pieces written already),
        the answer ended before ``cut`` (a refused or deferred batch) when there is one;
        the refusal itself when it is the answer's first entry."""
        view = memoryview(frame)
        pieces: list[bytes | memoryview] = []
        copied = fetched.start
        together = [(source, new) for source, new in changes if isinstance(new, bytes)]
        written = iter(blocks_around([s.header for s, _ in together],
                                     [new for _, new in together]) if together else ())
        for source, new in changes:
            if isinstance(new, bytes):
                new = next(written) or encode_block_parts(source.header, new,
                                                          levels=self.levels)
            self._count(topic, "transformed", source.header.record_count)
            pieces.append(view[copied:source.batch.start])
            pieces.extend(new)
            copied = source.batch.end
        if cut is not None:
            source, refusal = cut
            if refusal is None:  # deferred: nothing from it on, no error
                pieces.append(view[copied:source.batch.start])
                return pieces
            return self._stopped(topic, partition, fetched, source.batch, pieces,
                                 view[copied:source.batch.start], refusal)
        if not pieces:
            return None
        pieces.append(view[copied:fetched.end])  # later batches and the partial tail
        return pieces  # written as pieces of the answer

    def _stopped(self, topic: str, partition: int, fetched: FetchedRecords,
                 batch: FetchedBatch, pieces: list[bytes | memoryview], kept: memoryview,
                 refusal: ConsumeRefusal) -> list[bytes | memoryview] | ConsumeRefusal:
        """The partition's answer when ``batch`` is refused: the refusal when it is the
        answer's first entry, else ``pieces`` (the entries before it, as sent or as
        changed) ended by ``kept`` (those since the last changed one): nothing from
        ``batch`` on, as a broker's answer cut at ``max_bytes`` ends there. The consumer
        fetches from ``batch`` next and is answered the refusal then."""
        header = batch.header
        assert header is not None
        if batch.start == fetched.start:
            if refusal.reason != "undecodable":
                self._count(topic, "refused", header.record_count)
            return refusal
        log.debug("%s[%d] answered up to offset %d, where its next fetch is refused: %s",
                  topic, partition, header.base_offset, refusal.message)
        pieces.append(kept)
        return pieces

    def _deferred(self, topic: str, partition: int, fetched: FetchedRecords,
                  batch: FetchedBatch, ctx: ConsumeContext, budget: float,
                  elapsed: float) -> None:
        """Count and log the batches from ``batch`` on, left for the consumer's next
        fetch because the answer's hooks (every partition's: ``elapsed`` seconds since
        they started) have had their time, ``budget``."""
        header = batch.header
        assert header is not None
        later = [b.header for b in fetched.batches
                 if b.start >= batch.start and b.header is not None and not b.header.is_control]
        for h in later:
            self._count(topic, "deferred", h.record_count)
        self._refusals.warning(
            (topic, "deferred"), "fetch from %s (client_id %r): %s[%d] answered up to offset "
            "%d: the fetch-side hooks of this answer (all its partitions) had run for %.0f "
            "ms, past %.0f ms (the longest timeout_ms of their links); %d batches from there "
            "wait for the consumer's next fetch", ctx.client_address, ctx.client_id, topic,
            partition, header.base_offset, elapsed * 1000, budget * 1000, len(later),
            more=" ({count} more since the last line)")

    async def _chain(self, topic: str, partition: int, source: BatchSource,
                     consumers: Sequence[LoadedLink], ctx: ConsumeContext, *,
                     block: bytes | None = None, blocks: bool = True
                     ) -> bytes | tuple[Record, ...] | ConsumeRefusal | None:
        """The batch of ``source`` through the links: None when no link changed it, the
        new records block (bytes) or records, or the refusal. Links with
        ``on_consume_block`` get the block (``block``, when an earlier link changed it)
        until a link answers None or has no such hook, or from the start when ``blocks``
        is false; from then on every link gets records (the batch is decoded then, and
        only then when it is uncompressed). Raises ``CorruptBatch``."""
        header = source.header
        codec = _CODEC_NAMES[header.compression]
        records: tuple[Record, ...] | None = None
        on_blocks = blocks
        for link in consumers:
            if on_blocks and consume_block_hook(link.interceptor) is not None:
                given = _given(topic, partition, header,
                               await source.block() if block is None else memoryview(block))
                answer = await judge_consume_block(
                    link.interceptor, given, source.records, _with_deadline(ctx, link.timeout),
                    name=link.name, timeout=link.timeout, limits=link.limits)
                if isinstance(answer, ConsumeRefusal):
                    return answer
                if answer is not None:
                    if answer is not given.data:
                        block = bytes(answer)
                    continue
            if on_blocks:
                on_blocks = False
                if block is not None:  # an earlier link's block, as records
                    records = decode_records(block, 0, len(block), header.record_count,
                                             header.base_timestamp)
                    block = None
            if records is None:
                records = (await source.decoded()).records
            batch = ConsumedBatch(
                topic=topic, partition=partition, base_offset=header.base_offset,
                records=records, producer_id=header.producer_id,
                producer_epoch=header.producer_epoch, transactional=header.is_transactional,
                compression=codec)
            result = await judge_consume(link.interceptor, batch,
                                         _with_deadline(ctx, link.timeout), name=link.name,
                                         timeout=link.timeout, limits=link.limits)
            if isinstance(result, ConsumeRefusal):
                return result
            records = result.records
        if block is not None:
            return block
        return None if records is None or records is source.records else records

    async def _encode(self, source: BatchSource, new: bytes | tuple[Record, ...]
                      ) -> tuple[bytes, ...]:
        """The batch of ``source`` written again with ``new`` (a records block or
        records), its place in the log kept; compressed on a worker thread when large,
        as on produce."""
        encode: Callable[[], tuple[bytes, ...]]
        if isinstance(new, bytes):
            encode = partial(encode_block_parts, source.header, new, levels=self.levels)
            size = len(new)
        else:
            decoded = await source.decoded()
            encode = partial(reencode_batch_parts, decoded, new, levels=self.levels)
            size = decoded.block_size
        if size <= self.offload.inline_plain_bytes:
            return encode()
        parts: tuple[bytes, ...] = await self.offload.run(encode)
        return parts

    def _count(self, topic: str, outcome: str, records: int) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        counters = self._counters.get((topic, outcome))
        if counters is None:  # the labelled children, looked up once per topic and outcome
            counters = self._counters[topic, outcome] = (
                metrics.fetch_batches.labels(topic, outcome),
                metrics.fetch_records.labels(topic, outcome))
        counters[0].inc()
        if records:
            counters[1].inc(records)

    def _log_refusal(self, client: RequestingClient, topic: str, partition: int,
                     reason: str, message: str, exception: BaseException | None = None,
                     *, route: str | None = None) -> None:
        """A WARNING (with the hook's traceback when it raised), naming the route whose
        hooks ran, unless one for ``topic`` and ``reason`` was written lately."""
        self._refusals.warning(
            (topic, reason), "fetch from %s (client_id %r)%s: %s[%d] answered with an error: %s",
            client.identity.client_address, client.identity.client_id,
            "" if route is None else f" on route {route}", topic, partition,
            message, more=" ({count} more since the last line)", exc_info=exception,
            extra=client.log_context)


def _given(topic: str, partition: int, header: RecordBatchHeader, data: memoryview
           ) -> ConsumedBlock:
    """The batch of ``header`` as a block hook is handed it, its records block ``data``."""
    return ConsumedBlock(
        topic=topic, partition=partition, base_offset=header.base_offset,
        base_timestamp=header.base_timestamp, record_count=header.record_count, data=data,
        producer_id=header.producer_id, producer_epoch=header.producer_epoch,
        transactional=header.is_transactional, compression=_CODEC_NAMES[header.compression])


def _with_deadline(ctx: ConsumeContext, timeout: float) -> ConsumeContext:
    """``ctx`` for one hook call: its deadline ``timeout`` seconds from now, the call's
    data being ready (a plain hook that returns past it is refused)."""
    return ConsumeContext(
        client_id=ctx.client_id, client_address=ctx.client_address, principal=ctx.principal,
        api_version=ctx.api_version, deadline=time.monotonic() + timeout,
        proxy_host=ctx.proxy_host,
        extra=ctx.extra, identity=ctx.identity)


def _names(links: Sequence[LoadedLink]) -> str:
    """How a refusal names the links whose records it is about."""
    return links[0].name if len(links) == 1 else "the fetch-side hooks " + ", ".join(
        link.name for link in links)


def _at(header: RecordBatchHeader) -> str:
    """A refused batch, as its refusal names it (formatted only when one is refused)."""
    return f"batch at offset {header.base_offset}"
