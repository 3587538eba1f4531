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

How: :meth:`ProducePipeline.handle` reads the request once
(:func:`~kiproxy.protocol.produce_request.read_produce_request`), builds one
:class:`~kiproxy.proxy.produce.job.PartitionJob` per topic-partition, decides each
(:meth:`~kiproxy.proxy.produce.partition.PartitionHandler.decide`: one
:class:`~kiproxy.proxy.produce.job.Decision`), settles the decisions in request order
(:class:`~kiproxy.proxy.produce.settle.Settler`) and turns what they add up to into
the request's :data:`~kiproxy.proxy.produce.disposition.Disposition`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.errors import ErrorCode
from kiproxy.protocol._codec import produce_answer_untagged
from kiproxy.protocol.errors import UnsupportedVersion
from kiproxy.protocol.framing import RequestHeader, encode_response_header
from kiproxy.protocol.legacy_produce import (
    legacy_produce_acks_and_partitions,
    legacy_produce_error_response,
)
from kiproxy.protocol.messages import ApiKey
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.protocol.produce_request import (
    ProduceLayout,
    read_acks,
    read_produce_request,
    topic_key,
)
from kiproxy.protocol.produce_splice import splice_produce_request
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    CompressionLevels,
)
from kiproxy.proxy.brokers.addresses import NodeSeen, needs_rewrite, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import PRODUCE_MAX_VERSION
from kiproxy.proxy.produce.disposition import Answer, Disposition, Forward
from kiproxy.proxy.produce.job import FORWARDED, UNREAD, Decision, PartitionJob, RequestFacts
from kiproxy.proxy.produce.offload import BatchOffload
from kiproxy.proxy.produce.partition import PartitionHandler
from kiproxy.proxy.produce.response import (
    Rejection,
    ResponseMerger,
    Settled,
    rejection_only_response,
)
from kiproxy.proxy.produce.settle import Settler, summarize
from kiproxy.proxy.routes.runtime import one_interceptor

if TYPE_CHECKING:
    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.observe.kafka_sink import KafkaSink
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.routes.runtime import LoadedRoutes

log = logging.getLogger("kiproxy.produce")

__all__ = ["ProducePipeline", "learn_topic_ids"]

REQUEST_TIMED_OUT = ErrorCode.REQUEST_TIMED_OUT
INVALID_RECORD = ErrorCode.INVALID_RECORD
UNSUPPORTED_FOR_MESSAGE_FORMAT = ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT
UNKNOWN_TOPIC_ID = ErrorCode.UNKNOWN_TOPIC_ID


class _AnswerRewriter:
    """A forwarded answer's KIP-951 node_endpoints (v10+) named as the proxy's listeners.

    An answer that reads whole with no tagged field (what brokers send unless a leader
    moved) is passed on as it is after the compiled check; any other goes through
    :func:`~kiproxy.proxy.brokers.addresses.rewrite_response_frame`, which rewrites it
    or names what is wrong with it.
    """

    __slots__ = ("seen", "version")

    def __init__(self, version: int, seen: NodeSeen) -> None:
        self.version = version
        self.seen = seen

    def __call__(self, frame: bytes) -> bytes:
        if produce_answer_untagged(frame, self.version):
            return frame
        return rewrite_response_frame(ApiKey.PRODUCE, self.version, frame, seen=self.seen)


@lru_cache(maxsize=64)
def _node_rewriter(version: int, nodes_seen: NodeSeen | None
                   ) -> Callable[[bytes], bytes] | None:
    """What a forwarded answer needs when nothing is merged into it: its KIP-951
    node_endpoints (v10+) named as the proxy's listeners. One per version and registry
    (``nodes_seen`` is a bound method: equal for the same registry), not one a request."""
    if nodes_seen is None or not needs_rewrite(ApiKey.PRODUCE, version):
        return None
    return _AnswerRewriter(version, nodes_seen)


def learn_topic_ids(topic_names: dict[uuid.UUID, str], metadata: Any) -> None:
    """Record in ``topic_names`` the topic ids a Metadata response names (for Produce v13)."""
    for topic in getattr(metadata, "topics", ()):
        topic_id = getattr(topic, "topic_id", None)
        if topic_id is not None and topic.name and topic_id.int != 0:
            topic_names[topic_id] = topic.name


