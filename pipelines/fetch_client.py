"""A small blocking Kafka client that reads record batches exactly as the broker stores them.

Replay needs what a consumer library hides: the stored batch boundaries and
their producer fields. So the driver (planning) and the executors (reading)
speak the Kafka protocol themselves through :mod:`protocol` - Metadata v9,
ListOffsets v7 and Fetch v12 (topic names, not ids; every broker from Kafka 2.7
on, and Tansu, answers them) - one connection per broker, with TLS and SASL as
the cluster's :class:`ClientSecurity` asks (:mod:`pipelines.broker_connection`).

The log end is taken from a Fetch response, not from ListOffsets "latest":
the high watermark for ``read_uncommitted``, the last stable offset (LSO: the
first offset of the oldest open transaction) for ``read_committed`` - what a
consumer of that isolation level reads up to; and some Kafka-compatible brokers
(Tansu) answer ListOffsets with the base offset of the last batch. A
``read_committed`` client sends Fetch with isolation level 1, so the broker
returns data up to the LSO and the partition's aborted transactions, which
:mod:`pipelines.read_committed` applies.

Offsets for a timestamp are found by binary search over stored batches (their
max timestamps), which gives Kafka's ``offsetsForTimes`` answer for logs whose
timestamps grow, on any broker.
"""

from __future__ import annotations

import datetime
import ssl
import struct
import time
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiproxy.pipelines.broker_connection import BrokerConnection, BrokerError
from kiproxy.pipelines.client_security import PLAINTEXT, ClientSecurity
from kiproxy.pipelines.read_committed import AbortedTransaction
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.messages import ApiKey, request_type
from kiproxy.protocol.records import DecodedBatch, decode_batches
from kiproxy.protocol.records import TimestampType as _TimestampType

__all__ = [
    "ISOLATION_LEVELS",
    "BrokerError",
    "ClusterMetadata",
    "FetchClient",
    "FetchedPartition",
    "TopicPartition",
    "complete_prefix",
    "record_timestamps",
]

METADATA_VERSION = 9
LIST_OFFSETS_VERSION = 7
FETCH_VERSION = 12
EARLIEST_TIMESTAMP = -2
ISOLATION_LEVELS = ("read_committed", "read_uncommitted")
"""The ``isolation.level`` values a Kafka consumer takes (Fetch's 1 and 0)."""
_LOG_OVERHEAD = 12
_FETCH_WAITS_MS = (10, 10, 100, 500, 1000)
LIST_OFFSETS_KEY = 2
# LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER, FENCED_LEADER_EPOCH, UNKNOWN_LEADER_EPOCH
_NOT_LEADER_CODES = frozenset({5, 6, 74, 75})

TopicPartition = tuple[str, int]
"""``(topic, partition)``."""


@dataclass(frozen=True, slots=True)
class ClusterMetadata:
    """Brokers and the partition leaders of every topic, from one Metadata response."""

    brokers: dict[int, tuple[str, int]]
    """node id -> (host, port)."""
    leaders: dict[str, dict[int, int]]
    """topic -> partition -> leader node id (-1 when it has none right now)."""
    internal: frozenset[str] = frozenset()
    """Names of internal topics (``__consumer_offsets``, ...)."""


@dataclass(frozen=True, slots=True)
class FetchedPartition:
    """One partition of a Fetch response: whole stored batches and the log's bounds."""

    high_watermark: int
    """Offset after the last record a consumer may read."""
    log_start_offset: int
    """First offset still stored (-1 if the broker did not say)."""
    batches: list[DecodedBatch] = field(default_factory=list)
    """The complete batches returned, in offset order (a trailing partial one is dropped)."""
    last_stable_offset: int = -1
    """The LSO: a read_committed consumer reads below it (-1 if the broker did not say)."""
    aborted_transactions: tuple[AbortedTransaction, ...] = ()
    """Aborted transactions overlapping the returned batches (read_committed fetches only)."""

    def end_offset(self, read_committed: bool) -> int:
        """The offset a consumer of that isolation level reads up to: the LSO when
        read_committed and the broker gave one, else the high watermark."""
        if read_committed and self.last_stable_offset >= 0:
            return min(self.last_stable_offset, self.high_watermark)
        return self.high_watermark


