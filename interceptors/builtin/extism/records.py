"""The record contract of Extism interceptor plugins: one record as JSON, in and out.

A record is written as one compact JSON object, members in this order::

    {"key": "k1", "topic": "orders", "value": "hello", "headers": [{"key": "h", "value": "v"}]}

``key`` and ``value`` are strings or ``null`` (a null key or value); headers keep
their order and their duplicates; a header value may be ``null``. The batch
export takes and returns a JSON array of such objects.

Bytes that are not valid UTF-8 (the rule, chosen by ``binary``):

* ``refuse`` (the default): a batch with a key, value or header value that is
  not valid UTF-8 is rejected (INVALID_RECORD, a record error per such record)
  before the plugin is called; nothing is altered.
* ``base64``: every key, value and header value is written as standard base64
  of its bytes, and the plugin's answer is read the same way; nothing is
  refused.

What a plugin returns (:func:`decode_records`): one record object per record
(for the batch export, an array of them). A call that returns an array gives as
many records as the array holds, so the record-count rule (checked by the
verdict) sees a plugin that returns two records for one. ``value`` must be there:
an answer without it is refused (INVALID_RECORD, naming the record), because storing
a null value - on a compacted topic, a deletion - takes ``"value": null`` written on
purpose. A missing ``key`` is null and a missing ``headers`` is none; ``topic``, when present and
not null, must be the batch's topic - a plugin cannot move a record to another
topic (the proxy rejects the batch saying so). Timestamps and offsets are the
original records': the plugin does not see or set them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kiproxy.interceptors.api import Header, Record
from kiproxy.interceptors.builtin.sandbox import Spelling, json_bytes, read_bytes, spell_bytes

__all__ = ["BINARY_RULES", "Binary", "ContractError", "decode_records", "encode_record",
           "non_utf8_fields"]

Binary = Literal["refuse", "base64"]
BINARY_RULES: tuple[Binary, ...] = ("refuse", "base64")
_SPELLING: dict[Binary, Spelling] = {"refuse": "text", "base64": "base64"}
"""How each rule spells bytes (the host's spellings): UTF-8 text, or base64."""


class ContractError(ValueError):
    """A plugin's answer does not follow the record contract (the message says how)."""


def non_utf8_fields(record: Record) -> list[str]:
    """The fields of ``record`` that are not valid UTF-8 (``key``, ``value``, ``header h``)."""
    bad = []
    for name, data in (("key", record.key), ("value", record.value)):
        if data is not None:
            try:
                data.decode()
            except UnicodeDecodeError:
                bad.append(name)
    for header in record.headers:
        if header.value is not None:
            try:
                header.value.decode()
            except UnicodeDecodeError:
                bad.append(f"header {header.key!r}")
    return bad


def _object(record: Record, topic: str, text: Callable[[bytes | None], Any]) -> dict[str, Any]:
    return {"key": text(record.key), "topic": topic, "value": text(record.value),
            "headers": [{"key": h.key, "value": text(h.value)} for h in record.headers]}


def record_object(record: Record, topic: str, binary: Binary) -> dict[str, Any]:
    """``record`` as the contract's JSON object (a Python dict)."""
    return _object(record, topic, spell_bytes(_SPELLING[binary]))


def encode_record(record: Record, topic: str, binary: Binary) -> bytes:
    """One record as the contract's UTF-8 JSON (``refuse`` needs valid UTF-8: checked first)."""
    return json_bytes(record_object(record, topic, binary)).encode()


def encode_records(records: Sequence[Record], topic: str, binary: Binary) -> bytes:
    """A JSON array of records (the batch export's input)."""
    text = spell_bytes(_SPELLING[binary])
    return json_bytes([_object(r, topic, text) for r in records]).encode()


def _bytes(value: Any, where: str, binary: Binary) -> bytes | None:
    return read_bytes(value, _SPELLING[binary], where, ContractError)


def _record(obj: Any, original: Record, topic: str, binary: Binary, where: str) -> Record:
    if not isinstance(obj, dict):
        raise ContractError(f"{where} must be a JSON object, not {type(obj).__name__}")
    if "value" not in obj:
        raise ContractError(f'{where} has no "value" (write "value": null to store a '
                            "null value on purpose)")
    out_topic = obj.get("topic")
    if out_topic is not None and out_topic != topic:
        raise ContractError(f"{where} names topic {out_topic!r}, but the batch is for "
                            f"{topic!r}: a plugin cannot move records to another topic")
    headers = obj.get("headers") or []
    if not isinstance(headers, list):
        raise ContractError(f"{where}: headers must be an array of {{\"key\", \"value\"}}")
    parsed = []
    for i, h in enumerate(headers):
        if not isinstance(h, dict) or not isinstance(h.get("key"), str):
            raise ContractError(f"{where}: headers[{i}] must be {{\"key\": string, "
                                "\"value\": string or null}")
        parsed.append(Header(h["key"], _bytes(h.get("value"), f"{where}: headers[{i}].value",
                                              binary)))
    return Record(key=_bytes(obj.get("key"), f"{where}: key", binary),
                  value=_bytes(obj.get("value"), f"{where}: value", binary),
                  headers=parsed, timestamp=original.timestamp,
                  offset_delta=original.offset_delta)


def decode_records(output: bytes, originals: Sequence[Record], topic: str,
                   binary: Binary, where: str, first: int = 0) -> list[Record]:
    """The records a call returned for ``originals`` (one object, or an array of them).

    ``first`` is the index of ``originals[0]`` in its batch (messages name records by
    it). Returned records past the originals take the last original's timestamp; the
    verdict then rejects the batch for breaking the record-count rule.
    """
    try:
        doc = json.loads(output)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ContractError(f"{where} returned something that is not JSON ({exc})") from None
    items = doc if isinstance(doc, list) else [doc]
    return [_record(obj, originals[min(i, len(originals) - 1)], topic, binary,
                    f"{where}: its answer for record {first + i}")
            for i, obj in enumerate(items)]
