"""FrameAssembler: frames received straight into the buffers it hands out.

The proxy's sockets receive into whatever :meth:`FrameAssembler.get_buffer`
returns (``asyncio.BufferedProtocol``). Whatever the segmentation, the frames
that come out must be exactly the frames that were sent; small ones share a
chunk buffer, a large one is received into a buffer of its own size that is
handed out without a copy; a bad length prefix raises before any allocation.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.errors import FrameTooLarge, MalformedFrame
from kiproxy.protocol.framing import FrameAssembler, FrameDecoder, encode_frame

CHUNK = 256
LARGE = 64


def receive(assembler: FrameAssembler, data: bytes, most: int | None = None) -> list[bytes]:
    """Play a socket: receive ``data`` through get_buffer/buffer_updated, ``most`` bytes a time."""
    frames: list[bytes] = []
    pos = 0
    while pos < len(data):
        buf = assembler.get_buffer()
        assert len(buf) > 0
        n = min(len(buf), len(data) - pos, most or len(data))
        buf[:n] = data[pos : pos + n]
        pos += n
        frames.extend(bytes(f) for f in assembler.buffer_updated(n))
    return frames


def small_assembler(max_frame_size: int = 10_000, part_size: int = CHUNK) -> FrameAssembler:
    """Sizes scaled down, so that every path (shared chunk, one exact buffer, parts) runs."""
    return FrameAssembler(max_frame_size, chunk_size=CHUNK, large_frame=LARGE,
                          part_size=part_size)


def test_frames_split_at_every_byte_boundary() -> None:
    payloads = [b"", b"a", b"x" * (LARGE - 1), bytes(range(256)) * 3, b"hello kafka", b"y" * LARGE]
    stream = b"".join(encode_frame(p) for p in payloads)
    for cut in range(len(stream) + 1):
        assembler = small_assembler()
        frames = receive(assembler, stream[:cut]) + receive(assembler, stream[cut:])
        assert frames == payloads, f"split at byte {cut}"
        assert assembler.buffered == 0


def test_one_byte_at_a_time() -> None:
    payloads = [b"q" * n for n in (0, 1, 3, LARGE - 1, LARGE, CHUNK, 3 * CHUNK)]
    stream = b"".join(encode_frame(p) for p in payloads)
    assembler = small_assembler()
    assert receive(assembler, stream, most=1) == payloads


def test_many_small_frames_come_out_of_one_receive_as_bytes() -> None:
    assembler = small_assembler()
    buf = assembler.get_buffer()
    data = b"".join(encode_frame(bytes([i]) * 10) for i in range(8))
    buf[: len(data)] = data
    frames = assembler.buffer_updated(len(data))
    assert frames == [bytes([i]) * 10 for i in range(8)]
    assert all(type(f) is bytes for f in frames)


def test_a_large_frame_is_received_into_its_own_buffer_and_handed_out_as_is() -> None:
    assembler = small_assembler(part_size=4 * CHUNK)
    payload = bytes(range(256)) * 4
    data = encode_frame(payload)
    buf = assembler.get_buffer()
    buf[:10] = data[:10]
    assert assembler.buffer_updated(10) == []
    own = assembler.get_buffer()
    assert len(own) == len(payload) - 6, "the rest of the frame, exactly"
    own[:] = data[10:]
    (frame,) = assembler.buffer_updated(len(own))
    assert type(frame) is bytes
    assert frame == payload
    # The next frame goes to the shared chunk again, and the handed-out frame stays intact.
    assert receive(assembler, encode_frame(b"next")) == [b"next"]
    assert frame == payload


def test_a_frame_up_to_part_size_arrives_in_pieces_into_one_bytes_object() -> None:
    # A broker's stream sets part_size to its largest answer: every answer is received
    # into the one object handed out, however many receives it takes (no join).
    assembler = small_assembler(max_frame_size=100_000, part_size=100_000)
    payload = bytes(range(256)) * 300
    data = encode_frame(payload)
    first = assembler.get_buffer()
    first[:20] = data[:20]
    assert assembler.buffer_updated(20) == []
    views = []
    at = 20
    while at < len(data):
        view = assembler.get_buffer()
        views.append(len(view))
        n = min(len(view), 7000)
        view[:n] = data[at:at + n]
        at += n
        frames = assembler.buffer_updated(n)
    assert views[0] == len(payload) - 16  # the whole rest of the frame, on its prefix
    assert frames == [payload] and type(frames[0]) is bytes
    assert receive(assembler, encode_frame(b"next")) == [b"next"]
    assert frames[0] == payload


def test_the_buffer_of_a_large_frame_is_made_only_when_reading_goes_on() -> None:
    # A reader that pauses right after a prefix must not hold a buffer of that size.
    assembler = small_assembler(part_size=5000)
    buf = assembler.get_buffer()
    data = encode_frame(b"ok") + struct.pack(">i", 5000)
    buf[: len(data)] = data
    assert assembler.buffer_updated(len(data)) == [b"ok"]
    assert assembler.buffered == 4
    assert len(assembler.get_buffer()) == 5000


def test_a_frame_above_part_size_is_received_in_parts_made_as_bytes_arrive() -> None:
    # A client that sends only a length prefix must not make the proxy commit the
    # whole frame: buffers grow with the data, never more than part_size or what
    # has arrived ahead of it.
    assembler = FrameAssembler(10_000, chunk_size=CHUNK, large_frame=LARGE, part_size=CHUNK)
    payload = bytes(range(256)) * 7 + b"tail"
    data = encode_frame(payload)
    frames: list[bytes] = []
    pos = 0
    while pos < len(data):
        buf = assembler.get_buffer()
        # Never more ahead of the data than part_size, or than what already arrived.
        assert 0 < len(buf) <= max(CHUNK, pos - 4 - len(b"".join(frames)))
        n = min(len(buf), len(data) - pos, 100)
        buf[:n] = data[pos : pos + n]
        pos += n
        frames.extend(bytes(f) for f in assembler.buffer_updated(n))
        assert assembler.buffered == pos - 4 * len(frames) - len(b"".join(frames))
    assert frames == [payload]
    assert receive(assembler, encode_frame(b"next") * 2) == [b"next", b"next"]


def test_a_bare_prefix_of_the_largest_frame_commits_one_part() -> None:
    assembler = FrameAssembler()  # 100 MiB maximum, 64 KiB first part
    buf = assembler.get_buffer()
    buf[:4] = struct.pack(">i", 100 * 1024 * 1024)
    assert assembler.buffer_updated(4) == []
    assert len(assembler.get_buffer()) == assembler.part_size == 64 * 1024


def test_an_assembler_with_nothing_pending_holds_no_chunk() -> None:
    """Idle connections cost no read buffer: the chunk is made when bytes arrive and
    dropped once they are all handed out."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assemblers = [FrameAssembler() for _ in range(100)]  # 64 KiB chunks
        for assembler in assemblers:
            assert receive(assembler, encode_frame(b"ping")) == [b"ping"]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 100 * 64 * 1024 // 8, f"{held} bytes held by 100 idle assemblers"
    # A partial frame keeps its bytes until the rest arrives.
    assembler = FrameAssembler()
    assert receive(assembler, encode_frame(b"half")[:6]) == []
    assert assembler.buffered == 6
    assert receive(assembler, b"lf") == [b"half"]