def complete_prefix(data: bytes) -> bytes:
    """The leading part of fetched ``records`` bytes that holds whole batches only.

    A broker may cut the last batch of a Fetch response at ``max_bytes``; the
    client is expected to drop it and fetch again from there.
    """
    pos = 0
    while len(data) - pos >= _LOG_OVERHEAD:
        (length,) = struct.unpack_from(">i", data, pos + 8)
        if length <= 0 or pos + _LOG_OVERHEAD + length > len(data):
            break
        pos += _LOG_OVERHEAD + length
    return data if pos == len(data) else data[:pos]


def record_timestamps(batch: DecodedBatch) -> list[int]:
    """Each record's timestamp as stored: LogAppendTime batches carry it in max_timestamp."""
    if batch.header.timestamp_type == _TimestampType.LOG_APPEND_TIME:
        return [batch.header.max_timestamp] * len(batch.records)
    return [r.timestamp for r in batch.records]


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _element(cls: Any, field_name: str) -> Any:
    return typing.get_args(typing.get_type_hints(cls)[field_name])[0]


class FetchClient:
    """Metadata, ListOffsets and Fetch against a cluster, blocking, one socket per broker."""

    def __init__(self, bootstrap: str | Sequence[str], *, client_id: str = "kiproxy-replay",
                 timeout: float = 30.0, security: ClientSecurity = PLAINTEXT,
                 isolation_level: str = "read_uncommitted") -> None:
        """``isolation_level``: ``read_uncommitted`` (every stored batch, up to the high
        watermark) or ``read_committed`` (up to the LSO, with aborted transactions)."""
        if isolation_level not in ISOLATION_LEVELS:
            raise ValueError(f"isolation level {isolation_level!r}: use "
                             f"{' or '.join(ISOLATION_LEVELS)}")
        servers = [bootstrap] if isinstance(bootstrap, str) else list(bootstrap)
        self.bootstrap = [_parse_address(a) for s in servers for a in s.split(",") if a.strip()]
        if not self.bootstrap:
            raise ValueError("no bootstrap server given")
        self.client_id = client_id
        self.timeout = timeout
        self.security = security
        self.read_committed = isolation_level == "read_committed"
        self._ssl_context: ssl.SSLContext | None = None
        self._connections: dict[tuple[str, int], BrokerConnection] = {}
        self._metadata: ClusterMetadata | None = None

    def close(self) -> None:
        """Close every broker connection."""
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()

    def __enter__(self) -> FetchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ connections

    def _connection(self, address: tuple[str, int]) -> BrokerConnection:
        conn = self._connections.get(address)
        if conn is not None and conn.expired():  # the broker's SASL session is ending
            conn.close()
            conn = None
        if conn is None:
            if self.security.tls and self._ssl_context is None:
                self._ssl_context = self.security.ssl_context()
            conn = BrokerConnection(address[0], address[1], self.client_id, self.timeout,
                                    self.security, self._ssl_context)
            self._connections[address] = conn
        return conn

    def _request(self, address: tuple[str, int], api_key: int, version: int,
                 message: Any) -> Any:
        try:
            return self._connection(address).request(api_key, version, message)
        except BrokerError:
            conn = self._connections.pop(address, None)
            if conn is not None:
                conn.close()
            raise

    def _any_broker(self, api_key: int, version: int, message: Any) -> Any:
        errors: list[BrokerError] = []
        candidates = list(self._connections) + [a for a in self.bootstrap
                                                if a not in self._connections]
        for address in candidates:
            try:
                return self._request(address, api_key, version, message)
            except BrokerError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise BrokerError("no bootstrap server answered: " + "; ".join(map(str, errors)))

    # ------------------------------------------------------------------ metadata

    def metadata(self, refresh: bool = False) -> ClusterMetadata:
        """Every topic's partitions and leaders (cached until ``refresh``)."""
        if self._metadata is not None and not refresh:
            return self._metadata
        cls = request_type(ApiKey.METADATA, METADATA_VERSION)
        response = self._any_broker(ApiKey.METADATA, METADATA_VERSION, cls(
            topics=None, allow_auto_topic_creation=False,
            include_cluster_authorized_operations=False,
            include_topic_authorized_operations=False))
        brokers = {int(b.node_id): (str(b.host), int(b.port)) for b in response.brokers}
        leaders: dict[str, dict[int, int]] = {}
        internal = set()
        for topic in response.topics:
            if int(topic.error_code) != 0 or topic.name is None:
                continue
            leaders[str(topic.name)] = {int(p.partition_index): int(p.leader_id)
                                        for p in topic.partitions}
            if topic.is_internal:
                internal.add(str(topic.name))
        self._metadata = ClusterMetadata(brokers, leaders, frozenset(internal))
        return self._metadata

    def _leader_address(self, topic: str, partition: int) -> tuple[str, int]:
        for refresh in (False, True):
            md = self.metadata(refresh=refresh)
            leader = md.leaders.get(topic, {}).get(partition)
            if leader is not None and leader in md.brokers:
                return md.brokers[leader]
        raise BrokerError(f"{topic}[{partition}] has no leader in the cluster's metadata", 5)

    def _by_leader(self, tps: Iterable[TopicPartition]) -> dict[tuple[str, int],
                                                                list[TopicPartition]]:
        out: dict[tuple[str, int], list[TopicPartition]] = {}
        for tp in tps:
            out.setdefault(self._leader_address(*tp), []).append(tp)
        return out

    # ------------------------------------------------------------------ offsets

    def earliest_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The first stored offset of each partition (ListOffsets, timestamp -2)."""
        from kio.schema.types import BrokerId, TopicName
        from kio.static.primitive import i8, i32, i64

        cls = request_type(LIST_OFFSETS_KEY, LIST_OFFSETS_VERSION)
        topic_cls = _element(cls, "topics")
        part_cls = _element(topic_cls, "partitions")
        out: dict[TopicPartition, int] = {}
        for address, group in self._by_leader(tps).items():
            by_topic: dict[str, list[int]] = {}
            for topic, partition in group:
                by_topic.setdefault(topic, []).append(partition)
            request = cls(replica_id=BrokerId(-1), isolation_level=i8(0), topics=tuple(
                topic_cls(name=TopicName(t), partitions=tuple(
                    part_cls(partition_index=i32(p), timestamp=i64(EARLIEST_TIMESTAMP))
                    for p in parts))
                for t, parts in by_topic.items()))
            response = self._request(address, LIST_OFFSETS_KEY, LIST_OFFSETS_VERSION, request)
            for topic in response.topics:
                for p in topic.partitions:
                    code = int(p.error_code)
                    if code != 0:
                        raise BrokerError(f"ListOffsets {topic.name}[{p.partition_index}]: "
                                          f"error {code} ({p.error_code.name})", code)
                    out[(str(topic.name), int(p.partition_index))] = int(p.offset)
        return out

    def fetch(self, topic: str, partition: int, offset: int, *,
              max_bytes: int = 4 << 20) -> FetchedPartition:
        """Whole stored batches from ``offset`` on (the first may start before it).

        ``max_bytes`` bounds the response, but a first batch larger than it is
        still returned whole (KIP-74). A leader change is followed (twice at most).
        A response without the partition (Tansu answers so to ``max_wait`` 0), or
        with no batch at an offset below the partition's end (a broker may answer so
        when its read takes longer than the wait), is asked again with a longer wait,
        after as long a pause; ``min_bytes`` is 0, so a broker with data answers at
        once. Past the last wait the empty answer is returned (the caller names it).
        """
        attempt = 0
        empty: FetchedPartition | None = None
        for i, max_wait_ms in enumerate(_FETCH_WAITS_MS):
            address = self._leader_address(topic, partition)
            try:
                fetched = self._fetch_once(address, topic, partition, offset, max_bytes,
                                           max_wait_ms)
            except BrokerError as exc:
                attempt += 1
                if exc.error_code not in _NOT_LEADER_CODES or attempt > 2:
                    raise
                self.metadata(refresh=True)
                continue
            if fetched is not None:
                if fetched.batches or offset >= fetched.end_offset(self.read_committed):
                    return fetched
                empty = fetched
                if i + 1 < len(_FETCH_WAITS_MS):
                    time.sleep(max_wait_ms / 1000)
        if empty is not None:
            return empty
        raise BrokerError(f"Fetch {topic}[{partition}] at offset {offset}: the broker's "
                          f"responses did not include the partition")

    def _fetch_once(self, address: tuple[str, int], topic: str, partition: int, offset: int,
                    max_bytes: int, max_wait_ms: int) -> FetchedPartition | None:
        from kio.schema.types import BrokerId, TopicName
        from kio.static.primitive import i8, i32, i32Timedelta, i64

        cls = request_type(ApiKey.FETCH, FETCH_VERSION)
        topic_cls = _element(cls, "topics")
        part_cls = _element(topic_cls, "partitions")
        request = cls(
            replica_id=BrokerId(-1),
            max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=max_wait_ms)),
            min_bytes=i32(0), max_bytes=i32(max_bytes),
            isolation_level=i8(1 if self.read_committed else 0),
            session_id=i32(0), session_epoch=i32(-1),
            topics=(topic_cls(topic=TopicName(topic), partitions=(part_cls(
                partition=i32(partition), fetch_offset=i64(offset),
                partition_max_bytes=i32(max_bytes)),)),),
            forgotten_topics_data=(), rack_id="",
        )
        response = self._request(address, ApiKey.FETCH, FETCH_VERSION, request)
        if int(response.error_code) != 0:
            raise BrokerError(f"Fetch {topic}[{partition}]: error {int(response.error_code)} "
                              f"({response.error_code.name})", int(response.error_code))
        for t in response.responses:
            for p in t.partitions:
                if int(p.partition_index) != partition or str(t.topic) != topic:
                    continue
                code = int(p.error_code)
                if code != 0:
                    raise BrokerError(f"Fetch {topic}[{partition}] at offset {offset}: error "
                                      f"{code} ({p.error_code.name})", code)
                data = complete_prefix(bytes(p.records or b""))
                try:
                    batches = decode_batches(data)
                except ProtocolError as exc:
                    raise BrokerError(f"{topic}[{partition}] near offset {offset}: stored "
                                      f"batch does not decode: {exc}") from None
                aborted = tuple(AbortedTransaction(int(a.first_offset), int(a.producer_id))
                                for a in p.aborted_transactions or ())
                return FetchedPartition(int(p.high_watermark), int(p.log_start_offset),
                                        batches, int(p.last_stable_offset), aborted)
        return None

    def high_watermark(self, topic: str, partition: int, from_offset: int) -> int:
        """The partition's high watermark, read from a minimal Fetch at ``from_offset``."""
        return self.fetch(topic, partition, from_offset, max_bytes=1).high_watermark

    def end_offset(self, topic: str, partition: int, from_offset: int) -> int:
        """Where a consumer of this client's isolation level stops reading now: the LSO
        (read_committed) or the high watermark, from a minimal Fetch at ``from_offset``."""
        fetched = self.fetch(topic, partition, from_offset, max_bytes=1)
        return fetched.end_offset(self.read_committed)

    def offset_for_timestamp(self, topic: str, partition: int, timestamp: int,
                             low: int, high: int) -> int:
        """The first offset in ``[low, high)`` whose record timestamp is >= ``timestamp``,
        or ``high`` if there is none.

        Binary search for the first stored batch whose max timestamp reaches
        ``timestamp`` (what Kafka's time index does), then the first such record in it.
        """
        lo, hi = low, high
        found: DecodedBatch | None = None
        while lo < hi:
            mid = (lo + hi) // 2
            batches = [b for b in self.fetch(topic, partition, mid, max_bytes=1).batches
                       if b.header.base_offset + b.header.last_offset_delta >= mid]
            if not batches:
                hi = mid
                continue
            batch = batches[0]
            if batch.header.max_timestamp < timestamp:
                lo = batch.header.base_offset + batch.header.last_offset_delta + 1
            else:
                found = batch
                hi = min(mid, batch.header.base_offset)
        if found is None:
            return high
        base = found.header.base_offset
        for record, ts in zip(found.records, record_timestamps(found), strict=True):
            offset = base + record.offset_delta
            if offset >= low and ts >= timestamp:
                return min(offset, high)
        return min(base + found.header.last_offset_delta + 1, high)
