"""``RecordCipher``: a topic-partition's records sealed and opened, with the data keys
a :class:`~.data_keys.DataKeyCache` holds - what the produce and fetch hooks will call.

Contract. :meth:`RecordCipher.encrypt` seals every record of a batch that has a field
to seal (a non-null value, or a non-null value of a chosen header) under the topic's
current data key, reserving one encryption per sealed field; a record with nothing to
seal (a tombstone without chosen headers) is returned as it is, and so stays a
tombstone. A record that already carries the marker header is refused. A batch needing
more encryptions than a data key has left is split across keys; so no data key ever
seals more than ``max_encryptions_per_key`` fields.

:meth:`RecordCipher.decrypt` returns plaintext records (no marker header) unchanged and
opens the others, unwrapping each distinct data key once (cached; a batch's keys
concurrently). :meth:`RecordCipher.decrypt_block` opens the common batch as its records
block, or says to read it record by record; :meth:`RecordCipher.decrypt_blocks` does
so for a fetched partition's batches at once. Record count and
order, keys, timestamps and offset deltas never change.

Errors: :class:`~.kms.KmsError` (its ``retriable`` says whether to try later) and
:class:`~.envelope.EnvelopeError` (a record that does not open, or may not be sealed),
whose message names the topic and the record's offset delta in its batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence

from kiproxy.interceptors import Record
from kiproxy.interceptors.sealing import (
    Aead,
    CorruptBatch,
    block_carries_header,
    block_header_value,
    carries_header,
    values_present,
)

from .data_keys import DataKeyCache
from .envelope import (
    MARKER_HEADER,
    Descriptor,
    EnvelopeError,
    descriptor_of,
    open_record,
    open_value,
    open_values_block,
    open_values_blocks,
    open_values_fast,
    opens_by_value,
    read_descriptor,
    seal_record,
    sealed_fields,
    value_aad,
    value_sealer,
)
from .kms import KmsError

__all__ = ["RecordCipher"]


class RecordCipher:
    """Seals and opens records with the data keys of ``keys`` (see the module docstring)."""

    def __init__(self, keys: DataKeyCache) -> None:
        self.keys = keys

    async def encrypt(self, topic: str, records: Sequence[Record], *, key_reference: str,
                      header_names: Collection[str] = (), deadline: float | None = None
                      ) -> tuple[Record, ...]:
        """``records`` sealed under the current data key of ``topic`` and KEK
        ``key_reference``, the values and the headers named in ``header_names``; a KMS
        call is waited for until ``deadline`` (:mod:`~.data_keys`)."""
        limit = self.keys.policy.max_encryptions_per_key
        if not header_names and not carries_header(records, MARKER_HEADER):
            # values only (the common case): no per-record loop here
            needed = values_present(records)
            if needed <= limit:
                if not needed:
                    return tuple(records)
                key = await self.keys.encryption_key(topic, key_reference, needed,
                                                     deadline=deadline)
                return value_sealer(topic=topic, aead=key.aead, key_id=key.key_id,
                                    wrapped_key=key.wrapped)(records)
        uses = []
        for record in records:
            if any(h.key == MARKER_HEADER for h in record.headers):
                raise EnvelopeError(
                    f"topic {topic!r}, record at offset delta {record.offset_delta}: it "
                    f"already carries the {MARKER_HEADER} header; it is not encrypted "
                    "again (remove the header, or produce the plaintext)")
            needed = sealed_fields(record, header_names)
            if needed > limit:
                raise EnvelopeError(
                    f"topic {topic!r}, record at offset delta {record.offset_delta}: "
                    f"{needed} fields to seal, more than data_keys.max_encryptions_per_key "
                    f"({limit}) allows one data key")
            uses.append(needed)
        out: list[Record] = []
        start = 0
        while start < len(records):
            end, total = start, 0
            while end < len(records) and total + uses[end] <= limit:
                total += uses[end]
                end += 1
            if total == 0:
                out += records[start:end]
            else:
                key = await self.keys.encryption_key(topic, key_reference, total,
                                                     deadline=deadline)
                if header_names:
                    out += (seal_record(r, topic=topic, aead=key.aead, key_id=key.key_id,
                                        wrapped_key=key.wrapped, header_names=header_names)
                            if n else r for r, n in zip(records[start:end], uses[start:end],
                                                        strict=True))
                else:  # values only: one descriptor and one compiled loop for the chunk
                    out += value_sealer(topic=topic, aead=key.aead, key_id=key.key_id,
                                        wrapped_key=key.wrapped)(records[start:end])
            start = end
        return tuple(out)

    async def decrypt(self, topic: str, records: Sequence[Record], *,
                      deadline: float | None = None) -> tuple[Record, ...]:
        """``records`` with every sealed one opened; plaintext ones as they are."""
        opened = await self._decrypt_one_key(topic, records, deadline)
        if opened is not None:
            return opened
        found: list[tuple[Descriptor, bytes] | None] = []
        for record in records:
            try:
                found.append(read_descriptor(record, topic=topic))
            except EnvelopeError as exc:
                raise _at(record, exc) from None
        # A descriptor is parsed once per distinct marker (cached), so records sealed
        # under one data key share one Descriptor object: key the per-batch work by it.
        distinct = {id(p[0]): p for p in found if p}
        slots = list(dict.fromkeys((d.key_id, d.wrapped_key) for d, _ in distinct.values()))
        unwrapped = await asyncio.gather(*(self.keys.decryption_key(*s, deadline=deadline)
                                           for s in slots))
        aeads: dict[tuple[str, bytes], Aead] = dict(zip(slots, unwrapped, strict=True))
        openers = {i: (aeads[d.key_id, d.wrapped_key], value_aad(topic, raw))
                   for i, (d, raw) in distinct.items()}
        out = []
        for record, parsed in zip(records, found, strict=True):
            if parsed is None:
                out.append(record)
                continue
            descriptor, raw = parsed
            aead, aad = openers[id(descriptor)]
            try:
                out.append(open_value(record, topic=topic, aad=aad, aead=aead)
                           if opens_by_value(record, descriptor) else
                           open_record(record, topic=topic, descriptor=descriptor,
                                       raw_descriptor=raw, aead=aead))
            except EnvelopeError as exc:
                raise _at(record, exc) from None
        return tuple(out)

    async def decrypt_block(self, topic: str, data: memoryview, count: int, *,
                            deadline: float | None = None) -> bytes | memoryview | None:
        """The records block ``data`` (``count`` records of ``topic``) opened as a new
        block when every record's value is sealed under one data key and no header is
        (the common batch); ``data`` itself when no record is sealed; None for any other
        block, which :meth:`decrypt` then reads record by record. Raises what
        :meth:`~.data_keys.DataKeyCache.decryption_key` raises."""
        raw = block_header_value(data, MARKER_HEADER)
        if raw is None:
            return None if block_carries_header(data, count, MARKER_HEADER) else data
        aead = await self._common_key(topic, raw, deadline)
        if aead is None:
            return None
        return open_values_block(data, count, raw_descriptor=raw, aad=value_aad(topic, raw),
                                 aead=aead)

    async def decrypt_blocks(self, topic: str, blocks: Sequence[tuple[memoryview, int]], *,
                             deadline: float | None = None
                             ) -> list[bytes | memoryview | KmsError | None]:
        """:meth:`decrypt_block` of each ``(data, count)`` of ``blocks`` (a fetched
        partition's batches), those sealed under one data key opened together, their
        cipher calls spread over threads (:func:`~kiproxy.protocol.parallel.open_blocks`);
        for a block whose data key cannot be had, the :class:`~.kms.KmsError` saying why
        (one KMS wait for all the blocks of that key), for the caller's policy. None, as
        :meth:`decrypt_block` says it, for any other block, a malformed one included
        (the caller's per-batch path then says what is wrong with it)."""
        out: list[bytes | memoryview | KmsError | None] = [None] * len(blocks)
        sealed: dict[bytes, list[int]] = {}
        for i, (data, count) in enumerate(blocks):
            try:
                raw = block_header_value(data, MARKER_HEADER)
                if raw is None and not block_carries_header(data, count, MARKER_HEADER):
                    out[i] = data  # nothing sealed
            except CorruptBatch:
                continue
            if raw is not None:
                sealed.setdefault(raw, []).append(i)
        for raw, which in sealed.items():
            try:
                aead = await self._common_key(topic, raw, deadline)
            except KmsError as exc:
                for i in which:
                    out[i] = exc
                continue
            if aead is None:
                continue
            opened = open_values_blocks([blocks[i] for i in which], raw_descriptor=raw,
                                        aad=value_aad(topic, raw), aead=aead)
            for i, block in zip(which, opened, strict=True):
                out[i] = block
        return out

    async def _common_key(self, topic: str, raw: bytes, deadline: float | None
                          ) -> Aead | None:
        """The data key of the marker ``raw`` when it describes the common batch's
        records (the value sealed, no header), else None. Raises what
        :meth:`~.data_keys.DataKeyCache.decryption_key` raises."""
        try:
            descriptor = descriptor_of(raw, topic=topic)
        except EnvelopeError:
            return None
        if not descriptor.value_sealed or descriptor.headers:
            return None
        return await self.keys.decryption_key(descriptor.key_id, descriptor.wrapped_key,
                                              deadline=deadline)

    async def _decrypt_one_key(self, topic: str, records: Sequence[Record],
                               deadline: float | None) -> tuple[Record, ...] | None:
        """The common batch - every record's value sealed under one data key, no header
        sealed - opened in one compiled loop; None for any other batch (or a record that
        does not open), which :meth:`decrypt` then reads record by record."""
        if not records:
            return None
        headers = records[0].headers
        if not headers or headers[-1].key != MARKER_HEADER or headers[-1].value is None:
            return None
        raw = headers[-1].value
        try:
            parsed = read_descriptor(records[0], topic=topic)
        except EnvelopeError:
            return None
        if parsed is None or not opens_by_value(records[0], parsed[0]):
            return None
        descriptor = parsed[0]
        aead = await self.keys.decryption_key(descriptor.key_id, descriptor.wrapped_key,
                                              deadline=deadline)
        return open_values_fast(records, raw_descriptor=raw, aad=value_aad(topic, raw),
                                aead=aead)


def _at(record: Record, exc: EnvelopeError) -> EnvelopeError:
    return EnvelopeError(f"record at offset delta {record.offset_delta}: {exc}")
