"""Rewriting a Produce request's partitions by splicing bytes, never by re-serializing.

Contract: :func:`splice_produce_request` returns the frame with some partitions
edited, each edit keyed by its ``(topic position, partition position)`` in the
request: new ``records`` bytes replace the old ones (with a new length prefix),
``None`` removes the partition. A topic whose partitions were all removed is
removed; array lengths that changed are rewritten. Every other byte - request
header, transactional id, acks, timeout, topic names or ids, untouched partitions,
tagged fields - is copied as it came. Where the entries lie comes from
:func:`~kiproxy.protocol.produce_request.read_produce_request` (the pipeline passes
the layout it read the request with).

For a request kio writes back byte for byte (canonical varints, no unknown tagged
fields), the result equals re-serializing the edited kio message
(``tests/protocol/test_produce_splice.py`` checks it on random requests). Edits in a
dict of bytes or None are spliced by compiled code (``protocol/_produce.pxi``) into
the same bytes; other edits by the Python here.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from kiproxy.protocol._codec import splice_produce
from kiproxy.protocol.produce_request import (
    FIRST_FLEXIBLE_VERSION,
    ProduceLayout,
    read_produce_request,
)
from kiproxy.protocol.wire import uvarint

__all__ = ["splice_produce_request"]

_INT32 = struct.Struct(">i")


def _array_length(n: int, flexible: bool) -> bytes:
    return uvarint(n + 1) if flexible else _INT32.pack(n)


def splice_produce_request(
    frame: bytes,
    body_offset: int,
    version: int,
    edits: Mapping[tuple[int, int], bytes | None],
    layout: ProduceLayout | None = None,
) -> bytes:
    """``frame`` with the partitions named in ``edits`` replaced or removed.

    ``edits`` maps ``(topic position, partition position)`` to the partition's new
    ``records`` bytes, or to ``None`` to remove the partition (see the module contract).
    ``layout`` is the frame's :func:`~kiproxy.protocol.produce_request.read_produce_request`,
    read here when not given.
    """
    if layout is None:
        layout = read_produce_request(frame, body_offset, version)
    flexible = version >= FIRST_FLEXIBLE_VERSION
    # Edits in a dict of bytes (the pipeline's) are spliced by compiled code into the
    # same bytes; anything else is spliced here.
    spliced = splice_produce(frame, flexible, edits, layout)
    if spliced is not None:
        return spliced
    return _splice_general(frame, flexible, edits, layout)


def _splice_general(frame: bytes, flexible: bool,
                    edits: Mapping[tuple[int, int], bytes | None],
                    layout: ProduceLayout) -> bytes:
    """splice_produce_request in Python, for any edits."""
    view = memoryview(frame)
    topics_left = len(layout.topics)
    count_end = layout.topics[0].start if layout.topics else layout.end
    # Header, transactional id, acks, timeout; then the topic count, set at the end.
    pieces: list[bytes | memoryview] = [view[:layout.count_at], b""]
    copied = count_end  # frame[copied:] is neither emitted nor skipped yet
    for ti, topic in enumerate(layout.topics):
        touched = [(pj, edits[ti, pj]) for pj in range(len(topic.partitions))
                   if (ti, pj) in edits]
        if not touched:
            continue  # copied with whatever follows, in one piece
        kept = len(topic.partitions) - sum(1 for _, new in touched if new is None)
        if kept == 0:
            pieces.append(view[copied:topic.start])
            copied = topic.end
            topics_left -= 1
            continue
        first = topic.partitions[0].start if topic.partitions else topic.end
        if kept != len(topic.partitions):
            pieces.append(view[copied:topic.count_at])
            pieces.append(_array_length(kept, flexible))
            copied = first
        for pj, new in touched:
            part = topic.partitions[pj]
            pieces.append(view[copied:part.start if new is None else part.records_at])
            if new is None:
                copied = part.end
                continue
            pieces.append(uvarint(len(new) + 1) if flexible else _INT32.pack(len(new)))
            pieces.append(new)
            copied = part.data_end
    pieces.append(view[copied:])
    if topics_left != len(layout.topics):
        pieces[1] = _array_length(topics_left, flexible)
    else:
        pieces[1] = view[layout.count_at:count_end]
    return b"".join(pieces)
