"""Fetch-side hooks on records blocks (``on_consume_block``) in the fetch pipeline.

The same hand-built answers as test_fetch_pipeline (gzip, transactional, control,
legacy, zstd batches and a cut tail): a block hook's new block is written back at the
same offsets with the batch's codec; None hands the batch to ``on_consume``; the given
block itself leaves the broker's bytes; a block that is not the batch's records, or
moves one, refuses the partition; block and record hooks mix in one chain. A batch
reaches block hooks undecoded (uncompressed: its CRC checked; compressed: decompressed).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from kiproxy.protocol.compression import Compression, DecompressionLimits
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.messages import parse_response
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.protocol.records import DecodedBatch, Record, build_batch, decode_batch
from kiproxy.proxy.config.model import load_config
from kiproxy.proxy.fetch.pipeline import FetchPipeline
from kiproxy.proxy.produce.offload import BatchOffload, DecodeLease
from kiproxy.proxy.routes.runtime import load_routes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
from fetch_responses import head
from test_fetch_pipeline import PIECES, PLUGINS, TOPIC_ID, _answer, _rewrite


def _pipeline(tmp_path: Path, *classes: str) -> FetchPipeline:
    links = ", ".join(f'{{class: "{c}"}}' for c in classes)
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f"plugins_dir: {PLUGINS}\nroutes:\n  - match: {{topic: \"b-.*\"}}\n"
                    f"    interceptors: [{links}]\n")
    return FetchPipeline(load_routes(load_config(path, {})), topic_names={TOPIC_ID: "b-t"})


def _values(records: bytes) -> list[list[bytes | None]]:
    split = split_fetched_records(records)
    out = []
    for b in split.batches:
        if b.magic == 2 and not b.is_control:
            out.append([r.value for r in decode_batch(records[b.start:b.end]).records])
    return out


def _partitions(pipeline: FetchPipeline, topic: str) -> tuple[object, object]:
    frame = _answer(12, topic)
    out = parse_response(1, 12, _rewrite(pipeline, 12, frame), len(head(12)))
    (p0, p1), _ = (t.partitions for t in out.responses)
    return p0, p1


STORED = _values(b"".join(PIECES))


@pytest.fixture(params=["tp_fetch:BlockReverse", "tp_fetch:BlocksReverse"])
def reverse(request: pytest.FixtureRequest) -> str:
    """The block hook, batch by batch (``on_consume_block``) or a partition's blocks at
    once (``on_consume_blocks``): every answer below is the same for both."""
    return str(request.param)


@pytest.mark.parametrize("topic", ["b-t", "b-records", "b-whole-gen"])
def test_a_block_hook_and_its_records_fallback_give_the_same_batches(
        reverse: str, tmp_path: Path, topic: str) -> None:
    p0, _ = _partitions(_pipeline(tmp_path, reverse), topic)
    assert p0.error_code == ErrorCode.none  # type: ignore[attr-defined]
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    split = split_fetched_records(p0.records)  # type: ignore[attr-defined]
    kinds = [(b.magic, b.is_control) for b in split.batches]
    assert kinds == [(2, False), (2, False), (2, True), (1, False), (2, False)]
    for original, now in zip(PIECES, (p0.records[b.start:b.end]  # type: ignore[attr-defined]
                                      for b in split.batches), strict=True):
        if original[16] != 2 or decode_batch(original).header.is_control:
            assert now == original
            continue
        a, b = decode_batch(original).header, decode_batch(now).header
        assert (b.base_offset, b.attributes, b.last_offset_delta, b.max_timestamp,
                b.producer_id, b.base_sequence, b.record_count) == (
            a.base_offset, a.attributes, a.last_offset_delta, a.max_timestamp,
            a.producer_id, a.base_sequence, a.record_count)


@pytest.mark.parametrize("topic", ["b-same", "b-copy"])
def test_the_given_block_back_keeps_the_brokers_bytes(reverse: str, tmp_path: Path,
                                                      topic: str) -> None:
    """The block itself, or a copy of its bytes: the answer is the frame itself (no
    batch re-encoded, as for records equal to a batch's)."""
    pipeline = _pipeline(tmp_path, reverse)
    frame = _answer(12, topic)
    assert _rewrite(pipeline, 12, frame) is frame


@pytest.mark.parametrize("topic, reason", [("b-garbage", "not the batch's"),
                                           ("b-short", "not the batch's"),
                                           ("b-moved", "moved the record at offset 0")])
def test_a_block_that_is_not_the_batchs_records_refuses_the_partition(
        reverse: str, tmp_path: Path, topic: str, reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        p0, p1 = _partitions(_pipeline(tmp_path, reverse), topic)
    for p in (p0, p1):
        assert (p.error_code, p.records) == (ErrorCode.unknown_server_error, b"")  # type: ignore[attr-defined]
    assert reason in caplog.text and reverse in caplog.text


def test_block_and_record_hooks_mix_in_one_chain(reverse: str, tmp_path: Path) -> None:
    # consume runs the chain last link first: BlockReverse on the block, then
    # UpperOnConsume on the records decoded from the block it returned
    p0, _ = _partitions(_pipeline(tmp_path, "tp_fetch:UpperOnConsume", reverse), "b-t")
    assert _values(p0.records) == [[v[::-1].upper() for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    # two block hooks: the second gets the first one's block
    p0, _ = _partitions(_pipeline(tmp_path, reverse, reverse), "b-t")
    assert _values(p0.records) == STORED  # type: ignore[attr-defined]



def _decoded_offsets(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The base offsets of the batches the pipeline decodes, and of those it only
    decompresses, as it does so."""
    decoded: list[int] = []
    decompressed: list[int] = []
    decode, decompress = DecodeLease.decode_partition, DecodeLease.decompress

    async def counting(self: DecodeLease, data: bytes, batches: PartitionBatches
                       ) -> list[DecodedBatch]:
        decoded.extend(h.base_offset for h in batches.headers)
        return await decode(self, data, batches)

    async def counting_blocks(self: DecodeLease, data: bytes, batches: PartitionBatches
                              ) -> bytes:
        decompressed.extend(h.base_offset for h in batches.headers)
        return await decompress(self, data, batches)

    async def counting_held(self: DecodeLease, data: bytes, batches: PartitionBatches
                            ) -> bytes | None:
        block = await decompress_held(self, data, batches)
        if block is not None:  # else decompress() follows, and counts it
            decompressed.extend(h.base_offset for h in batches.headers)
        return block

    decompress_held = DecodeLease.decompress_held
    monkeypatch.setattr(DecodeLease, "decode_partition", counting)
    monkeypatch.setattr(DecodeLease, "decompress", counting_blocks)
    monkeypatch.setattr(DecodeLease, "decompress_held", counting_held)
    return decoded, decompressed


def test_a_batch_only_block_hooks_see_is_never_decoded(
        reverse: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # partition 0 holds a gzip batch (offset 0), an uncompressed one (2) and a zstd one
    # (7); partition 1 the gzip one. The uncompressed block is the answer's own bytes,
    # the compressed ones are decompressed; none is decoded.
    decoded, decompressed = _decoded_offsets(monkeypatch)
    p0, _ = _partitions(_pipeline(tmp_path, reverse), "b-t")
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    assert (decoded, sorted(decompressed)) == ([], [0, 0, 7])
    # a records hook after it needs records: each batch is decoded then, once
    decoded.clear()
    decompressed.clear()
    p0, _ = _partitions(_pipeline(tmp_path, "tp_fetch:UpperOnConsume", reverse), "b-t")
    assert _values(p0.records) == [[v[::-1].upper() for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    assert sorted(decoded) == [0, 0, 2, 7]
    # a block hook that answers None hands the batch to on_consume, decoded
    decoded.clear()
    p0, _ = _partitions(_pipeline(tmp_path, reverse), "b-records")
    assert sorted(decoded) == [0, 0, 2, 7]
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]


def test_an_undecoded_batch_whose_crc_does_not_hold_never_reaches_a_block_hook(
        reverse: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = bytearray(PIECES[1])  # the uncompressed transactional batch
    broken[-1] ^= 0xFF  # a byte of its last header's value: the CRC no longer holds
    pipeline = _pipeline(tmp_path, reverse)
    # after another batch: the answer ends before it
    p0 = _hooked_partition(pipeline, b"".join([PIECES[0], bytes(broken), *PIECES[2:]]))
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[b"cba", b"fed"]]
    # first in the answer (the consumer's next fetch): refused
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        p0 = _hooked_partition(pipeline, b"".join([bytes(broken), *PIECES[2:]]))
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    assert "batch at offset 2 cannot be decoded" in caplog.text
    assert "CRC-32C mismatch" in caplog.text


def _on_threads(pipeline: FetchPipeline, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions ``pipeline`` runs on its worker threads, as it does."""
    on_threads: list[str] = []
    run = pipeline.offload.run

    async def spied(fn: Any, *args: Any, **kwargs: Any) -> Any:
        on_threads.append(fn.__name__)
        return await run(fn, *args, **kwargs)

    monkeypatch.setattr(pipeline.offload, "run", spied)
    return on_threads


def _hooked_partition(pipeline: FetchPipeline, records: bytes) -> Any:
    out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "b-t", records)),
                         len(head(12)))
    (p0, _), _ = (t.partitions for t in out.responses)
    return p0


def test_a_large_compressed_block_is_decompressed_off_the_loop_and_a_bomb_is_refused(
        reverse: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    decoded, decompressed = _decoded_offsets(monkeypatch)
    pipeline = _pipeline(tmp_path, reverse)
    pipeline.offload = BatchOffload(DecompressionLimits(max_bytes=300_000, max_ratio=0))
    # above the inline size compressed (random values do not compress): on a thread
    values = [os.urandom(40_000) for _ in range(3)]
    large = build_batch([Record(key=None, value=v, timestamp=1) for v in values],
                        compression=Compression.ZSTD)
    assert len(large) > pipeline.offload.inline_bytes
    on_threads = _on_threads(pipeline, monkeypatch)
    p0 = _hooked_partition(pipeline, large)
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[v[::-1] for v in values]]
    # this batch on a thread; partition 1's small gzip batch on the loop; none decoded
    assert decoded == [] and decompressed == [0, 0]
    assert on_threads[0] == "decompress_block"
    assert pipeline.offload.budget.used == 0  # given back with the partition
    # a block past max_decompressed_batch_bytes: refused, the hook never sees it
    bomb = build_batch([Record(key=None, value=bytes(200_000), timestamp=1)] * 2,
                       compression=Compression.ZSTD)
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        p0 = _hooked_partition(pipeline, bomb)
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    assert "batch at offset 0 cannot be decoded" in caplog.text
    assert "max_decompressed_batch_bytes" in caplog.text
    assert decoded == []


def _hook(pipeline: FetchPipeline) -> Any:
    """The one fetch-side interceptor of ``pipeline``'s one route."""
    assert pipeline.routes is not None
    (link,) = next(iter(pipeline.routes._chains.values())).consumers
    return link.interceptor


def test_a_partitions_blocks_reach_on_consume_blocks_in_one_call(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:BlocksReverse")
    calls = type(_hook(pipeline)).calls
    calls.clear()
    p0, _ = _partitions(pipeline, "b-t")
    # partition 0's three data batches in one call, partition 1's gzip batch in
    # another: no control or legacy batch among them
    assert sorted(calls) == [[2], [len(vs) for vs in STORED]] and len(STORED) == 3
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]


def test_blocks_answered_none_go_to_on_consume_of_the_same_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded, _ = _decoded_offsets(monkeypatch)
    p0, _ = _partitions(_pipeline(tmp_path, "tp_fetch:BlocksReverse"), "b-whole-odd")
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    assert decoded == [2]  # the second data batch of partition 0, and only it


@pytest.mark.parametrize("topic, reason", [
    ("b-whole-raise", "raised RuntimeError: the whole partition broke"),
    ("b-whole-count", "returned 2 answers for 3 blocks")])
def test_a_failed_call_for_the_whole_partition_refuses_it(
        tmp_path: Path, topic: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        p0, _ = _partitions(_pipeline(tmp_path, "tp_fetch:BlocksReverse"), topic)
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")  # type: ignore[attr-defined]
    assert reason in caplog.text
    assert "batch at offset 0 and later ones" in caplog.text


def test_a_bad_answer_for_one_block_ends_the_answer_before_it(tmp_path: Path) -> None:
    """A later block's answer that is not its records: the batches before it are sent
    changed; that batch is the consumer's next fetch, refused then."""
    calls: list[int] = []

    def later_garbage(self: Any, blocks: Any, ctx: Any) -> list[bytes | None]:
        calls.append(len(blocks))
        answers = [self.on_consume_block(b, ctx) for b in blocks]
        return [a if i == 0 else b"\x07not a block" for i, a in enumerate(answers)]

    pipeline = _pipeline(tmp_path, "tp_fetch:BlocksReverse")
    hook = _hook(pipeline)
    hook.on_consume_blocks = later_garbage.__get__(hook, type(hook))
    p0 = _hooked_partition(pipeline, b"".join(PIECES))
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[v[::-1] for v in STORED[0]]]
    assert sorted(calls) == [1, 3]  # partition 1 (one batch), partition 0 (three)


def test_blocks_past_max_decode_memory_decompressed_are_handed_one_by_one(
        tmp_path: Path) -> None:
    from kiproxy.protocol.records import decompress_block

    gzip = decode_batch(PIECES[0]).header
    held = len(decompress_block(PIECES[0], 0, gzip))
    pipeline = _pipeline(tmp_path, "tp_fetch:BlocksReverse")
    pipeline.offload = BatchOffload(DecompressionLimits(), max_decode_memory=held)
    calls = type(_hook(pipeline)).calls
    calls.clear()
    p0, _ = _partitions(pipeline, "b-t")
    # partition 0: its first batch (gzip) fills the budget; the uncompressed one after
    # it holds nothing decompressed and goes too; the zstd one finds no room and goes
    # to on_consume_block alone. Partition 1 (gzip) after partition 0 gave it back.
    assert sorted(calls) == [[2], [2, 3]]
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]
    assert pipeline.offload.budget.used == 0
    # no room at all: every batch one by one, as without on_consume_blocks
    calls.clear()
    pipeline.offload = BatchOffload(DecompressionLimits(), max_decode_memory=held - 1)
    p0, _ = _partitions(pipeline, "b-t")
    assert calls == []  # the first batch of each partition is compressed and finds none
    assert _values(p0.records) == [[v[::-1] for v in vs] for vs in STORED]  # type: ignore[attr-defined]


def test_a_refusal_answered_for_one_block_ends_the_answer_before_it(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:BlocksReverse")

    def fetched(records: bytes) -> Any:
        out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "b-whole-refuse",
                                                                  records)), len(head(12)))
        return out.responses[0].partitions[0]

    # the second data batch (offset 2) refused: the first is sent, changed
    p0 = fetched(b"".join(PIECES))
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[v[::-1] for v in STORED[0]]]
    # from offset 2 on: the zstd batch is the second now, so offset 2 goes out
    p0 = fetched(b"".join(PIECES[1:]))
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[v[::-1] for v in STORED[1]]]


