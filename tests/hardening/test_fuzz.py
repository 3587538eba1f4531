"""Fuzzing everything the proxy decodes: frames, request and response messages, record batches.

The invariant: whatever bytes arrive, a decoder returns a result or raises a
:class:`kiproxy.protocol.errors.ProtocolError` subclass — never ``IndexError``,
``TypeError``, ``struct.error``, ``UnicodeDecodeError``, ``MemoryError``,
``AssertionError`` or a crash. The proxy turns a ProtocolError into one log line
and a closed connection (or a rejected partition); anything else escapes as a
traceback, or kills the task reading a broker's answers.

Inputs are mutations (bit flips, truncation, splicing, inserted and deleted
ranges, lying length fields and varints) of a seed corpus of real frames: the
golden ProduceRequests captured from confluent-kafka (``tests/fixtures/golden``),
their record batches, and frames of every version of every request and response
the proxy decodes, built with every field filled in (see
:mod:`hardening.fuzz_corpus`). Each target runs what the proxy runs on that
input: the frame decoder and request-header parser; the Produce pipeline itself
(passthrough, observed, transforming and rejecting interceptors) and then a
mutated broker answer through the response merger it set up; the legacy Produce
v0-v2 reader; the ApiVersions cut; the address rewriting of Metadata,
FindCoordinator, DescribeCluster and the ``node_endpoints`` of Produce and Fetch;
the record-batch codec (with the CRC made right after mutation, to get past it).
A deterministic sweep then makes every length field of every seed null in turn.

Under ``make test`` each target runs 60-100 examples, derandomized (the same
ones every run; 460 in all, a few seconds). For a real fuzzing
session set the number of examples per target; the run is then random and new
failures are kept in hypothesis' example database (``.hypothesis/``)::

    KIPROXY_FUZZ_EXAMPLES=200000 .venv/bin/pytest -q tests/hardening/test_fuzz.py \\
        -k fuzz_ --timeout 0

Findings are pinned below as literal regression tests (``xfail(strict=True)``
until fixed); :data:`KNOWN_FINDINGS` lets the fuzz targets look past them so
that a long run finds new ones — delete an entry when its fix lands. The
end-to-end test sends a few hundred fuzzed frames to a running proxy over raw
sockets and checks that it stays up and keeps serving a real client.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from conftest import consume, launch_proxy
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.client import Client

from hardening.fuzz_corpus import (
    DECODED_APIS,
    SEED_TOPIC_ID,
    batch_seeds,
    mutated,
    nulled,
    request_seeds,
    response_seeds,
    versions,
)
from hardening.raw_kafka import api_versions_frame, closed_by_peer, connect, metadata_frame
from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin.uppercase import Uppercase
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import (
    FrameDecoder,
    encode_frame,
    encode_request_header,
    parse_request_header,
    parse_response_header,
    response_header_version,
)
from kiproxy.protocol.legacy_produce import legacy_produce_acks_and_partitions
from kiproxy.protocol.messages import ApiKey, parse_request, parse_response
from kiproxy.protocol.records import (
    DecompressionLimits,
    decode_batches,
    encode_batch,
    read_batch_headers,
)
from kiproxy.proxy.brokers.addresses import needs_rewrite, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import cut_api_versions_frame
from kiproxy.proxy.produce.disposition import Answer, Forward
from kiproxy.proxy.produce.pipeline import ProducePipeline
from kiproxy_dev.tansu import EmbeddedBroker

_LONG_RUN = int(os.environ.get("KIPROXY_FUZZ_EXAMPLES", "0"))
F = TypeVar("F", bound=Callable[..., None])

# Findings. Pin each new one as an xfail(strict=True) regression test below, with its
# diagnosis in a comment above a constant that is the xfail reason, and list it here
# so that a long fuzzing run looks past it; remove all three when its fix lands. None
# is open. Fixed so far: a null array in a non-nullable field (protocol/messages.py
# refuses it naming the field), read_acks on a truncated flexible Produce body, and
# requests at versions the proxy has no schema for (Produce v14+ and those whose
# answers name brokers, refused with the client closed, proxy/produce/pipeline.py and
# proxy/server.py).

KNOWN_FINDINGS: dict[tuple[str, str], str] = {}
"""(exception type, function or message) of findings already pinned by xfail tests."""


def _examples(default: int) -> Callable[[F], F]:
    return settings(
        max_examples=_LONG_RUN or default,
        derandomize=not _LONG_RUN,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def _seen(node_id: int, host: str, port: int) -> tuple[str, int]:
    """The proxy's address for a node (always different, so the rewrite re-serializes)."""
    return "kiproxy.test", 20000 + node_id % 1000