def _unknown_topic(job: PartitionJob) -> Decision:
    """A Produce v13 topic id the proxy has not learned: refused, the client told to
    refresh its metadata."""
    return Decision(rejection=Rejection(
        topic=job.topic_key, partition=job.partition, error_code=UNKNOWN_TOPIC_ID,
        message=f"topic id {job.topic_key} is unknown to the proxy; refresh metadata",
        reason="unknown_topic_id"))


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
        self.intercepts = routes is not None and routes.intercepts
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
        """Responses are observed or metered, so each request is summarized per partition."""
        self.settler = Settler(log=log, metrics=metrics, dead_letter=dead_letter,
                               topic_names=self.topic_names)
        """Where every decided partition's consequences go (verdict log, metrics, observe
        mode, dead-letter copies, acknowledgement hooks, summaries)."""

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
            if not self.tallies:
                forward = self.forward_as_received(header, frame, nodes_seen)
                assert forward is not None
                return forward
            return self._tallied_pass_through(client, header, frame, nodes_seen)
        request = read_produce_request(frame, header.body_offset, version)
        jobs = self._jobs(client, request, frame, version)
        empty_topics = sum(1 for topic in request.topics if not topic.partitions)
        settled = Settled(frame, empty_topics, [] if self.tallies else None)
        decisions: list[Decision | asyncio.Task[Decision]] = []
        try:
            for job in jobs:  # a task while its re-encoding runs on a decode thread
                if not job.known:  # a v13 topic id the proxy has not learned
                    decisions.append(_unknown_topic(job))
                elif job.chain is None:  # no route holds: forwarded untouched
                    decisions.append(FORWARDED)
                else:
                    decisions.append(await self.partitions.decide(job, self.offload.lease()))
            for job, decided in zip(jobs, decisions, strict=True):
                self.settler.settle(job, await decided if isinstance(decided, asyncio.Task)
                                    else decided, settled)
        finally:
            for decided in decisions:
                if isinstance(decided, asyncio.Task) and not decided.done():
                    decided.cancel()
        if settled.rejections:
            self.settler.log_rejections(client, settled.rejections)
        return self._dispose(header, request, settled, nodes_seen)

    def forward_as_received(self, header: RequestHeader, frame: bytes,
                            nodes_seen: NodeSeen | None) -> Forward | None:
        """The request forwarded as it came, decided without waiting for anything, when
        nothing in it is decoded (no route, no tally) and its version is one the pipeline
        reads (v3 up to its ``max_version``): only its acks are read. ``None`` otherwise:
        :meth:`handle` decides (and refuses what this does not take)."""
        if self.routes is not None or self.tallies:
            return None
        version = header.api_version
        offset = header.body_offset
        if offset is None or not 3 <= version <= self.max_version:
            return None
        acks = read_acks(frame, offset, header.header_version == 2)
        return Forward(frame, expect_response=acks != 0,
                       on_response=_node_rewriter(version, nodes_seen))

    def _jobs(self, client: RequestingClient, request: ProduceLayout, frame: bytes,
              version: int) -> list[PartitionJob]:
        """Every topic-partition of ``request`` as the pipeline decides it: its topic,
        its route's chain (None: forwarded untouched) and its batch headers (read when
        something will look at them)."""
        routes = self.routes
        choose = (client.routes(routes.table)
                  if routes is not None and self.intercepts and self._single is None else None)
        facts = RequestFacts(frame, version, request.acks, request.transactional_id,
                             int(time.time() * 1000))
        jobs = []
        for ti, topic in enumerate(request.topics):
            key = topic_key(topic, version)
            name = topic.name if topic.name is not None else self.topic_names.get(key)
            chain = self._single
            if choose is not None and name is not None:
                assert routes is not None
                route = choose.select(name, request.acks, request.transactional_id is not None)
                chain = routes.chain(route) if route is not None else None
                if chain is not None and not chain.links:
                    chain = None  # the route's hooks are all fetch-side
            read = chain is not None or name is None or self.tallies
            for pj, part in enumerate(topic.partitions):
                batches = (PartitionBatches.read(frame, part.data_start, part.data_end)
                           if read else UNREAD)
                jobs.append(PartitionJob(
                    client, facts, name if name is not None else str(key), key,
                    part.partition, (ti, pj), batches, chain,
                    None if chain is None or chain is self._unnamed else chain.name,
                    known=name is not None))
        return jobs

    def _dispose(self, header: RequestHeader, request: ProduceLayout, settled: Settled,
                 nodes_seen: NodeSeen | None) -> Disposition:
        """The request's answer once every partition is settled: the proxy's own when
        nothing is forwarded, else the frame (spliced when some partition changed or
        was refused) with what the broker's answer needs merged into it."""
        summaries = settled.summaries
        version = header.api_version
        if not settled.forwarded:
            if request.acks == 0:
                return Answer(None, produce=summaries)
            response_header = encode_response_header(header.correlation_id,
                                                      1 if header.header_version == 2 else 0)
            return Answer(response_header + rejection_only_response(version, settled.rejections),
                          produce=summaries)
        frame = settled.frame
        if settled.edits:
            # The new records spliced into the frame: no kio re-serialization.
            assert header.body_offset is not None
            frame = splice_produce_request(frame, header.body_offset, version, settled.edits,
                                           request)
        if request.acks == 0:
            return Forward(frame, expect_response=False, produce=summaries)
        if not settled.rejections and not settled.acked and summaries is None:
            return Forward(frame, on_response=_node_rewriter(version, nodes_seen))
        return Forward(frame, produce=summaries, on_response=ResponseMerger(
            version, settled, self.topic_names, nodes_seen))

    def _tallied_pass_through(self, client: RequestingClient, header: RequestHeader,
                              frame: bytes, nodes_seen: NodeSeen | None) -> Disposition:
        """No interceptor, but observers or metrics: forwarded as it came, summarized per
        partition."""
        assert header.body_offset is not None
        version = header.api_version
        request = read_produce_request(frame, header.body_offset, version)
        settled = Settled(frame, forwarded=1, summaries=[
            summarize(job, FORWARDED) for job in self._jobs(client, request, frame, version)])
        return self._dispose(header, request, settled, nodes_seen)

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
