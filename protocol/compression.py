"""Compression codecs of Kafka record batches, backed by cramjam.

The codec id is bits 0-2 of a batch's attributes. Snappy needs care: the Java
client writes Xerial's framing (a magic header, then length-prefixed blocks),
other clients may write raw snappy. Both are read; the Xerial framing, which
every consumer reads, is written.

Compression levels (:class:`CompressionLevels`) follow what a producer with default
settings writes, so that re-encoding a batch keeps about the ratio it arrived with:
gzip 6 (the JDK's and zlib's default), zstd 3 (Kafka's and zstd's default) and LZ4
fast mode (what Kafka's Java client and librdkafka write by default). Decompression
does not depend on the level.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import cramjam

from kiproxy.protocol.errors import CorruptBatch, UnsupportedCompression

XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = XERIAL_MAGIC + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK = 32 * 1024  # the Java client's default block size
_INT32 = struct.Struct(">i")
# cramjam's error when decompress_into runs out of output buffer (Rust's WriteZero).
_OUTPUT_FULL = "failed to write whole buffer"


class Compression(enum.IntEnum):
    """Kafka's compression codec ids (record batch attributes bits 0-2)."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


_MODULES: dict[Compression, Any] = {
    Compression.GZIP: cramjam.gzip, Compression.LZ4: cramjam.lz4, Compression.ZSTD: cramjam.zstd,
}
# Upper bounds of output/input size, with a margin: deflate 1032:1, LZ4 255:1, zstd
# 32768:1 (an RLE block: 128 KiB out of 4 bytes).
_MAX_RATIO = {Compression.GZIP: 1100, Compression.LZ4: 260, Compression.ZSTD: 40_000}


# Accepted levels, as Kafka's compression.<codec>.level producer configs (KIP-390).
GZIP_LEVELS = range(1, 10)
"""gzip (deflate) levels: 1 fastest .. 9 smallest."""
LZ4_LEVELS = range(1, 18)
"""LZ4 frame levels: 1 fast mode, 2 LZ4's middle mode, 3-12 LZ4HC, 13-17 the same as 12."""
ZSTD_LEVELS = range(-131072, 23)
"""zstd levels: negative ones are its fast modes, 0 means zstd's default (3), 22 smallest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressionLevels:
    """The level each codec compresses with when a records block is re-encoded.

    Named after Kafka's ``compression.gzip.level``, ``compression.lz4.level`` and
    ``compression.zstd.level``. The LZ4 number is LZ4's own frame level (cramjam
    passes it to ``LZ4F``): 1 is fast mode, 3 and above are LZ4HC. Kafka's Java
    client differs there: its default level 9 means fast mode too, any other level HC.
    Snappy has no levels.
    """

    gzip: int = 6
    """gzip level, 1-9."""
    lz4: int = 1
    """LZ4 frame level, 1-17 (1: fast mode, >= 3: LZ4HC)."""
    zstd: int = 3
    """zstd level, -131072..22."""

    def __post_init__(self) -> None:
        for name, allowed in (("gzip", GZIP_LEVELS), ("lz4", LZ4_LEVELS),
                              ("zstd", ZSTD_LEVELS)):
            level = getattr(self, name)
            if type(level) is not int or level not in allowed:
                raise ValueError(f"{name} compression level {level!r} is not an integer in "
                                 f"{allowed.start}..{allowed.stop - 1}")


DEFAULT_LEVELS = CompressionLevels()
"""The levels used unless the caller names others."""


def compression_from_attributes(attributes: int, offset: int = 0) -> Compression:
    """The codec named by a batch's attributes, or :class:`UnsupportedCompression`."""
    codec = attributes & 0x07
    if codec > 4:
        raise UnsupportedCompression(
            f"record batch at offset {offset}: unknown compression codec id {codec} "
            "in attributes (known: 0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd)"
        )
    return Compression(codec)


def _check_size(n: int, limit: int, codec: str) -> None:
    if n > limit:
        raise CorruptBatch(
            f"{codec} payload decompresses to more than {limit} bytes "
            "(max_decompressed_size); refusing it"
        )


