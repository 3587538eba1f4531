"""A fetched partition's batches worked on at once (``kiproxy.protocol.parallel``).

Each function gives, batch by batch, what its one-batch counterpart gives, whatever the
number of threads: ``open_blocks`` what ``open_block`` gives (None for exactly the
blocks it answers None for, a malformed block included, the others opened all the
same), ``verify_crcs`` the first batch whose CRC does not hold, ``blocks_around`` the
pieces ``encode_block_parts`` writes. The CRC-32C the threads use is the ``crc32c``
package's own function, checked against the standard check value when bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import crc32c
import crc32c._crc32c
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kiproxy.interceptors.sealing import aes_gcm, compiled_gcm
from kiproxy.protocol import parallel
from kiproxy.protocol._codec import open_blocks as open_blocks_on
from kiproxy.protocol._codec import verify_crcs as verify_crcs_on
from kiproxy.protocol.compression import Compression
from kiproxy.protocol.records import (
    Header,
    Record,
    build_batch,
    encode_block_parts,
    encode_records,
    open_block,
    read_batch_headers,
    seal_values,
)

MARKER = "kiproxy.encryption"
DESCRIPTOR = b"\x01\x01descriptor"
AAD = b"associated"
GCM = aes_gcm(AESGCM.generate_key(bit_length=256))  # libsodium's where it is bound
GCM128 = aes_gcm(AESGCM.generate_key(bit_length=128))  # OpenSSL's: a context per thread
BASE = 1_700_000_000_000

needs_compiled = pytest.mark.skipif(not compiled_gcm(), reason="OpenSSL cannot be bound here")


def _plain(n: int, seed: int) -> tuple[Record, ...]:
    return tuple(Record(key=b"k%d" % i, value=os.urandom(seed % 900 + i), timestamp=BASE + i,
                        headers=[Header("h", b"%d" % i)] if i % 3 else [], offset_delta=i)
                 for i in range(n))


def _sealed(plain: tuple[Record, ...], descriptor: bytes = DESCRIPTOR, gcm: Any = GCM
            ) -> bytes:
    sealed = seal_values(plain, gcm, AAD, Header(MARKER, descriptor),
                         os.urandom(12 * len(plain)), 12)
    return encode_records(sealed, BASE, False)[0]


def _tampered(block: bytes) -> bytes:
    out = bytearray(block)
    out[len(out) // 2] ^= 0x01  # inside some record's sealed value: it no longer opens
    return bytes(out)


@needs_compiled
@pytest.mark.parametrize("gcm", [GCM, GCM128], ids=["256-bit", "128-bit"])
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_open_blocks_gives_each_block_what_open_block_gives(threads: int, gcm: Any) -> None:
    plains = [_plain(n, seed) for seed, n in enumerate([1, 40, 7, 200, 3, 64])]
    blocks: list[bytes | memoryview] = [_sealed(p, gcm=gcm) for p in plains]
    counts = [len(p) for p in plains]
    blocks[1] = _tampered(bytes(blocks[1]))             # does not open
    blocks[2] = _sealed(plains[2], b"\x01\x01another", gcm=gcm)  # another descriptor
    blocks[4] = b"\x07not a block"                      # malformed
    blocks[5] = memoryview(b"\xff" * 5 + bytes(blocks[5]) + b"\xee")[5:-1]  # a view
    opened = open_blocks_on(list(blocks), counts, MARKER, DESCRIPTOR, gcm.decrypt, AAD, 12,
                            threads)
    assert [o is None for o in opened] == [False, True, True, False, True, False]
    for i in (0, 3, 5):
        assert opened[i] == open_block(blocks[i], counts[i], MARKER, DESCRIPTOR,
                                       gcm.decrypt, AAD, 12)
        assert opened[i] == encode_records(plains[i], BASE, False)[0]
    # the module's wrapper, with its own thread count, says the same
    assert parallel.open_blocks(list(blocks), counts, MARKER, DESCRIPTOR, gcm, AAD,
                                12) == opened


@needs_compiled
def test_open_blocks_leaves_every_block_to_the_general_path_for_another_cipher() -> None:
    block = _sealed(_plain(5, 1))
    assert open_blocks_on([block, block], [5, 5], MARKER, DESCRIPTOR,
                          AESGCM(os.urandom(32)).decrypt, AAD, 12, 2) == [None, None]
    assert open_blocks_on([], [], MARKER, DESCRIPTOR, GCM.decrypt, AAD, 12, 2) == []
    with pytest.raises(ValueError, match="1 blocks and 2 counts"):
        open_blocks_on([block], [5, 5], MARKER, DESCRIPTOR, GCM.decrypt, AAD, 12, 2)
    with pytest.raises(ValueError, match="a count of -1"):
        open_blocks_on([block], [-1], MARKER, DESCRIPTOR, GCM.decrypt, AAD, 12, 2)


def _batches(n: int) -> tuple[bytes, list[tuple[int, int]]]:
    frame, spans = b"\x00" * 9, []
    for i in range(n):
        batch = build_batch(_plain(5 + i, i), base_offset=100 * i,
                            compression=Compression.NONE)
        spans.append((len(frame), len(frame) + len(batch)))
        frame += batch
    return frame + b"\x01\x02", spans


def test_the_crcs_are_the_packages_compiled_function_here() -> None:
    from kiproxy.protocol._codec import crc32c_bound

    assert crc32c_bound()  # bound at import; else the tests below run the fallback


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_verify_crcs_names_the_first_batch_whose_crc_does_not_hold(threads: int) -> None:
    frame, spans = _batches(7)
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    assert verify_crcs_on(frame, starts, ends, threads) == -1
    assert parallel.verify_crcs(frame, spans) == -1
    for broken in (6, 3, 0):
        bad = bytearray(frame)
        bad[ends[broken] - 2] ^= 0x40  # a byte of its last record
        bad[ends[6] - 1] ^= 0x40  # and of the last batch, which is after it
        assert verify_crcs_on(bytes(bad), starts, ends, threads) == broken
    assert verify_crcs_on(frame, [], [], threads) == -1
    with pytest.raises(ValueError, match="are no batch"):
        verify_crcs_on(frame, [starts[0]], [len(frame) + 1], threads)
    with pytest.raises(ValueError, match="2 starts and 1 ends"):
        verify_crcs_on(frame, starts[:2], ends[:1], threads)


def test_blocks_around_writes_what_encode_block_parts_writes() -> None:
    frame, spans = _batches(5)
    headers = list(read_batch_headers(frame, spans[0][0], spans[-1][1]))
    blocks = [encode_records(tuple(r.with_value(b"new %d" % i) for r in _plain(5 + i, i)),
                             h.base_timestamp, False)[0] for i, h in enumerate(headers)]
    assert parallel.blocks_around(headers, blocks) == \
        [encode_block_parts(h, b) for h, b in zip(headers, blocks, strict=True)]
    # a compressed batch's header: left to encode_block_parts (it compresses)
    zstd = read_batch_headers(build_batch(_plain(3, 1), compression=Compression.ZSTD))[0]
    assert parallel.blocks_around([zstd, headers[0]], [blocks[0], blocks[0]]) == \
        [None, encode_block_parts(headers[0], blocks[0])]


def test_crc32c_is_bound_only_to_a_function_that_gives_crc32c() -> None:
    # in a fresh interpreter, before kiproxy.protocol.parallel binds it
    script = f"""