def test_a_small_frame_near_the_end_of_the_chunk_is_moved_to_the_front() -> None:
    assembler = small_assembler()
    filler = encode_frame(b"f" * (CHUNK - 4 - 20))
    split = encode_frame(b"s" * (LARGE - 1))
    data = filler + split
    assert receive(assembler, data, most=CHUNK) == [b"f" * (CHUNK - 24), b"s" * (LARGE - 1)]


def test_oversized_frame_is_refused_at_the_prefix() -> None:
    assembler = small_assembler(max_frame_size=300)
    buf = assembler.get_buffer()
    buf[:4] = struct.pack(">i", 301)
    with pytest.raises(FrameTooLarge, match="301 exceeds max_frame_size 300"):
        assembler.buffer_updated(4)


def test_frame_of_exactly_the_maximum_is_accepted() -> None:
    assembler = small_assembler(max_frame_size=300)
    assert receive(assembler, encode_frame(b"m" * 300)) == [b"m" * 300]


def test_oversized_frame_after_good_frames_in_the_same_receive() -> None:
    assembler = small_assembler(max_frame_size=10)
    buf = assembler.get_buffer()
    data = encode_frame(b"ok") + struct.pack(">i", 11)
    buf[: len(data)] = data
    with pytest.raises(FrameTooLarge):
        assembler.buffer_updated(len(data))


@pytest.mark.parametrize("size", [-1, -2**31])
def test_negative_frame_length_is_malformed(size: int) -> None:
    assembler = small_assembler()
    buf = assembler.get_buffer()
    buf[:4] = struct.pack(">i", size)
    with pytest.raises(MalformedFrame, match="negative"):
        assembler.buffer_updated(4)


def test_a_huge_length_is_refused_without_allocating_it() -> None:
    assembler = FrameAssembler()  # default 100 MiB maximum
    buf = assembler.get_buffer()
    buf[:4] = struct.pack(">i", 2**31 - 1)
    with pytest.raises(FrameTooLarge):
        assembler.buffer_updated(4)


def test_large_frame_threshold_must_fit_the_chunk() -> None:
    with pytest.raises(ValueError, match="large_frame"):
        FrameAssembler(chunk_size=64, large_frame=61)


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(max_size=3 * CHUNK), max_size=12),
       reads=st.lists(st.integers(min_value=1, max_value=2 * CHUNK), min_size=1, max_size=20))
def test_same_frames_as_frame_decoder_whatever_the_segmentation(
    payloads: list[bytes], reads: list[int]
) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    assembler = small_assembler()
    frames: list[bytes] = []
    pos, i = 0, 0
    while pos < len(stream):
        buf = assembler.get_buffer()
        n = min(len(buf), len(stream) - pos, reads[i % len(reads)])
        i += 1
        buf[:n] = stream[pos : pos + n]
        pos += n
        frames.extend(bytes(f) for f in assembler.buffer_updated(n))
    assert frames == payloads == FrameDecoder().feed(stream)
    assert assembler.buffered == 0