def _known(exc: BaseException) -> bool:
    where = traceback.extract_tb(exc.__traceback__)[-1].name
    name = type(exc).__name__
    return (name, where) in KNOWN_FINDINGS or (name, str(exc)) in KNOWN_FINDINGS


def _only_protocol_errors(call: Callable[..., object], *args: Any,
                          known: bool = True) -> None:
    """Run ``call``; a ProtocolError is a fine outcome, anything else is a finding
    (those in :data:`KNOWN_FINDINGS` pass when ``known``)."""
    try:
        call(*args)
    except ProtocolError:
        pass
    except Exception as exc:
        if not (known and _known(exc)):
            raise


# ---------------------------------------------------------------------------- what the proxy runs


def request_path(frame: bytes) -> None:
    """Decode a client request as the proxy and a transforming interceptor would."""
    header = parse_request_header(frame)
    if header.body_offset is None:
        # A version without a schema: refused (Produce, and APIs whose answers name
        # brokers) or forwarded as opaque bytes; nothing here decodes it.
        return
    key, version, offset = header.api_key, header.api_version, header.body_offset
    if key == ApiKey.PRODUCE and version < 3:
        legacy_produce_acks_and_partitions(frame, offset)
        return
    if key not in DECODED_APIS.values():
        return
    request = parse_request(key, version, frame, offset)
    if key != ApiKey.PRODUCE:
        return
    for topic in request.topic_data:
        for part in topic.partition_data:
            if not part.records:
                continue
            data = bytes(part.records)
            read_batch_headers(data)
            for batch in decode_batches(data):
                again = decode_batches(encode_batch(batch.header, batch.records))
                assert again[0].records == batch.records


def response_path(api_key: int, api_version: int, frame: bytes) -> None:
    """Decode a broker response as the proxy does for the request it answers."""
    if api_key == ApiKey.API_VERSIONS:
        cut_api_versions_frame(api_version, frame)
    elif needs_rewrite(api_key, api_version):
        rewrite_response_frame(api_key, api_version, frame, _seen, observe=lambda _: None)
    else:
        header_version = response_header_version(api_key, api_version)
        assert header_version is not None
        _, offset = parse_response_header(frame, header_version)
        parse_response(api_key, api_version, frame, offset)


def batch_path(data: bytes, verify_crc: bool = True) -> None:
    """Decode a partition's record batches and re-encode each, as for a transformed batch."""
    read_batch_headers(data)
    limits = DecompressionLimits(max_bytes=1 << 20)
    for decoded in decode_batches(data, verify_crc=verify_crc, limits=limits):
        encode_batch(decoded.header, decoded.records)


def _Client() -> Client:
    return Client(client_id="fuzz")


