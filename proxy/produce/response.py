"""The produce pipeline's response side: the broker's answer merged with the proxy's.

Contract: when the proxy refused some topic-partitions of a ProduceRequest and
forwarded the rest, the client gets one response: the broker's, with a
partition response added for each refusal (``error_code``, and on v8+
``error_message`` and ``record_errors``). A request refused whole is answered
with a response the proxy makes (:func:`rejection_only_response`). On the way,
:class:`ResponseMerger` calls the interceptor's ``on_acknowledgement`` hook
with each forwarded batch's base offset, fills in the per-partition summaries
(base offset, broker errors) for observers and metrics, and rewrites the
KIP-951 ``node_endpoints`` of v10+ answers to the proxy's listeners.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from kiproxy.interceptors.api import AcknowledgedBatch, Record
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.interceptors.observer import PartitionSummary
from kiproxy.interceptors.verdict import AcknowledgementHook
from kiproxy.protocol.framing import parse_response_header, response_header_version
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.protocol.produce_request import topic_key, topic_key_field
from kiproxy.proxy.brokers.addresses import rewrite_message

log = logging.getLogger("kiproxy.produce")

__all__ = ["Acked", "Observation", "Rejection", "ResponseMerger", "Settled", "merge_rejections",
           "rejection_only_response"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """One topic-partition the proxy refused, what the producer is told, and what the
    one log line about it says."""

    topic: Any  # name (str) or topic id (UUID), as the request named it
    partition: int
    error_code: int
    message: str
    record_errors: tuple[tuple[int, str | None], ...] = ()
    """``(record index in the partition, message)`` pairs."""
    reason: str = "interceptor"
    """The ``reason`` label of kiproxy_rejected_batches_total."""
    route: str | None = None
    """The route whose chain (or decoding on its behalf) refused it, for the log line
    (None for the ``interceptor:`` shorthand, whose lines name no route)."""
    link: str | None = None
    """The interceptor that refused it (None: the proxy, e.g. an undecodable batch)."""
    fault: str | None = None
    """Why the plugin failed (a :data:`~kiproxy.interceptors.verdict.Fault`, or
    ``encode``) - logged as a rate-limited WARNING; None for a policy rejection (INFO)."""
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception a ``raised`` fault came from (its traceback, for the log)."""
    records: tuple[Record, ...] = field(default=(), compare=False, repr=False)
    """The partition's records as the producer sent them, when its route copies refused
    records to a dead-letter topic (else empty)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """What a route or link in observe mode would have done to one batch (which was
    forwarded as it was given)."""

    link: str
    """The link whose verdict it is (for a route in observe mode: the deciding link)."""
    outcome: Literal["transformed", "rejected"]
    error_code: int = 0
    """The Kafka error code the producer would have got (0 when transformed)."""
    message: str | None = None
    """The error message it would have got."""
    reason: str = ""
    """The ``reason`` label: the Kafka error name, or the plugin fault."""
    record_count: int = 0
    """Records in the batch."""
    record_errors: tuple[tuple[int, str | None], ...] = ()
    """``(record index in :attr:`records`, message)`` pairs of a would-be rejection."""
    records: tuple[Record, ...] = field(default=(), compare=False, repr=False)
    """The batch's records when would-be refusals are copied to a dead-letter topic."""


@dataclass(frozen=True, slots=True)
class Acked:
    """The batches of one forwarded topic-partition, for ``on_acknowledgement``."""

    topic_key: Any
    partition: int
    batches: tuple[AcknowledgedBatch, ...]
    hooks: tuple[AcknowledgementHook, ...] = ()
    """The ``on_acknowledgement`` hooks of the route's chain."""
    hook_names: tuple[str, ...] = ()
    """How a failing hook is named in the log (its link's ``class``), hook by hook."""


@dataclass(slots=True)
class Settled:
    """What the settled partitions of one request add up to."""

    frame: bytes
    """The request frame (where :attr:`edits` are spliced)."""
    forwarded: int
    """Partitions forwarded, and topics that came without any (forwarded as they came):
    none of either and the proxy answers the request itself."""
    summaries: list[PartitionSummary] | None
    """Each partition's summary, in request order (None: nobody observes them)."""
    rejections: list[Rejection] = field(default_factory=list)
    acked: list[Acked] = field(default_factory=list)
    """The forwarded partitions whose chain has acknowledgement hooks."""
    edits: dict[tuple[int, int], bytes | None] = field(default_factory=dict)
    """(topic position, partition position) -> new records; None: not forwarded."""



@cache
def _response_classes(version: int) -> tuple[Any, Any, Any, Any]:
    response_cls = response_type(ApiKey.PRODUCE, version)
    hints = typing.get_type_hints(response_cls)
    topic_cls = typing.get_args(hints["responses"])[0]
    partition_cls = typing.get_args(typing.get_type_hints(topic_cls)["partition_responses"])[0]
    record_error_cls = None
    partition_hints = typing.get_type_hints(partition_cls)
    if "record_errors" in partition_hints:
        record_error_cls = typing.get_args(partition_hints["record_errors"])[0]
    return response_cls, topic_cls, partition_cls, record_error_cls


