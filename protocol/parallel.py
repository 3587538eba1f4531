"""A fetched partition's batches worked on at once, spread over threads without the GIL.

Contract. :func:`verify_crcs` checks the CRC-32C of many uncompressed batches of an
answer, :func:`blocks_around` writes many batches around new records blocks (as
:func:`~kiproxy.protocol.records.encode_block_parts` writes one), and
:func:`open_blocks` opens many sealed records blocks (as
:func:`~kiproxy.protocol.records.open_block` opens one). Each gives the answers the
one-batch function gives, batch by batch; the work runs on the calling thread and up
to :data:`THREADS` - 1 threads started for the call and joined before it returns.

Within :func:`noting_opened`, each block :func:`open_blocks` opens is noted with the
block it was opened from: it holds that block's records, each written from its
record's own bytes (attributes, timestamp and offset deltas, key and the headers kept
copied as they lie), so whoever judges a hook's answer need not walk it again to learn
that it is those records.

Why threads: a consumer waits for its whole Fetch answer, so the CRCs and cipher calls
of its batches are time on its critical path; spread over the cores, the answer is
ready sooner (a 64 KiB batch's CRC is a few microseconds, its values' AES-GCM some tens).
The CRCs are the ``crc32c`` package's own compiled function, bound once here and checked
against its Python function; where it cannot be bound they are computed one after the
other through that Python function.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import crc32c
import crc32c._crc32c

from kiproxy.protocol._codec import blocks_around as _blocks_around
from kiproxy.protocol._codec import load_crc32c
from kiproxy.protocol._codec import open_blocks as _open_blocks
from kiproxy.protocol._codec import verify_crcs as _verify_crcs
from kiproxy.protocol.compression import Compression, compression_from_attributes
from kiproxy.protocol.records import RecordBatchHeader

__all__ = ["THREADS", "blocks_around", "noting_opened", "open_blocks", "verify_crcs"]

log = logging.getLogger("kiproxy.protocol")

THREADS = max(1, min((len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1)) // 2, 4))
"""Threads one call uses at most: half the CPUs this process may run on, up to 4 - so
none beside the calling thread on a machine of two, whose other CPU is the broker's,
the consumer's or another worker's (measured there: no faster answer, 0.2 CPU s more
per GB of decrypted values); and no more than a partition's answer repays."""


def _bind() -> None:
    symbol = "_crc32c_hw_adler" if crc32c.hardware_based else "_crc32c_sw_slicing_by_8"
    try:
        load_crc32c(crc32c._crc32c.__file__, symbol)
    except OSError as exc:  # a crc32c release that renamed it: the same CRCs, in turn
        log.debug("CRC-32C of whole answers computed in turn: %s", exc)


_bind()


def verify_crcs(frame: bytes, batches: list[tuple[int, int]]) -> int:
    """The index of the first batch ``frame[start:end]`` of ``batches`` whose CRC is not
    the one its header holds, or -1."""
    return int(_verify_crcs(frame, [s for s, _ in batches], [e for _, e in batches],
                            THREADS))


def blocks_around(headers: list[RecordBatchHeader], blocks: list[bytes]
                  ) -> list[tuple[bytes, bytes, bytes] | None]:
    """Each batch of ``headers`` around its new uncompressed records block, as
    :func:`~kiproxy.protocol.records.encode_block_parts` writes it; None for a header
    whose batch is compressed or whose fields it writes in Python."""
    plain = [compression_from_attributes(h.attributes) is Compression.NONE for h in headers]
    out: list[tuple[bytes, bytes, bytes] | None] = [None] * len(headers)
    chosen = [i for i, p in enumerate(plain) if p]
    made = _blocks_around([headers[i] for i in chosen], [blocks[i] for i in chosen],
                          THREADS)
    for i, pieces in zip(chosen, made, strict=True):
        out[i] = pieces
    return out


def open_blocks(blocks: list[memoryview | bytes], counts: list[int], marker_key: str,
                descriptor: bytes, decrypt: object, aad: bytes, nonce_bytes: int
                ) -> list[bytes | None]:
    """:func:`~kiproxy.protocol.records.open_block` of each block (``counts[i]``
    records), all sealed under one ``descriptor``: each opened block, or None where
    that block must be read record by record (another shape, a value that does not
    open, a malformed block, or a cipher other than an ``AesGcm``)."""
    opened: list[bytes | None] = _open_blocks(blocks, counts, marker_key, descriptor,
                                              decrypt, aad, nonce_bytes, THREADS)
    noted = _OPENED.get()
    if noted is not None:
        for block, count, new in zip(blocks, counts, opened, strict=True):
            if new is not None:
                noted[id(new)] = (new, block, count)
    return opened


Opened = dict[int, tuple[bytes, "memoryview | bytes", int]]
"""``id(opened block) -> (opened block, the block it was opened from, its records)``."""

_OPENED: ContextVar[Opened | None] = ContextVar("kiproxy_opened_blocks", default=None)


@contextmanager
def noting_opened() -> Iterator[Opened]:
    """The blocks :func:`open_blocks` opens while in it (in this context, and in the
    tasks started from it, which copy it), with the block each came from and the
    number of records it was opened as (see the module docstring). They are let go
    when the ``with`` block ends, even by a task that outlives it."""
    noted: Opened = {}
    token = _OPENED.set(noted)
    try:
        yield noted
    finally:
        _OPENED.reset(token)
        noted.clear()