class _Reject(ProduceRequestInterceptor):
    """Rejects odd partitions (with a record error), passes the others."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if batch.partition % 2:
            raise RejectBatch("odd partitions are refused", error="POLICY_VIOLATION",
                              record_errors=[(0, "the first record")])
        return batch


def _pipelines() -> list[ProducePipeline]:
    out = []
    for interceptor, observed in ((None, False), (None, True), (Uppercase(), False),
                                  (Uppercase(), True), (_Reject(), False), (_Reject(), True)):
        pipeline = ProducePipeline(interceptor, proxy_host="fuzz-host")
        pipeline.observed = observed
        pipeline.nodes_seen = _seen
        pipeline.topic_names[SEED_TOPIC_ID] = "seed"
        out.append(pipeline)
    return out


_PIPELINES = _pipelines()


def pipeline_outcome(pipeline: ProducePipeline, frame: bytes) -> Answer | Forward | None:
    """A Produce request through the proxy's pipeline; the proxy's own answer must parse."""
    header = parse_request_header(frame)
    if header.api_key != ApiKey.PRODUCE:
        return None
    outcome = asyncio.run(pipeline.handle(_Client(), header, frame, None))  # type: ignore[arg-type]
    if isinstance(outcome, Answer) and outcome.frame is not None and header.api_version >= 3:
        _, offset = parse_response_header(outcome.frame, 1 if header.header_version == 2 else 0)
        parse_response(ApiKey.PRODUCE, header.api_version, outcome.frame, offset)
    return outcome


def pipeline_path(pipeline: ProducePipeline, frame: bytes, response: bytes) -> None:
    """A Produce request through the pipeline, then ``response`` through its merger."""
    outcome = pipeline_outcome(pipeline, frame)
    if isinstance(outcome, Forward) and outcome.expect_response and outcome.on_response:
        outcome.on_response(response)


# ---------------------------------------------------------------------------- the corpus

_REQUEST_FRAMES = tuple(s.frame for s in (*request_seeds(), *request_seeds(empty=True)))
_RESPONSES = (*response_seeds(), *response_seeds(empty=True))
_PRODUCE_RESPONSES = {s.api_version: s.frame for s in response_seeds()
                      if s.api_key == ApiKey.PRODUCE}
_BATCHES = batch_seeds()


def test_the_corpus_holds_every_decoded_api_version() -> None:
    requests = {(s.api_key, s.api_version) for s in request_seeds()}
    responses = {(s.api_key, s.api_version) for s in _RESPONSES}
    for name, key in DECODED_APIS.items():
        for version in versions(name):
            assert (key, version) in responses, f"{name} v{version} response"
            if name not in ("fetch", "share_fetch", "share_acknowledge"):
                assert (key, version) in requests, f"{name} v{version} request"
    assert sum(s.origin.startswith("golden") for s in request_seeds()) == 5
    # unmutated, every seed decodes: the targets start from valid input
    for frame in _REQUEST_FRAMES:
        request_path(frame)
        for pipeline in _PIPELINES:
            version = struct.unpack_from(">h", frame, 2)[0]
            if frame[:2] == b"\x00\x00":
                pipeline_path(pipeline, frame, _PRODUCE_RESPONSES[version])
    for seed in _RESPONSES:
        response_path(seed.api_key, seed.api_version, seed.frame)
    for batch in _BATCHES:
        batch_path(batch)


# ---------------------------------------------------------------------------- fuzz targets


@_examples(60)
@given(frames=st.lists(mutated(_REQUEST_FRAMES, max_mutations=2), min_size=1, max_size=4),
       lies=st.lists(st.tuples(st.integers(0, 3), st.integers(-(2**31), 2**31 - 1)),
                     max_size=2),
       cuts=st.lists(st.integers(1, 4096), max_size=8),
       max_frame_size=st.sampled_from((64, 4096, 1 << 20)))
def test_fuzz_frame_stream(frames: list[bytes], lies: list[tuple[int, int]], cuts: list[int],
                           max_frame_size: int) -> None:
    """A byte stream of (possibly lying) length-prefixed frames, fed in random pieces:
    the frames that come out are exactly those at the start of the stream, and the
    decoder never holds more than one frame's worth."""
    prefixes = [struct.pack(">i", len(f)) for f in frames]
    for index, value in lies:
        if index < len(prefixes):
            prefixes[index] = struct.pack(">i", value)
    stream = b"".join(p + f for p, f in zip(prefixes, frames, strict=True))
    decoder = FrameDecoder(max_frame_size)
    out: list[bytes] = []
    pos = 0
    try:
        for size in [*cuts, len(stream)]:
            out += decoder.feed(stream[pos : pos + size])
            pos += size
            assert decoder.buffered < max_frame_size + 4
    except ProtocolError:
        pass
    assert stream.startswith(b"".join(struct.pack(">i", len(f)) + f for f in out))
    for frame in out:
        _only_protocol_errors(parse_request_header, frame)


@_examples(100)
@given(frame=mutated(_REQUEST_FRAMES))
def test_fuzz_requests(frame: bytes) -> None:
    """Client requests through header parsing, message parsing and the batch codec."""
    _only_protocol_errors(request_path, frame)


