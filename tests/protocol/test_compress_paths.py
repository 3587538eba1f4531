"""Re-compression writes the frames the codecs' one-shot compressors write.

zstd blocks are compressed by a python-zstandard compressor kept per thread and
level (no context set up per batch); the frame must be byte-identical to zstd's
one-shot ``ZSTD_compress`` (cramjam's), whatever the level, the size, the thread or
what the same compressor compressed before.
"""

from __future__ import annotations

import threading

import cramjam
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.compression import Compression, CompressionLevels, compress, decompress

LEVELS = st.sampled_from([-131072, -7, -1, 0, 1, 3, 6, 19, 22])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=20_000) | st.text(max_size=5_000).map(str.encode),
                          LEVELS), min_size=1, max_size=4))
def test_zstd_frames_equal_the_one_shot_compressor(blocks: list[tuple[bytes, int]]) -> None:
    # Several blocks in a row: a kept compressor must not carry anything from one
    # block into the next.
    for data, level in blocks:
        frame = compress(Compression.ZSTD, data, CompressionLevels(zstd=level))
        assert frame == bytes(cramjam.zstd.compress(data, level=level))
        assert decompress(Compression.ZSTD, frame, 1 << 20) == data


def test_each_level_writes_its_own_frame() -> None:
    # A block on which the levels differ, compressed at each level in turn and back.
    data = b"".join(b'{"id":%d,"kind":"order","note":"status %d lisbon %d"}' % (i, i * 7 % 1000,
                                                                             i * 13 % 97)
                    for i in range(3000))
    frames = {}
    for level in (1, 19, -5, 3, 1, 22, 3):
        frame = compress(Compression.ZSTD, data, CompressionLevels(zstd=level))
        assert frame == bytes(cramjam.zstd.compress(data, level=level)), level
        frames[level] = frame
    assert len({frames[level] for level in (-5, 1, 3, 19)}) == 4


def test_zstd_compressors_on_several_threads_do_not_mix() -> None:
    blocks = [bytes([i]) * 3000 + str(i).encode() * 2000 for i in range(8)]
    expected = [bytes(cramjam.zstd.compress(b, level=3)) for b in blocks]
    wrong: list[int] = []
    start = threading.Barrier(4)

    def work(offset: int) -> None:
        start.wait()
        for round_ in range(50):
            i = (offset + round_) % len(blocks)
            if compress(Compression.ZSTD, blocks[i], CompressionLevels()) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
