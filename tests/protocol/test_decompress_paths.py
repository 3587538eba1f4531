"""The fast decompression paths give what the bounded path gives, or leave it to it.

LZ4 frames go through python-lz4's frame decoder in one call, and zstd frames that
declare their size through python-zstandard's one-shot decoder; several frames, a
frame without a declared size, a size that lies or a cut frame take the bounded path,
which decides. The outputs equal cramjam's reading of the same bytes.
"""

from __future__ import annotations

import cramjam
import lz4.frame
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.compression import (
    DEFAULT_LEVELS,
    Compression,
    DecompressionLimitExceeded,
    compress,
    decompress,
)
from kiproxy.protocol.errors import CorruptBatch

LIMIT = 1 << 20


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=3),
       st.sampled_from([Compression.LZ4, Compression.ZSTD]))
def test_one_or_several_frames_read_as_cramjam_reads_them(parts: list[bytes],
                                                          codec: Compression) -> None:
    block = b"".join(compress(codec, part, DEFAULT_LEVELS) for part in parts)
    module = cramjam.lz4 if codec is Compression.LZ4 else cramjam.zstd
    assert decompress(codec, block, LIMIT) == bytes(module.decompress(block)) == b"".join(parts)


def test_a_zstd_frame_without_a_declared_size_takes_the_bounded_path() -> None:
    data = b"record " * 5000
    block = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert zstandard.frame_content_size(block) == -1
    assert decompress(Compression.ZSTD, block, LIMIT) == data
    with pytest.raises(DecompressionLimitExceeded):
        decompress(Compression.ZSTD, block, 1000)


@pytest.mark.parametrize("declared", [500, 2000, 3000])
def test_a_zstd_frame_whose_declared_size_lies_is_corrupt(declared: int) -> None:
    data = bytes(range(256)) * 5 + b"hello world" * 100  # 2,380 bytes
    block = bytearray(compress(Compression.ZSTD, data, DEFAULT_LEVELS))
    assert zstandard.frame_content_size(bytes(block)) == len(data)
    block[5:7] = (declared - 256).to_bytes(2, "little")  # the 2-byte size field: value - 256
    assert zstandard.frame_content_size(bytes(block)) == declared
    with pytest.raises(CorruptBatch):
        decompress(Compression.ZSTD, bytes(block), LIMIT)


def test_a_zstd_frame_declaring_more_than_the_limit_is_refused() -> None:
    data = b"\x00" * 50_000
    block = compress(Compression.ZSTD, data, DEFAULT_LEVELS)
    with pytest.raises(DecompressionLimitExceeded):
        decompress(Compression.ZSTD, block, 10_000)


@pytest.mark.parametrize("codec", [Compression.LZ4, Compression.ZSTD])
def test_a_cut_frame_is_corrupt(codec: Compression) -> None:
    block = compress(codec, b"value " * 2000, DEFAULT_LEVELS)
    with pytest.raises(CorruptBatch):
        decompress(codec, block[:-5], LIMIT)


def test_an_lz4_block_past_the_guess_is_streamed_within_the_limit() -> None:
    data = b"\x00" * 2_000_000  # far more than eight times its frame
    block = lz4.frame.compress(data)
    assert decompress(Compression.LZ4, block, 4_000_000) == data
    with pytest.raises(DecompressionLimitExceeded):
        decompress(Compression.LZ4, block, 1_000_000)


@pytest.mark.parametrize("data", [b"", b"abc" * 100])
def test_bytes_after_a_zstd_frame_are_corrupt(data: bytes) -> None:
    block = compress(Compression.ZSTD, data, DEFAULT_LEVELS) + b"garbage"
    with pytest.raises(CorruptBatch):
        decompress(Compression.ZSTD, block, LIMIT)