@_examples(100)
@given(data=st.data(), frame=mutated(_REQUEST_FRAMES))
def test_fuzz_produce_pipeline(data: st.DataObject, frame: bytes) -> None:
    """Produce requests through the real pipeline, then a mutated answer through its merger."""
    pipeline = data.draw(st.sampled_from(_PIPELINES))
    version = struct.unpack_from(">h", frame, 2)[0] if len(frame) >= 4 else 9
    seed = _PRODUCE_RESPONSES.get(version, _PRODUCE_RESPONSES[9])
    response = data.draw(mutated((seed,), max_mutations=2))
    _only_protocol_errors(pipeline_path, pipeline, frame, response)


@_examples(100)
@given(data=st.data())
def test_fuzz_responses(data: st.DataObject) -> None:
    """Broker responses through the ApiVersions cut, address rewriting and parsing,
    each read as the version of its seed or as another version of the same API."""
    seed = data.draw(st.sampled_from(_RESPONSES))
    same_api = tuple(s.frame for s in _RESPONSES if s.api_key == seed.api_key)
    frame = data.draw(mutated((seed.frame, *same_api)))
    name = next(n for n, k in DECODED_APIS.items() if k == seed.api_key)
    version = data.draw(st.sampled_from((seed.api_version, *versions(name))))
    _only_protocol_errors(response_path, seed.api_key, version, frame)


@_examples(100)
@given(batch=mutated(_BATCHES), fix_crc=st.booleans(), verify_crc=st.booleans())
def test_fuzz_record_batches(batch: bytes, fix_crc: bool, verify_crc: bool) -> None:
    """Record batches, with the CRC made right again after mutation (to get past it
    into the records) or left wrong."""
    data = bytearray(batch)
    if fix_crc and len(data) >= 61:
        length = struct.unpack_from(">i", data, 8)[0]
        end = min(len(data), 12 + max(length, 0))
        struct.pack_into(">I", data, 17, crc32c(bytes(data[21:end])))
    _only_protocol_errors(batch_path, bytes(data), verify_crc)


# ---------------------------------------------------------------------------- null length fields


def _request_seeds_of(name: str) -> Iterator[Any]:
    key = DECODED_APIS[name]
    for empty in (False, True):
        yield from (s for s in request_seeds(empty) if s.api_key == key)


def _xfail(reason: str) -> pytest.MarkDecorator:
    """The mark of a finding's regression test until its fix lands (see KNOWN_FINDINGS)."""
    return pytest.mark.xfail(strict=True, reason=reason)


@pytest.mark.parametrize("name", [
    "produce", "metadata", "api_versions", "find_coordinator", "describe_cluster",
    "sasl_handshake", "sasl_authenticate",
])
def test_a_null_length_in_any_field_of_a_request(name: str) -> None:
    """Every int32/compact length of every request version made null in turn, through
    the request path and (for Produce) every pipeline."""
    checked = 0
    for seed in _request_seeds_of(name):
        for frame in nulled(seed.frame):
            _only_protocol_errors(request_path, frame, known=False)
            if seed.api_key == ApiKey.PRODUCE:
                for pipeline in _PIPELINES:
                    _only_protocol_errors(pipeline_outcome, pipeline, frame, known=False)
            checked += 1
    assert checked


@pytest.mark.parametrize("name", list(DECODED_APIS))
def test_a_null_length_in_any_field_of_a_response(name: str) -> None:
    """Every length of every response version made null in turn, through the rewrite
    or cut the proxy applies (and for Produce, through every pipeline's merger)."""
    key = DECODED_APIS[name]
    checked = 0
    for seed in (s for s in _RESPONSES if s.api_key == key):
        variants = nulled(seed.frame)
        for frame in variants:
            _only_protocol_errors(response_path, key, seed.api_version, frame, known=False)
        checked += len(variants)
        if key != ApiKey.PRODUCE:
            continue
        request = next(s.frame for s in request_seeds() if s.api_key == key
                       and s.api_version == seed.api_version and s.origin.endswith("request"))
        for pipeline in _PIPELINES:
            outcome = pipeline_outcome(pipeline, request)
            if isinstance(outcome, Forward) and outcome.on_response is not None:
                for frame in variants:
                    _only_protocol_errors(outcome.on_response, frame, known=False)
    assert checked


