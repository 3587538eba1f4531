"""The produce pipeline: decode, intercept, re-encode, forward, merge the answer.

For each topic-partition of a ProduceRequest the proxy decodes the record
batches and hands each batch to the configured interceptor - or, with
``routes``, selects the route for the partition from the client's identity,
the topic, acks and whether the producer is transactional
(:meth:`~kiproxy.proxy.routes.table.ClientRoutes.select`, cached per connection
identity) and runs that route's chain; a partition no route (and no
``default``) matches is forwarded as it came, undecoded. A batch returned
unchanged is forwarded as its original bytes; a transformed one (same record
count, enforced) is re-encoded with the original codec and every producer
field kept. Rejection is per topic-partition, as a broker would do it: the
partitions that pass are forwarded, and the broker's answer is merged with the
rejections into one response (with ``error_message`` and ``record_errors`` on
v8+). A request with nothing left to forward is answered by the proxy; acks=0
requests get no answer either way.

Fail closed: a partition whose data cannot be decoded (old message format,
corrupt batch, unknown codec) is rejected, never forwarded unchecked. A plugin
that raises, breaks the record-count rule or misses its deadline rejects only
that partition; the connection stays open. What counts as unchanged,
transformed or rejected is decided by :func:`kiproxy.interceptors.verdict.judge`
alone (the same function replay and the isolation workers call); rejections are
logged by :class:`kiproxy.proxy.observe.verdict_log.VerdictLog` (policy at INFO, plugin
faults at WARNING, rate-limited).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.errors import ErrorCode, error_name
from kiproxy.protocol.errors import MalformedFrame, ProtocolError, UnsupportedVersion
from kiproxy.protocol.framing import RequestHeader, encode_response_header
from kiproxy.protocol.legacy_produce import (
    legacy_produce_acks_and_partitions,
    legacy_produce_error_response,
)
from kiproxy.protocol.messages import ApiKey
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.protocol.produce_request import PartitionSpan, read_produce_request
from kiproxy.protocol.produce_splice import splice_produce_request
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    CompressionLevels,
)
from kiproxy.protocol.wire import read_uvarint
from kiproxy.proxy.brokers.addresses import NodeSeen, needs_rewrite, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import PRODUCE_MAX_VERSION
from kiproxy.proxy.observe.dead_letter import DeadLetterCopy
from kiproxy.proxy.observe.verdict_log import VerdictLog
from kiproxy.proxy.produce.disposition import Answer, Disposition, Forward, PartitionTally
from kiproxy.proxy.produce.offload import BatchOffload
from kiproxy.proxy.produce.partition import PartitionHandler, PartitionResult
from kiproxy.proxy.produce.response import (
    Acked,
    Rejection,
    ResponseMerger,
    rejection_only_response,
)
from kiproxy.proxy.routes.runtime import LoadedChain, one_interceptor

if TYPE_CHECKING:
    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.observe.kafka_sink import KafkaSink
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.routes.runtime import LoadedRoutes

log = logging.getLogger("kiproxy.produce")

__all__ = ["PartitionResult", "ProducePipeline", "learn_topic_ids", "read_acks"]

CORRUPT_MESSAGE = ErrorCode.CORRUPT_MESSAGE
REQUEST_TIMED_OUT = ErrorCode.REQUEST_TIMED_OUT
UNSUPPORTED_FOR_MESSAGE_FORMAT = ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT
UNSUPPORTED_COMPRESSION_TYPE = ErrorCode.UNSUPPORTED_COMPRESSION_TYPE
INVALID_RECORD = ErrorCode.INVALID_RECORD
UNKNOWN_TOPIC_ID = ErrorCode.UNKNOWN_TOPIC_ID


def _node_rewriter(version: int, nodes_seen: NodeSeen | None
                   ) -> Callable[[bytes], bytes] | None:
    """What a forwarded answer needs when nothing is merged into it: its KIP-951
    node_endpoints (v10+) named as the proxy's listeners."""
    if nodes_seen is None or not needs_rewrite(ApiKey.PRODUCE, version):
        return None
    return partial(rewrite_response_frame, ApiKey.PRODUCE, version, seen=nodes_seen)


def learn_topic_ids(topic_names: dict[uuid.UUID, str], metadata: Any) -> None:
    """Record in ``topic_names`` the topic ids a Metadata response names (for Produce v13)."""
    for topic in getattr(metadata, "topics", ()):
        topic_id = getattr(topic, "topic_id", None)
        if topic_id is not None and topic.name and topic_id.int != 0:
            topic_names[topic_id] = topic.name