import ctypes.util
from kiproxy.protocol._codec import load_crc32c
for path, symbol in [({crc32c._crc32c.__file__!r}, "no_such_function"),
                     (ctypes.util.find_library("c"), "labs")]:
    try:
        load_crc32c(path, symbol)
    except OSError as exc:
        print("refused:", exc)
load_crc32c({crc32c._crc32c.__file__!r}, "_crc32c_sw_slicing_by_8")
print("bound")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("refused: ") and out[0].endswith("has no no_such_function")
    assert out[1].startswith("refused: ") and out[1].endswith("labs of libc.so.6 is not "
                                                               "CRC-32C")
    assert out[2] == "bound"


@needs_compiled
@pytest.mark.parametrize("swapped", [False, True], ids=["own", "swapped"])
def test_a_block_is_taken_unwalked_only_as_the_answer_for_the_block_it_was_opened_from(
        swapped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a judged ``on_consume_blocks`` call, a block ``open_blocks`` opened is its
    block's records by construction and is not walked again; answered for another block
    (whose records lie at other timestamps) it is walked, and refused as moved."""
    import asyncio

    from kiproxy.interceptors import consume_verdict
    from kiproxy.interceptors.consume import ConsumeContext, ConsumedBlock

    plains = [_plain(4, 1), tuple(Record(key=r.key, value=r.value, timestamp=r.timestamp + 9,
                                         headers=list(r.headers), offset_delta=r.offset_delta)
                                  for r in _plain(4, 2))]
    blocks = [ConsumedBlock(topic="t", partition=0, base_offset=i * 4, base_timestamp=BASE,
                            record_count=4, data=memoryview(_sealed(p)))
              for i, p in enumerate(plains)]

    class Opener:
        def on_consume_blocks(self, given: list[ConsumedBlock], ctx: Any) -> list[Any]:
            opened = parallel.open_blocks([b.data for b in given], [4, 4], MARKER,
                                          DESCRIPTOR, GCM, AAD, 12)
            return opened[::-1] if swapped else opened

    walked: list[int] = []
    real = consume_verdict.block_moved

    def counting(data: Any, original: Any, count: int) -> int:
        walked.append(count)
        return int(real(data, original, count))

    monkeypatch.setattr(consume_verdict, "block_moved", counting)
    ctx = ConsumeContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                         api_version=12, deadline=float("inf"))
    answers = asyncio.run(consume_verdict.judge_consume_blocks(
        Opener(), blocks, ctx, name="opener", timeout=None))
    assert not isinstance(answers, consume_verdict.ConsumeRefusal)
    if swapped:
        assert walked == [4, 4]
        assert all(isinstance(a, consume_verdict.ConsumeRefusal)
                   and a.reason == "shape_changed" for a in answers)
    else:
        assert walked == []
        assert answers == [encode_records(p, BASE, False)[0] for p in plains]


@needs_compiled
def test_noting_opened_names_each_opened_block_with_its_source_and_lets_go_after() -> None:
    """Within ``noting_opened``, each block ``open_blocks`` opens is noted with the
    block it came from and its record count (not a block it could not open); the notes
    are let go when the block ends, even where a task kept the context."""
    plains = [_plain(3, 1), _plain(5, 2)]
    blocks: list[bytes | memoryview] = [memoryview(_sealed(p)) for p in plains]
    blocks.append(_tampered(bytes(blocks[1])))
    with parallel.noting_opened() as noted:
        opened = parallel.open_blocks(blocks, [3, 5, 5], MARKER, DESCRIPTOR, GCM, AAD, 12)
        assert opened[2] is None
        assert sorted(noted) == sorted(id(o) for o in opened[:2])
        for new, block, count in zip(opened[:2], blocks[:2], [3, 5], strict=True):
            assert noted[id(new)] == (new, block, count)
            assert noted[id(new)][1] is block
    assert noted == {}
    parallel.open_blocks(blocks[:1], [3], MARKER, DESCRIPTOR, GCM, AAD, 12)
    assert noted == {}  # nothing is noted outside it


@needs_compiled
def test_a_block_opened_as_fewer_records_than_its_batch_says_is_walked_and_refused() -> None:
    """A batch whose header counts 5 records over a block of 4: a hook that opens the
    block as the 4 it holds gets a block of 4, which is not the batch's records."""
    import asyncio

    from kiproxy.interceptors import consume_verdict
    from kiproxy.interceptors.consume import ConsumeContext, ConsumedBlock

    block = ConsumedBlock(topic="t", partition=0, base_offset=0, base_timestamp=BASE,
                          record_count=5, data=memoryview(_sealed(_plain(4, 1))))

    class Opener:
        def on_consume_blocks(self, given: list[ConsumedBlock], ctx: Any) -> list[Any]:
            return parallel.open_blocks([b.data for b in given], [4], MARKER, DESCRIPTOR,
                                        GCM, AAD, 12)

    ctx = ConsumeContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                         api_version=12, deadline=float("inf"))
    answers = asyncio.run(consume_verdict.judge_consume_blocks(
        Opener(), [block], ctx, name="opener", timeout=None))
    assert not isinstance(answers, consume_verdict.ConsumeRefusal)
    (answer,) = answers
    assert isinstance(answer, consume_verdict.ConsumeRefusal)
    assert answer.reason == "bad_return"