@pytest.mark.timeout(60)  # the bug this guards against was a fetch that never ended
def test_two_large_compressed_batches_under_a_small_budget_are_answered(
        tmp_path: Path, reverse: str) -> None:
    """A partition's second batch decompressed on a thread waited for the budget its
    first one still held, for ever, once max_decode_memory was below about one batch's
    bound (max_decompressed_batch_bytes) and another batch."""
    values = [os.urandom(200_000) for _ in range(2)]
    first = build_batch([Record(key=None, value=values[0], timestamp=1)],
                        compression=Compression.GZIP)
    second = bytearray(build_batch([Record(key=None, value=values[1], timestamp=1)],
                                   compression=Compression.GZIP))
    second[0:8] = (1).to_bytes(8, "big")  # base offset 1 (outside the CRC)
    pipeline = _pipeline(tmp_path, reverse)
    pipeline.offload = BatchOffload(DecompressionLimits(), max_decode_memory=int(32.5 * 2**20))
    assert len(first) > pipeline.offload.inline_bytes  # each decompressed on a thread
    p0 = _hooked_partition(pipeline, first + bytes(second))
    assert p0.error_code == ErrorCode.none
    assert _values(p0.records) == [[values[0][::-1]], [values[1][::-1]]]
    assert pipeline.offload.budget.used == 0