def decompress(codec: Compression, data: bytes | memoryview, limit: int) -> bytes:
    """Decompress one batch's records block; raise :class:`CorruptBatch` if it is damaged.

    ``limit`` bounds the decompressed size; a larger result is an error.
    """
    try:
        if codec is Compression.SNAPPY:
            out = _snappy_decompress(bytes(data), limit)
        elif codec in _MODULES:  # gzip, lz4, zstd
            out = _decompress_bounded(codec, data, limit)
        else:
            return bytes(data)
    except CorruptBatch:
        raise
    except Exception as exc:  # cramjam raises its own DecompressionError / ValueError
        name = codec.name.lower()
        raise CorruptBatch(f"{name} records block does not decompress: {exc}") from None
    _check_size(len(out), limit, codec.name.lower())
    return out


def compress(
    codec: Compression, data: bytes, levels: CompressionLevels = DEFAULT_LEVELS
) -> bytes:
    """Compress a records block with ``codec`` (snappy in Xerial framing) at ``levels``."""
    if codec is Compression.GZIP:
        return bytes(cramjam.gzip.compress(data, level=levels.gzip))
    if codec is Compression.SNAPPY:
        return _snappy_compress_xerial(data)
    if codec is Compression.LZ4:
        return _lz4_compress_frame(data, levels.lz4)
    if codec is Compression.ZSTD:
        return bytes(cramjam.zstd.compress(data, level=levels.zstd))
    return data


def _lz4_compress_frame(data: bytes, level: int) -> bytes:
    # An LZ4 frame with independent blocks and no content checksum: the Java
    # client (KIP-57) cannot read linked blocks, cramjam's one-shot default.
    # cramjam's own default level is 4 (LZ4HC), ~6x the CPU of fast mode.
    compressor = cramjam.lz4.Compressor(level=level, content_checksum=False,
                                        block_linked=False)
    compressor.compress(data)
    return bytes(compressor.finish())


def _decompress_bounded(codec: Compression, data: bytes | memoryview, limit: int) -> bytes:
    module = _MODULES[codec]
    if len(data) * _MAX_RATIO[codec] <= limit:
        # Cannot inflate past the limit: decompress in one go.
        out = bytes(module.decompress(data))
        _check_size(len(out), limit, codec.name.lower())
        return out
    # Could be a bomb: decompress into a buffer of at most limit + 1 bytes, grown
    # from a guess, so that it stops when full instead of inflating whole first.
    size = min(limit + 1, max(4 * len(data), 64 * 1024))
    while True:
        buf = bytearray(size)
        try:
            n = int(module.decompress_into(data, buf))
        except cramjam.DecompressionError as exc:
            if _OUTPUT_FULL not in str(exc):
                raise
            if size <= limit:
                size = min(4 * size, limit + 1)
                continue
            n = size
        _check_size(n, limit, codec.name.lower())
        del buf[n:]
        return bytes(buf)


def _snappy_raw(data: bytes, limit: int, already: int = 0) -> bytes:
    # Raw snappy starts with the decompressed length; check it before cramjam
    # allocates it (a 7-byte input can claim 4 GiB).
    _check_size(already + int(cramjam.snappy.decompress_raw_len(data)), limit, "snappy")
    return bytes(cramjam.snappy.decompress_raw(data))


def _snappy_decompress(data: bytes, limit: int) -> bytes:
    if not data.startswith(XERIAL_MAGIC):
        return _snappy_raw(data, limit)
    pos = len(_XERIAL_HEADER)
    if len(data) < pos:
        raise CorruptBatch("snappy xerial header is truncated")
    out = bytearray()
    while pos < len(data):
        if pos + 4 > len(data):
            raise CorruptBatch(f"snappy xerial block length truncated at byte {pos}")
        (size,) = _INT32.unpack_from(data, pos)
        pos += 4
        if size < 0 or pos + size > len(data):
            raise CorruptBatch(
                f"snappy xerial block at byte {pos - 4} claims {size} bytes, "
                f"{len(data) - pos} remain"
            )
        out += _snappy_raw(data[pos : pos + size], limit, len(out))
        pos += size
    return bytes(out)


def _snappy_compress_xerial(data: bytes) -> bytes:
    parts = [_XERIAL_HEADER]
    view = memoryview(data)
    for start in range(0, len(data), _XERIAL_BLOCK):
        block = bytes(cramjam.snappy.compress_raw(view[start : start + _XERIAL_BLOCK]))
        parts.append(_INT32.pack(len(block)))
        parts.append(block)
    return b"".join(parts)
