"""Replacing some partitions' records in a Fetch response by splicing bytes.

Contract: :func:`splice_fetch_response` returns the response with the ``records``
field of the partitions named in ``replacements`` (keyed by their ``(topic position,
partition position)`` in the response) replaced by new bytes, and nothing else
changed: every other byte - response header, throttle time, error code, session id,
topic names or ids, partition fields, aborted transactions, preferred read replica,
tagged fields (``diverging_epoch``, ``current_leader``, ``snapshot_id``,
``node_endpoints``), untouched partitions - is copied as it came. Only the replaced
fields' length prefixes are written anew (int32 before v12, the compact length varint
from v12, which may grow or shrink by bytes), and the frame's size prefix when the
frame carries one. No replacement returns the frame itself, not a copy. Where the
fields lie comes from :func:`~kiproxy.protocol.fetch_response.read_fetch_response`
(a caller that read the layout passes it). :func:`splice_fetch_pieces` gives the same
bytes as pieces in order (views of the frame and the replacements), for a writer that
sends them without joining them: a joined answer of 10 MB is 10 MB copied once more.

The replacement bytes are taken as given: what keeps a consumer's offsets right
(whole batches, the same base offsets and offset deltas, which
:func:`~kiproxy.protocol.batch_reencode.reencode_batch` guarantees for a re-encoded
batch) is the caller's part.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.fetch_response import (
    FIRST_FLEXIBLE_VERSION,
    FetchLayout,
    read_fetch_response,
)
from kiproxy.protocol.wire import uvarint

__all__ = ["splice_fetch_pieces", "splice_fetch_response"]

_INT32 = struct.Struct(">i")
_INT16 = struct.Struct(">h")


def splice_fetch_response(
    frame: bytes | bytearray,
    body_offset: int,
    version: int,
    replacements: Mapping[tuple[int, int], bytes | Sequence[bytes | memoryview]],
    layout: FetchLayout | None = None,
    *,
    size_prefix: bool = False,
    error_codes: Mapping[tuple[int, int], int] | None = None,
) -> bytes | bytearray:
    """``frame`` with the records of the partitions in ``replacements`` replaced: the
    pieces of :func:`splice_fetch_pieces` joined, or ``frame`` itself when nothing is."""
    pieces = splice_fetch_pieces(frame, body_offset, version, replacements, layout,
                                 size_prefix=size_prefix, error_codes=error_codes)
    return pieces if isinstance(pieces, (bytes, bytearray)) else b"".join(pieces)


def splice_fetch_pieces(
    frame: bytes | bytearray,
    body_offset: int,
    version: int,
    replacements: Mapping[tuple[int, int], bytes | Sequence[bytes | memoryview]],
    layout: FetchLayout | None = None,
    *,
    size_prefix: bool = False,
    error_codes: Mapping[tuple[int, int], int] | None = None,
) -> bytes | bytearray | list[bytes | memoryview]:
    """``frame`` with the records of the partitions in ``replacements`` replaced, as the
    pieces whose concatenation it is (``frame`` itself when nothing is replaced).

    ``replacements`` maps ``(topic position, partition position)`` to the partition's
    new ``records`` bytes (see the module contract), or to a list of pieces whose
    concatenation they are.
    ``layout`` is the frame's
    :func:`~kiproxy.protocol.fetch_response.read_fetch_response`, read here when not
    given. ``size_prefix`` says that ``frame`` starts with its int32 size (positions,
    ``body_offset`` included, then count from the size's first byte); the size is
    rewritten. A key naming no partition raises :class:`KeyError`.
    """
    errors = error_codes or {}
    if errors:
        replacements = {**dict.fromkeys(errors, b""), **replacements}
    if not replacements:
        return frame
    if size_prefix and (len(frame) < 4 or _INT32.unpack_from(frame, 0)[0] != len(frame) - 4):
        raise MalformedMessage(f"Fetch response v{version}: the size prefix does not "
                               f"match the {len(frame) - 4} bytes that follow it")
    if layout is None:
        layout = read_fetch_response(frame, body_offset, version)
    flexible = version >= FIRST_FLEXIBLE_VERSION
    edits = []
    for (ti, pj), new in replacements.items():
        if not (0 <= ti < len(layout.topics) and 0 <= pj < len(layout.topics[ti].partitions)):
            raise KeyError(f"no partition at position {(ti, pj)} in this Fetch response "
                           f"({len(layout.topics)} topics)")
        edits.append((layout.topics[ti].partitions[pj], new, errors.get((ti, pj))))
    edits.sort(key=lambda edit: edit[0].start)
    view = memoryview(frame)
    pieces: list[bytes | memoryview] = [b""] if size_prefix else []  # [0]: the new size
    copied = 4 if size_prefix else 0  # frame[copied:] is neither emitted nor skipped yet
    grown = 0
    for part, new, code in edits:
        if code is not None:  # after the partition index: the int16 error code
            pieces.append(view[copied:part.start + 4])
            pieces.append(_INT16.pack(code))
            copied = part.start + 6
        pieces.append(view[copied:part.records_at])
        if isinstance(new, (bytes, bytearray, memoryview)):
            size, new = len(new), (new,)
        else:
            size = sum(len(piece) for piece in new)
        prefix = uvarint(size + 1) if flexible else _INT32.pack(size)
        pieces.append(prefix)
        pieces.extend(new)
        copied = part.data_end
        grown += len(prefix) + size - (part.data_end - part.records_at)
    pieces.append(view[copied:])
    if size_prefix:
        pieces[0] = _INT32.pack(len(frame) - 4 + grown)
    return pieces