def _error_code_value(code: int) -> Any:
    """kio's value for ``code`` (its serializer wants its own enum; our codes are Kafka's)."""
    from kio.schema.errors import ErrorCode as KioErrorCode

    try:
        return KioErrorCode(code)
    except ValueError:
        return KioErrorCode(int(ErrorCode.INVALID_RECORD))


def _partition_response(version: int, rejection: Rejection) -> Any:
    _, _, partition_cls, record_error_cls = _response_classes(version)
    fields = {f.name for f in dataclasses.fields(partition_cls)}
    kwargs: dict[str, Any] = {
        "index": rejection.partition,
        "error_code": _error_code_value(rejection.error_code),
        "base_offset": -1,
    }
    if "record_errors" in fields:
        kwargs["record_errors"] = tuple(
            record_error_cls(batch_index=i, batch_index_error_message=m)
            for i, m in rejection.record_errors
        )
    if "error_message" in fields:
        kwargs["error_message"] = rejection.message
    return partition_cls(**kwargs)


def merge_rejections(version: int, response: Any, rejections: list[Rejection]) -> Any:
    _, topic_cls, _, _ = _response_classes(version)
    key_field = topic_key_field(version)
    topics = list(response.responses)
    index = {getattr(t, key_field): i for i, t in enumerate(topics)}
    for rejection in rejections:
        part = _partition_response(version, rejection)
        i = index.get(rejection.topic)
        if i is None:
            index[rejection.topic] = len(topics)
            topics.append(topic_cls(**{key_field: rejection.topic, "partition_responses": (part,)}))
        else:
            topics[i] = dataclasses.replace(
                topics[i], partition_responses=(*topics[i].partition_responses, part)
            )
    return dataclasses.replace(response, responses=tuple(topics))


def rejection_only_response(version: int, rejections: list[Rejection]) -> bytes:
    response_cls, _, _, _ = _response_classes(version)
    empty = response_cls(responses=())
    return serialize(merge_rejections(version, empty, rejections))


class ResponseMerger:
    """Turns the broker's answer to a forwarded ProduceRequest into the client's."""

    def __init__(self, version: int, settled: Settled, topic_names: dict[uuid.UUID, str],
                 nodes_seen: Callable[[int, str, int], tuple[str, int]] | None) -> None:
        self._version = version
        self._header_version = response_header_version(ApiKey.PRODUCE, version) or 0
        self._rejections = settled.rejections
        self._acked = settled.acked
        self._summaries = settled.summaries
        self._topic_names = topic_names
        self._nodes_seen = nodes_seen

    def __call__(self, frame: bytes) -> bytes:
        version = self._version
        _, body_offset = parse_response_header(frame, self._header_version)
        response = parse_response(ApiKey.PRODUCE, version, frame, body_offset)
        if any(entry.hooks for entry in self._acked):
            self._acknowledge(response)
        if self._summaries:
            self._fill_summaries(response)
        rewrite_nodes = version >= 10 and self._nodes_seen is not None
        if not self._rejections and not rewrite_nodes:
            return frame
        if self._rejections:
            response = merge_rejections(version, response, self._rejections)
        if rewrite_nodes:
            assert self._nodes_seen is not None
            response = rewrite_message(ApiKey.PRODUCE, response, self._nodes_seen)
        return frame[:body_offset] + serialize(response)

    def _fill_summaries(self, response: Any) -> None:
        version = self._version
        results = {}
        for topic in response.responses:
            key = topic_key(topic, version)
            name = key if isinstance(key, str) else self._topic_names.get(key, str(key))
            for p in topic.partition_responses:
                results[(name, p.index)] = p
        summaries = self._summaries or []
        for i, summary in enumerate(summaries):
            if summary.outcome == "rejected":
                continue
            p = results.get((summary.topic, summary.partition))
            if p is not None:
                summaries[i] = _answered(summary, int(p.base_offset), int(p.error_code),
                                         getattr(p, "error_message", None))

    def _acknowledge(self, response: Any) -> None:
        results = {}
        for topic in response.responses:
            for p in topic.partition_responses:
                results[(topic_key(topic, self._version), p.index)] = (int(p.base_offset),
                                                                 int(p.error_code))
        for entry in self._acked:
            if not entry.hooks:
                continue
            base_offset, code = results.get((entry.topic_key, entry.partition), (-1, -1))
            for batch in entry.batches:
                for hook, name in zip(entry.hooks, entry.hook_names, strict=True):
                    try:
                        hook(batch, base_offset, code or None)
                    except Exception:
                        log.exception("interceptor %s: on_acknowledgement failed", name)
                if base_offset >= 0:
                    base_offset += batch.record_count


def _answered(summary: PartitionSummary, base_offset: int, error_code: int,
              error_message: str | None) -> PartitionSummary:
    """``summary`` once the broker answered the partition (an error: ``broker_error``)."""
    if not error_code:
        return dataclasses.replace(summary, base_offset=base_offset)
    return dataclasses.replace(summary, base_offset=base_offset, outcome="broker_error",
                               error_code=error_code, error_message=error_message)
