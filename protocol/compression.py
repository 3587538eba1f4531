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

Decompression is bounded (:class:`DecompressionLimits`): it stops as soon as the
output passes the bound and raises :class:`DecompressionLimitExceeded`, so a bomb
costs no more than the bound in memory and the time to produce it. Ordinary blocks
take one call: python-lz4's frame decoder for LZ4 into a buffer a few times the
block's size, python-zstandard into exactly the size a zstd frame declares, cramjam's
decoders for gzip and for zstd frames that declare none; a block that fills its buffer
is streamed by the codec's incremental decoder (zlib for gzip, python-lz4's frame
decoder, python-zstandard's stream reader with a bounded window), and raw snappy
declares its length, checked before anything is allocated. Every decoder used
releases the GIL while it works, so a decompression may run on a worker thread; so
does every compressor (cramjam's for gzip and snappy, python-lz4's for LZ4 frames
except at level 2, python-zstandard's for zstd, kept per thread and level), so
re-compressing on a worker thread does not stall the event loop.
"""

from __future__ import annotations

import enum
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import cramjam
import lz4.frame
import zstandard

from kiproxy.protocol.errors import (
    CorruptBatch,
    DecompressionLimitExceeded,
    UnsupportedCompression,
)

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
_GUESS_RATIO = 8
_STREAM_CHUNK = 1024 * 1024  # output asked of a streaming decoder per call


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
    return _CODECS[codec]


_CODECS = tuple(Compression(i) for i in range(5))
"""Codec by id: an index is cheaper than ``Compression(id)`` (called per batch)."""

DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES = 32 * 1024 * 1024
"""32 MiB: 32 times Kafka's default ``message.max.bytes`` (1 MiB), the largest a batch
of default size could hold at 32:1, and far above what producers with default
``batch.size`` write."""
DEFAULT_MAX_DECOMPRESSION_RATIO = 256
"""Decompressed/compressed bytes above which a batch larger than the ratio floor is
refused; real record data compresses 2-30:1, a bomb 1,000-30,000:1."""
RATIO_FLOOR = 4 * 1024 * 1024
"""Output any batch may have regardless of its ratio (small batches of zeros are honest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecompressionLimits:
    """How much output a compressed records block may produce before it is refused.

    A block may decompress to at most ``max_bytes``, and to at most ``max_ratio`` times
    its compressed size once past :data:`RATIO_FLOOR` (``max_ratio`` 0: no ratio check).
    Decompression stops as soon as the output passes the bound, so a bomb costs the
    bound in memory and the time to produce it, never its full expansion.
    """

    max_bytes: int = DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES
    """Largest decompressed records block (``max_decompressed_batch_bytes``)."""
    max_ratio: int = DEFAULT_MAX_DECOMPRESSION_RATIO
    """Largest decompressed/compressed ratio past the floor (``max_decompression_ratio``)."""

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_ratio < 0:
            raise ValueError(f"decompression limits must not be negative: {self}")

    def bound(self, compressed_size: int) -> tuple[int, str]:
        """The output bound of a block of ``compressed_size`` bytes, and the setting it
        comes from."""
        if self.max_ratio:
            by_ratio = max(self.max_ratio * compressed_size, RATIO_FLOOR)
            if by_ratio < self.max_bytes:
                return by_ratio, "max_decompression_ratio"
        return self.max_bytes, "max_decompressed_batch_bytes"


DEFAULT_DECOMPRESSION_LIMITS = DecompressionLimits()
"""32 MiB per records block, and 256:1 past 4 MiB."""


def _over(codec: Compression, limit: int, setting: str) -> DecompressionLimitExceeded:
    detail = (f"{limit} bytes ({setting})" if setting != "max_decompression_ratio" else
              f"{limit} bytes ({setting}: its compressed size times the ratio)")
    return DecompressionLimitExceeded(
        f"{codec.name.lower()} records block decompresses to more than {detail}; "
        f"refusing it (raise {setting} if such batches are expected)",
        limit=limit, setting=setting)


def decompress(codec: Compression, data: bytes | memoryview, limit: int,
               setting: str = "max_decompressed_batch_bytes") -> bytes:
    """Decompress one batch's records block; raise :class:`CorruptBatch` if it is damaged.

    More than ``limit`` bytes of output raises :class:`DecompressionLimitExceeded`
    (naming ``setting``) as soon as the decoder has produced them: memory and time
    stay bounded by ``limit``.
    """
    try:
        if codec is Compression.SNAPPY:
            out = _snappy_decompress(bytes(data), limit, setting)
        elif codec in _MODULES:  # gzip, lz4, zstd
            out = _decompress_bounded(codec, data, limit, setting)
        else:
            return bytes(data)
    except CorruptBatch:
        raise
    except Exception as exc:  # cramjam, zlib, lz4 and zstandard raise their own errors
        name = codec.name.lower()
        raise CorruptBatch(f"{name} records block does not decompress: {exc}") from None
    if len(out) > limit:
        raise _over(codec, limit, setting)
    return out


_ZSTD_LOCAL = threading.local()  # a zstd decoder and compressors per thread (~8 us, ~40 us)


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
        return _zstd_compress(data, levels.zstd)
    return data


def _zstd_compress(data: bytes, level: int) -> bytes:
    # python-zstandard with one compressor per thread and level: the frame zstd's
    # one-shot ZSTD_compress writes (content size, no checksum; byte-identical to
    # cramjam's), without setting up a compression context for every batch, which
    # costs ~40 us: 40% of compressing a 16 KiB block, 13% of an 80 KiB one.
    compressors: dict[int, zstandard.ZstdCompressor] | None = getattr(
        _ZSTD_LOCAL, "compressors", None)
    if compressors is None:
        compressors = _ZSTD_LOCAL.compressors = {}
    compressor = compressors.get(level)
    if compressor is None:
        compressor = compressors[level] = zstandard.ZstdCompressor(level=level)
    out: bytes = compressor.compress(data)
    return out


def _lz4_compress_frame(data: bytes, level: int) -> bytes:
    # An LZ4 frame with independent 64 KiB blocks, block checksums and no content
    # checksum: the Java client (KIP-57) cannot read linked blocks, cramjam's one-shot
    # default. python-lz4 writes it and releases the GIL while it compresses;
    # cramjam's streaming Compressor holds the GIL, which stalled the event loop for
    # as long as a batch compressing on a decode thread took. The frames are
    # byte-identical for every level but 2, which is LZ4 1.10's middle mode in
    # cramjam's liblz4 and fast mode in python-lz4's 1.9.4: cramjam writes that one.
    if level == 2:
        compressor = cramjam.lz4.Compressor(level=level, content_checksum=False,
                                            block_linked=False)
        compressor.compress(data)
        return bytes(compressor.finish())
    out: bytes = lz4.frame.compress(
        data, compression_level=level, block_size=lz4.frame.BLOCKSIZE_MAX64KB,
        block_linked=False, content_checksum=False, block_checksum=True, store_size=False)
    return out


def _decompress_bounded(codec: Compression, data: bytes | memoryview, limit: int,
                       setting: str) -> bytes:
    if codec is Compression.LZ4:
        return _lz4_decompress(data, limit, setting)
    if codec is Compression.ZSTD:
        whole = _zstd_sized(data, limit)
        if whole is not None:
            return whole
    module = _MODULES[codec]
    if len(data) * _MAX_RATIO[codec] <= limit:
        # Cannot inflate past the limit: decompress in one go.
        return bytes(module.decompress(data))
    # Most batches compress less than _GUESS_RATIO:1: one cramjam call into a buffer of
    # that size (what ordinary traffic costs). A block that fills it is streamed with
    # the codec's own incremental decoder, which stops once past the limit.
    size = min(limit + 1, max(_GUESS_RATIO * len(data), 64 * 1024))
    buf = bytearray(size)
    try:
        n = int(module.decompress_into(data, buf))
    except cramjam.DecompressionError as exc:
        if _OUTPUT_FULL not in str(exc):
            raise
        if size > limit:
            raise _over(codec, limit, setting) from None
        del buf
        return _STREAMS[codec](data, limit, codec, setting)
    if n > limit:
        raise _over(codec, limit, setting)
    del buf[n:]
    return bytes(buf)


class _Sink:
    """Decompressed chunks, refused as soon as their total passes the limit."""

    __slots__ = ("chunks", "codec", "limit", "setting", "size")

    def __init__(self, codec: Compression, limit: int, setting: str) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.codec, self.limit, self.setting = codec, limit, setting

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.chunks.clear()
            raise _over(self.codec, self.limit, self.setting)
        self.chunks.append(chunk)

    def room(self) -> int:
        """How much more to ask the decoder for: one byte past the limit detects a bomb."""
        return min(_STREAM_CHUNK, self.limit + 1 - self.size)

    def join(self) -> bytes:
        out = b"".join(self.chunks)
        self.chunks.clear()
        return out


def _gzip_stream(data: bytes | memoryview, limit: int, codec: Compression,
                 setting: str) -> bytes:
    sink = _Sink(codec, limit, setting)
    rest = bytes(data)
    while rest:  # one gzip member after another, as cramjam reads them
        inflater = zlib.decompressobj(wbits=31)
        pending = rest
        while not inflater.eof:
            chunk = inflater.decompress(pending, sink.room())
            sink.add(chunk)
            pending = inflater.unconsumed_tail
            if not chunk and not pending:
                raise CorruptBatch("gzip records block is truncated")
        rest = inflater.unused_data
    return sink.join()


def _zstd_sized(data: bytes | memoryview, limit: int) -> bytes | None:
    """A single zstd frame that declares its size (librdkafka and the proxy write such
    frames) within the limit, decoded in one python-zstandard call into exactly that
    many bytes; None for anything else (unknown size, several frames, damage), which
    the bounded path decides."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        return None
    if not 0 < size <= limit:  # -1: the frame does not say; 0: python-zstandard
        return None             # answers b"" without looking at what follows
    decoder = getattr(_ZSTD_LOCAL, "decoder", None)
    if decoder is None:
        decoder = _ZSTD_LOCAL.decoder = zstandard.ZstdDecompressor()
    try:
        out: bytes = decoder.decompress(data, allow_extra_data=False)
    except zstandard.ZstdError:
        return None
    return out


def _lz4_decompress(data: bytes | memoryview, limit: int, setting: str) -> bytes:
    # The one frame a producer writes per batch, in one python-lz4 call into a buffer
    # of the guessed size (about 3x faster than cramjam's LZ4 frame decoder here, and
    # without the GIL). Past the guess, several frames or a cut frame: the stream goes
    # on from where this call stopped.
    decoder = lz4.frame.LZ4FrameDecompressor()
    out: bytes = decoder.decompress(
        data, max_length=min(limit + 1, max(_GUESS_RATIO * len(data), 64 * 1024)))
    if decoder.eof and not decoder.unused_data:
        if len(out) > limit:
            raise _over(Compression.LZ4, limit, setting)
        return out
    sink = _Sink(Compression.LZ4, limit, setting)
    sink.add(out)
    del out
    _lz4_frames(_lz4_finish(decoder, b"", sink), sink)
    return sink.join()


def _lz4_stream(data: bytes | memoryview, limit: int, codec: Compression,
                setting: str) -> bytes:
    sink = _Sink(codec, limit, setting)
    _lz4_frames(bytes(data), sink)
    return sink.join()


def _lz4_frames(rest: bytes, sink: _Sink) -> None:
    """Decode one LZ4 frame after another from ``rest`` into ``sink``."""
    while rest:
        rest = _lz4_finish(lz4.frame.LZ4FrameDecompressor(), rest, sink)


def _lz4_finish(decoder: lz4.frame.LZ4FrameDecompressor, pending: bytes, sink: _Sink) -> bytes:
    """Feed ``pending`` to ``decoder`` and decode its frame to the end into ``sink``,
    within the sink's limit; the bytes after the frame."""
    while not decoder.eof:
        chunk = decoder.decompress(pending, max_length=sink.room())
        sink.add(chunk)
        pending = b""
        if not chunk and decoder.needs_input and not decoder.eof:
            raise CorruptBatch("lz4 records block is truncated")
    rest: bytes = decoder.unused_data
    return rest


def _zstd_stream(data: bytes | memoryview, limit: int, codec: Compression,
                 setting: str) -> bytes:
    sink = _Sink(codec, limit, setting)
    # A frame may ask for a window of up to 2 GiB; an honest frame of at most ``limit``
    # bytes needs no more than the next power of two above it (zstd's own level-22
    # window is 128 MiB). Only the pages the bounded output passes through get used.
    window = max(8 << 20, 2 << max(limit, 1).bit_length())
    decoder = zstandard.ZstdDecompressor(max_window_size=min(window, 1 << 31))
    with decoder.stream_reader(bytes(data), read_across_frames=True) as reader:
        while True:
            chunk = reader.read(sink.room())
            if not chunk:
                break
            sink.add(chunk)
    return sink.join()


_STREAMS = {Compression.GZIP: _gzip_stream, Compression.LZ4: _lz4_stream,
            Compression.ZSTD: _zstd_stream}


def _snappy_raw(data: bytes, limit: int, setting: str, already: int = 0) -> bytes:
    # Raw snappy starts with the decompressed length; check it before cramjam
    # allocates it (a 7-byte input can claim 4 GiB).
    if already + int(cramjam.snappy.decompress_raw_len(data)) > limit:
        raise _over(Compression.SNAPPY, limit, setting)
    return bytes(cramjam.snappy.decompress_raw(data))


def _snappy_decompress(data: bytes, limit: int, setting: str) -> bytes:
    if not data.startswith(XERIAL_MAGIC):
        return _snappy_raw(data, limit, setting)
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
        out += _snappy_raw(data[pos : pos + size], limit, setting, len(out))
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