def test_large_compressed_batches_reach_on_consume_blocks_decompressed_on_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches too large to be decompressed on the loop are decompressed on a worker
    thread for the one call, while the budget has room for their worst case now."""
    values = [os.urandom(200_000) for _ in range(2)]
    first = build_batch([Record(key=None, value=values[0], timestamp=1)],
                        compression=Compression.ZSTD)
    second = bytearray(build_batch([Record(key=None, value=values[1], timestamp=1)],
                                   compression=Compression.ZSTD))
    second[0:8] = (1).to_bytes(8, "big")
    pipeline = _pipeline(tmp_path, "tp_fetch:BlocksReverse")
    on_threads = _on_threads(pipeline, monkeypatch)
    calls = type(_hook(pipeline)).calls
    calls.clear()
    p0 = _hooked_partition(pipeline, first + bytes(second))
    assert _values(p0.records) == [[values[0][::-1]], [values[1][::-1]]]
    assert [1, 1] in calls  # both in partition 0's one call
    assert on_threads.count("decompress_block") == 2
    assert pipeline.offload.budget.used == 0


async def _decompressed(lease: DecodeLease, batch: bytes) -> int:
    return len(await lease.decompress(batch, PartitionBatches.read(batch)))


def test_two_partitions_under_a_small_budget_do_not_wait_for_each_other() -> None:
    """Partition B's first batch is decompressed on a thread and B keeps its share; A's
    first batch then waits for the whole budget (its worst case); B asks for its second
    batch. B waited behind A while holding what A waited for: neither ever went on, and
    every later decode in the process waited behind them."""
    batches = [build_batch([Record(key=None, value=os.urandom(100_000), timestamp=1)],
                           compression=Compression.GZIP) for _ in range(3)]
    offload = BatchOffload(DecompressionLimits(), max_decode_memory=10 * 2**20)
    assert len(batches[0]) > offload.inline_bytes  # decompressed on a thread
    budget = offload.budget

    async def run() -> None:
        lease_a, lease_b = offload.lease(), offload.lease()
        await _decompressed(lease_b, batches[0])
        assert budget.used > 0  # B holds its first batch's share
        first_of_a = asyncio.ensure_future(_decompressed(lease_a, batches[1]))
        await asyncio.sleep(0.01)
        assert budget._waiters  # A waits for the whole budget
        second_of_b = asyncio.ensure_future(_decompressed(lease_b, batches[2]))
        assert await asyncio.wait_for(first_of_a, 5) > 100_000
        lease_a.release()
        assert await asyncio.wait_for(second_of_b, 5) > 0
        lease_b.release()
        assert budget.used == 0

    try:
        asyncio.run(run())
    finally:
        offload.close()