# ---------------------------------------------------------------------------- regressions
#
# Literal inputs that escaped as something other than a ProtocolError. Each runs
# with known=False: it must pass on its own merits once the fix lands.

# Produce v9 from the sample corpus, its topic_data a compact null (0), found by
# test_fuzz_requests.
NULL_TOPIC_DATA_V9 = (
    b"\x00\x00\x00\t\x00\x00\x00*\x00\t\x1e\x00\x00\x00\x02k\x02v\x04\x02h\x02x\x02h"
    b"\x01\x0c\x00\n\x02\x01\x01\x00\x00\x00\x00"
)
# Produce v3: null transactional_id, acks 1, timeout 1000, topic_data int32 -1.
NULL_TOPIC_DATA_V3 = (encode_request_header(ApiKey.PRODUCE, 3, 7, "fuzz", 1)
                      + struct.pack(">hhii", -1, 1, 1000, -1))
# Metadata v1 response: brokers int32 -1, controller id 1, no topics.
NULL_BROKERS_V1 = struct.pack(">iiii", 7, -1, 1, 0)
# ApiVersions v0 response: error 0, api_keys int32 -1.
NULL_API_KEYS_V0 = struct.pack(">ihi", 7, 0, -1)
# A flexible Produce v10 request cut inside the transactional_id length varint.
TRUNCATED_PRODUCE_V10 = b"\x00\x00\x00\n\x00\x00\x00\x00\x00\tfuzz-seed\x00"


@pytest.mark.parametrize("frame", [NULL_TOPIC_DATA_V9, NULL_TOPIC_DATA_V3],
                         ids=["v9-compact", "v3-int32"])
def test_regression_produce_with_null_topic_data(frame: bytes) -> None:
    _only_protocol_errors(request_path, frame, known=False)
    for pipeline in _PIPELINES:
        _only_protocol_errors(pipeline_outcome, pipeline, frame, known=False)


def test_regression_metadata_response_with_null_brokers() -> None:
    _only_protocol_errors(response_path, ApiKey.METADATA, 1, NULL_BROKERS_V1, known=False)


def test_regression_api_versions_response_with_null_api_keys() -> None:
    _only_protocol_errors(response_path, ApiKey.API_VERSIONS, 0, NULL_API_KEYS_V0, known=False)


def test_regression_truncated_flexible_produce_in_passthrough() -> None:
    _only_protocol_errors(pipeline_outcome, _PIPELINES[0], TRUNCATED_PRODUCE_V10, known=False)


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A broker of the module's own: fuzzed frames reach it, and must not hurt other tests."""
    broker = EmbeddedBroker(log_path=tmp_path_factory.mktemp("fuzz-broker") / "broker.log")
    broker.start()
    yield broker
    broker.stop()