def read_acks(frame: bytes, body_offset: int, flexible: bool) -> int:
    """acks of a Produce v3+ request without parsing the rest of it.

    Only the transactional_id before acks is skipped; a body cut short raises
    :class:`ProtocolError` (the client is closed with one log line).
    """
    pos = body_offset
    if flexible:
        n, pos = read_uvarint(frame, pos, len(frame),
                              "Produce request transactional_id length", MalformedFrame)
        pos += max(n - 1, 0)
    else:
        size = int.from_bytes(frame[pos : pos + 2], "big", signed=True)
        pos += 2 + max(size, 0)
    if pos + 2 > len(frame):
        raise ProtocolError(f"Produce request truncated before acks (byte {pos})")
    return int.from_bytes(frame[pos : pos + 2], "big", signed=True)


_Slot = tuple[int, PartitionSpan, PartitionBatches, LoadedChain | None,
              PartitionResult | asyncio.Task[PartitionResult] | None]
"""A partition of a request: its position, data, batch headers (read once), chain and
what was decided (None: forwarded untouched; a task: re-encoding still running)."""


_UNREAD = PartitionBatches(start=0, end=0, headers=(), records=0, compressed_blocks=())
"""The headers of a partition forwarded untouched and not tallied: never read."""


def _tally(topic: str, partition: int, batches: PartitionBatches, chain: LoadedChain | None,
           done: PartitionResult | None) -> PartitionTally:
    """The tally of one decided partition (the broker's answer is added by the merger)."""
    outcome, code, message, link = "forwarded", 0, None, None
    if done is not None and done.rejection is not None:
        rejection = done.rejection
        outcome, code, message = "rejected", rejection.error_code, rejection.message
        link = rejection.link
    elif done is not None and done.changed:
        outcome = "transformed"
    observed: dict[str, Any] = {}
    if done is not None and done.watched:
        seen = next((o for o in done.observed if o.outcome == "rejected"),
                    done.observed[0] if done.observed else None)
        observed = {"observed_outcome": "unchanged"} if seen is None else {
            "observed_outcome": seen.outcome, "observed_error_code": seen.error_code,
            "observed_error_message": seen.message, "observed_link": seen.link}
    return PartitionTally(topic, partition, batches.batches, batches.records, batches.size,
                          outcome=outcome, error_code=code, error_message=message,
                          route=chain.name if chain is not None else None, link=link,
                          **observed)