def _fuzzed_frames(count: int, seed: int) -> list[bytes]:
    """``count`` deterministic mutations of the request corpus, length-prefixed (the
    prefix itself lies now and then)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(_REQUEST_FRAMES))
        for _ in range(rng.randint(1, 3)):
            kind = rng.randrange(5)
            pos = rng.randrange(len(data)) if data else 0
            if kind == 0 and data:
                data[pos] ^= 1 << rng.randrange(8)
            elif kind == 1:
                del data[pos:]
            elif kind == 2:
                data[pos : pos + 4] = struct.pack(">i", rng.choice((-1, 0, 2**31 - 1, 1 << 24)))
            elif kind == 3:
                donor = rng.choice(_REQUEST_FRAMES)
                data[pos:] = donor[rng.randrange(len(donor)) :]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 32))
        prefix = len(data) if rng.random() < 0.9 else rng.choice((-1, len(data) + 7, 2**31 - 1))
        out.append(struct.pack(">i", prefix) + bytes(data))
    return out


@pytest.mark.timeout(120)
def test_fuzzed_frames_against_a_running_proxy(fuzz_broker: EmbeddedBroker) -> None:
    """300 fuzzed request frames over raw sockets (ten a connection, after a real
    ApiVersions and Metadata): the proxy stays up and a real client is still served."""
    from confluent_kafka import Producer

    proxy = launch_proxy(fuzz_broker.bootstrap,
                         interceptor="kiproxy.interceptors.builtin.uppercase:Uppercase")
    try:
        frames = _fuzzed_frames(300, seed=20261122)
        sockets: list[socket.socket] = []
        for i in range(0, len(frames), 10):
            sock = connect(proxy.bootstrap, timeout=5)
            sockets.append(sock)
            try:
                sock.sendall(api_versions_frame(1) + metadata_frame(2))
                for frame in frames[i : i + 10]:
                    sock.sendall(frame)
            except OSError:
                pass  # the proxy closed it on a bad frame, as it should
        time.sleep(1)
        for sock in sockets:
            sock.close()
        assert proxy.alive(), f"the proxy died on fuzzed frames:\n{proxy.log[-4000:]}"
        assert fuzz_broker.running, "the broker died on fuzzed frames the proxy forwarded"

        topic = f"fz-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": proxy.bootstrap, "enable.idempotence": True,
                             "acks": "all", "message.timeout.ms": 30000})
        for i in range(50):
            producer.produce(topic, value=b"still here %d" % i, partition=0)
        left = producer.flush(30)
        producer.close()
        assert left == 0
        got = consume(proxy.bootstrap, topic, 50)
        assert sorted(m.value() for m in got) == sorted(b"STILL HERE %d" % i for i in range(50))
        assert proxy.alive()
        closed = proxy.log.count("closing client")
        assert closed >= 10, f"only {closed} connections were closed for bad frames"
    finally:
        proxy.stop()


def _send_and_watch(broker: EmbeddedBroker, frame: bytes, *flags: str,
                    wait: float = 5) -> tuple[str, bool, str]:
    """Send one request frame to a fresh proxy; return (our address, whether the proxy
    closed the connection within ``wait`` s, the proxy's log)."""
    proxy = launch_proxy(broker.bootstrap, *flags)
    try:
        sock = connect(proxy.bootstrap)
        host, port = sock.getsockname()[:2]
        sock.sendall(encode_frame(frame))
        closed = closed_by_peer(sock, wait)
        sock.close()
        time.sleep(0.3)
        assert proxy.alive()
        return f"{host}:{port}", closed, proxy.log
    finally:
        proxy.stop()


def _assert_closed_with_one_warning(address: str, closed: bool, log: str) -> None:
    assert closed, f"the proxy did not close the connection:\n{log}"
    assert "Traceback" not in log, f"an unhandled exception, not a ProtocolError:\n{log}"
    lines = [line for line in log.splitlines() if address in line]
    assert any("level=WARNING" in line and "closing client" in line for line in lines), log


def test_e2e_truncated_flexible_produce_closes_with_a_warning(
        fuzz_broker: EmbeddedBroker) -> None:
    _assert_closed_with_one_warning(*_send_and_watch(fuzz_broker, TRUNCATED_PRODUCE_V10))


def test_e2e_produce_with_null_topic_data_closes_with_a_warning(
        fuzz_broker: EmbeddedBroker) -> None:
    _assert_closed_with_one_warning(*_send_and_watch(
        fuzz_broker, NULL_TOPIC_DATA_V3, "--interceptor",
        "kiproxy.interceptors.builtin.uppercase:Uppercase"))


def test_e2e_produce_at_an_unknown_version_closes_with_a_warning(
        fuzz_broker: EmbeddedBroker) -> None:
    frame = encode_request_header(ApiKey.PRODUCE, 99, 5, "fuzz", 1) + b"\x00" * 20
    _assert_closed_with_one_warning(*_send_and_watch(fuzz_broker, frame))


def test_e2e_metadata_at_an_unknown_version_is_refused(fuzz_broker: EmbeddedBroker) -> None:
    frame = encode_request_header(ApiKey.METADATA, 99, 5, "fuzz", 1) + b"\x00" * 20
    _assert_closed_with_one_warning(*_send_and_watch(fuzz_broker, frame))