class ProducePipeline:
    """Runs every produce request through the configured routes' chains."""

    def __init__(
        self,
        interceptor: Any | None = None,
        *,
        name: str = "",
        timeout_ms: int = 5000,
        offload: BatchOffload | None = None,
        proxy_host: str | None = None,
        compression_levels: CompressionLevels | None = None,
        max_version: int = PRODUCE_MAX_VERSION,
        metrics: Metrics | None = None,
        tallies: bool = False,
        topic_names: dict[uuid.UUID, str] | None = None,
        routes: LoadedRoutes | None = None,
        dead_letter: KafkaSink | None = None,
    ) -> None:
        if interceptor is not None:  # built in code: the shorthand's one-link route
            routes = one_interceptor(interceptor, name or type(interceptor).__name__,
                                     timeout_ms / 1000)
        self.routes = routes
        """Every route's loaded chain (None: no interceptor, every batch passes through)."""
        self.intercepts = routes is not None
        """Some batch may go through an interceptor (so Produce requests are decoded)."""
        single = routes.single if routes is not None else None
        self._single = single
        """The chain of every batch when there is one catch-all route (no selection)."""
        self._unnamed = single if single is not None and len(single.links) == 1 else None
        """The shorthand's chain (one link on one catch-all route): its log lines name
        no route."""
        self.max_version = max_version
        """Highest Produce version accepted: what the ApiVersions cut offers (12 with
        ``workers`` > 1, where topic ids are learned per process)."""
        self.offload = offload or BatchOffload(DEFAULT_DECOMPRESSION_LIMITS)
        """Decompression limits, the decode memory budget and the decode threads."""
        self.partitions = PartitionHandler(
            compression_levels=compression_levels, proxy_host=proxy_host, metrics=metrics,
            log=log)
        """Decodes, intercepts and re-encodes one topic-partition."""
        self.topic_names: dict[uuid.UUID, str] = {} if topic_names is None else topic_names
        """Topic id -> name, learned from Metadata responses (for Produce v13); shared by
        the generations of one process."""
        self.tallies = tallies
        """Responses are observed or metered, so each request is tallied per partition."""
        self.metrics = metrics
        self.verdict_log = VerdictLog(log)
        """Where every rejection is logged, once (see :meth:`_log_rejections`)."""
        self.dead_letter = dead_letter
        """Where routes with ``dead_letter`` copy refused records (the process's sink)."""

    @property
    def compression_levels(self) -> CompressionLevels:
        """Levels a batch an interceptor changed is re-compressed with (its own codec)."""
        return self.partitions.compression_levels

    def learn_topic_ids(self, metadata: Any) -> None:
        """Record topic ids named by a Metadata response."""
        learn_topic_ids(self.topic_names, metadata)

    @property
    def watched_files(self) -> list[Path]:
        """Files the loaded interceptors read (their ``watched_files``): a change reloads."""
        return list(dict.fromkeys(Path(f) for _, i in self.interceptors()
                                  for f in getattr(i, "watched_files", ())))

    def interceptors(self) -> tuple[tuple[str, Any], ...]:
        """``(name, interceptor)`` of every interceptor this pipeline runs."""
        return self.routes.interceptors() if self.routes is not None else ()

    async def close(self) -> None:
        """Run every interceptor's ``close()`` (the decode threads are the process's)."""
        if self.routes is not None:
            await self.routes.close()

    # ------------------------------------------------------------------ request

    async def handle(
        self,
        client: RequestingClient,
        header: RequestHeader,
        frame: bytes,
        nodes_seen: NodeSeen | None,
    ) -> Disposition:
        """Decide what reaches the broker and what the client is answered.

        Raises :class:`ProtocolError` for a request the proxy cannot read (a version
        it has no schema for, a body that does not parse): the connection then closes
        the client with one warning.
        """
        version = header.api_version
        if header.body_offset is None or version > self.max_version:
            # No schema (v14+ or negative), or one the pipeline was not built for: the
            # ApiVersions cut never offers it. Kafka closes a connection that sends a
            # request version it cannot parse; so does the proxy (ProtocolError).
            raise UnsupportedVersion(
                f"Produce request v{version} refused: the proxy reads Produce v3-"
                f"v{self.max_version} (and answers v0-v2 with an error); use a version "
                "offered in ApiVersions")
        if version < 3:
            return self._refuse_legacy(client, header, frame)
        if self.routes is None:
            if self.tallies:
                return self._tallied_passthrough(header, frame, nodes_seen)
            acks = read_acks(frame, header.body_offset, header.header_version == 2)
            return Forward(frame, expect_response=acks != 0,
                           on_response=_node_rewriter(version, nodes_seen))

        routes = self.routes
        request = read_produce_request(frame, header.body_offset, version)
        received_at_ms = int(time.time() * 1000)
        client_routes = client.routes(routes.table) if self._single is None else None
        transactional = request.transactional_id is not None
        hooked = False
        rejections: list[Rejection] = []
        acked: list[Acked] = []
        tallies: list[PartitionTally] | None = [] if self.tallies else None
        # Partitions forwarded, and topics that came without any (forwarded as they came):
        # none of either and the proxy answers the request itself.
        forwarded = sum(1 for topic in request.topics if not topic.partitions)
        # (topic position, partition position) -> new records; None: not forwarded.
        edits: dict[tuple[int, int], bytes | None] = {}
        # Per topic, in order: a partition forwarded untouched, or the handler's answer
        # (a task while its re-encoding runs on a decode thread; awaited in order below).
        slots: list[list[_Slot]] = []
        names: list[str] = []
        tasks: list[asyncio.Task[PartitionResult]] = []
        try:
            for topic in request.topics:
                topic_key: uuid.UUID | str | None = topic.name
                topic_name = topic.name
                if version >= 13:
                    topic_key = topic.topic_id
                    topic_name = (self.topic_names.get(topic.topic_id)
                                  if topic.topic_id is not None else None)
                names.append(topic_name or str(topic_key))
                topic_slots: list[_Slot] = []
                slots.append(topic_slots)
                for pj, part in enumerate(topic.partitions):
                    chain: LoadedChain | None = self._single
                    if client_routes is not None and topic_name is not None:
                        route = client_routes.select(topic_name, request.acks, transactional)
                        chain = routes.chain(route) if route is not None else None
                    if chain is None and topic_name is not None:
                        # No route and no default: forwarded untouched, its headers read
                        # only when it is tallied.
                        batches = (PartitionBatches.read(frame, part.data_start, part.data_end)
                                   if tallies is not None else _UNREAD)
                        topic_slots.append((pj, part, batches, None, None))
                        continue
                    batches = PartitionBatches.read(frame, part.data_start, part.data_end)
                    result: PartitionResult | asyncio.Task[PartitionResult]
                    if topic_name is None or chain is None:
                        result = PartitionResult(None, rejection=Rejection(
                            topic=topic_key, partition=part.partition,
                            error_code=UNKNOWN_TOPIC_ID,
                            message=f"topic id {topic_key} is unknown to the proxy; "
                                    "refresh metadata", reason="unknown_topic_id"))
                    else:
                        hooked = hooked or bool(chain.hooks)
                        result = await self.partitions.handle(
                            client, request, version, topic_name, topic_key, part.partition,
                            frame, batches, received_at_ms, self.offload.lease(), chain,
                            None if chain is self._unnamed else chain.name)
                        if isinstance(result, asyncio.Task):
                            tasks.append(result)
                    topic_slots.append((pj, part, batches, chain, result))

            for ti, topic in enumerate(request.topics):
                for pj, part, batches, chain, answer in slots[ti]:
                    done = None
                    if answer is not None:
                        done = await answer if isinstance(answer, asyncio.Task) else answer
                    if tallies is not None:
                        tallies.append(_tally(names[ti], part.partition, batches, chain, done))
                    if done is not None and done.observed and chain is not None:
                        self._observed(client, names[ti], part.partition, chain, done,
                                       received_at_ms)
                    if done is None:
                        forwarded += 1
                        continue
                    if done.rejection is not None:
                        rejection = done.rejection
                        rejections.append(rejection)
                        edits[ti, pj] = None
                        if chain is not None and chain.route.dead_letter is not None:
                            self._copy(client, chain, names[ti], part.partition, rejection,
                                       received_at_ms)
                        if self.metrics is not None:
                            self.metrics.rejected_batches.labels(rejection.reason).inc(
                                max(batches.batches, 1))
                        continue
                    if chain is not None and chain.hooks:
                        acked.append(Acked(topic.topic_id if version >= 13 else topic.name,
                                           part.partition, done.acknowledged, chain.hooks,
                                           chain.hook_names))
                    if done.changed:
                        edits[ti, pj] = done.records
                    forwarded += 1
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

        acks = request.acks
        if rejections:
            self._log_rejections(client, rejections)
        if not forwarded:
            if acks == 0:
                return Answer(None, produce=tallies)
            response_header = encode_response_header(header.correlation_id,
                                                      1 if header.header_version == 2 else 0)
            return Answer(response_header + rejection_only_response(version, rejections),
                          produce=tallies)

        if edits:
            # The new records spliced into the frame: no kio re-serialization.
            frame = splice_produce_request(frame, header.body_offset, version, edits, request)
        if acks == 0:
            return Forward(frame, expect_response=False, produce=tallies)
        if not rejections and not hooked and tallies is None:
            return Forward(frame, on_response=_node_rewriter(version, nodes_seen))
        return Forward(frame, on_response=self._merger(
            version, header.header_version == 2, rejections, acked, tallies, nodes_seen),
            produce=tallies)

    def _log_rejections(self, client: RequestingClient, rejections: list[Rejection]) -> None:
        """The one place a rejection is logged: policy at INFO, a plugin fault as a
        rate-limited WARNING (see :mod:`kiproxy.proxy.observe.verdict_log`)."""
        who = client.identity
        for r in rejections:
            where = f"{self.topic_names.get(r.topic, r.topic)}[{r.partition}]"
            if r.fault is None:
                self.verdict_log.policy(where, who.client_address, who.client_id,
                                        r.error_code, r.message, client.log_context,
                                        route=r.route)
            else:
                self.verdict_log.fault(
                    r.link or "", r.fault, where, who.client_address, who.client_id,
                    r.message, exception=r.exception, route=r.route,
                    extra={**client.log_context, "topic": self.topic_names.get(r.topic, r.topic),
                           "partition": r.partition})

    def _observed(self, client: RequestingClient, topic: str, partition: int,
                  chain: LoadedChain, done: PartitionResult, received_at_ms: int) -> None:
        """The one place what observe mode saw is recorded: the ``kiproxy_would_*``
        counters, a rate-limited log line, and (``dead_letter_observed``) the copy of
        what would have been refused."""
        who = client.identity
        route = chain.name
        for seen in done.observed:
            if self.metrics is not None:
                if seen.outcome == "rejected":
                    self.metrics.would_reject_batches.labels(route, seen.link, seen.reason).inc()
                    self.metrics.would_reject_records.labels(
                        route, seen.link, seen.reason).inc(seen.record_count)
                else:
                    self.metrics.would_transform_batches.labels(route, seen.link).inc()
                    self.metrics.would_transform_records.labels(route, seen.link).inc(
                        seen.record_count)
            detail = (f": error {seen.error_code}: {seen.message}"
                      if seen.outcome == "rejected" else "")
            self.verdict_log.observed("rejected" if seen.outcome == "rejected"
                                      else "transformed", f"{topic}[{partition}]",
                                      who.client_address, who.client_id, route, seen.link,
                                      detail, client.log_context)
            if seen.records and self.dead_letter is not None \
                    and chain.route.dead_letter is not None:
                self.dead_letter.offer(DeadLetterCopy(
                    topic=chain.route.dead_letter, source_topic=topic, partition=partition,
                    route=route, link=seen.link, error_code=seen.error_code,
                    error_name=error_name(seen.error_code), reason=seen.message or "",
                    client_id=who.client_id, principal=who.principal, time_ms=received_at_ms,
                    observed=True, records=seen.records,
                    record_reasons={i: m for i, m in seen.record_errors if m is not None}))

    def _copy(self, client: RequestingClient, chain: LoadedChain, topic: str,
              partition: int, rejection: Rejection, received_at_ms: int) -> None:
        """A refused partition's records to its route's dead-letter topic (never blocks)."""
        if self.dead_letter is None or not rejection.records:
            return
        who = client.identity
        assert chain.route.dead_letter is not None
        self.dead_letter.offer(DeadLetterCopy(
            topic=chain.route.dead_letter, source_topic=topic, partition=partition,
            route=chain.name, link=rejection.link, error_code=rejection.error_code,
            error_name=error_name(rejection.error_code), reason=rejection.message,
            client_id=who.client_id, principal=who.principal, time_ms=received_at_ms,
            observed=False, records=rejection.records,
            record_reasons={i: m for i, m in rejection.record_errors if m is not None}))

    def _merger(self, version: int, flexible: bool, rejections: list[Rejection],
                acked: list[Acked], tallies: list[PartitionTally] | None,
                nodes_seen: NodeSeen | None) -> ResponseMerger:
        return ResponseMerger(version=version, flexible=flexible, rejections=rejections,
                              acked=acked, tallies=tallies, topic_names=self.topic_names,
                              nodes_seen=nodes_seen)

    def _tallied_passthrough(self, header: RequestHeader, frame: bytes,
                             nodes_seen: NodeSeen | None) -> Disposition:
        """No interceptor, but observers or metrics want per-partition tallies."""
        assert header.body_offset is not None
        version = header.api_version
        request = read_produce_request(frame, header.body_offset, version)
        tallies = []
        for topic in request.topics:
            name = topic.name
            if version >= 13 and topic.topic_id is not None:
                name = self.topic_names.get(topic.topic_id)
            for part in topic.partitions:
                batches = PartitionBatches.read(frame, part.data_start, part.data_end)
                tallies.append(_tally(name or str(topic.topic_id), part.partition, batches,
                                      None, None))
        if request.acks == 0:
            return Forward(frame, expect_response=False, produce=tallies)
        return Forward(frame, on_response=self._merger(
            version, header.header_version == 2, [], [], tallies, nodes_seen), produce=tallies)

    def _refuse_legacy(
        self, client: RequestingClient, header: RequestHeader, frame: bytes
    ) -> Disposition:
        acks, topics = legacy_produce_acks_and_partitions(frame, header.body_offset or 0)
        who = client.identity
        log.warning("refused Produce v%d (old message format) from %s (client_id %r): "
                    "upgrade the client to magic-2 record batches (Produce v3+)",
                    header.api_version, who.client_address, who.client_id,
                    extra=client.log_context)
        if acks == 0:
            return Answer(None)
        body = legacy_produce_error_response(header.api_version, topics,
                                             UNSUPPORTED_FOR_MESSAGE_FORMAT)
        return Answer(encode_response_header(header.correlation_id, 0) + body)
