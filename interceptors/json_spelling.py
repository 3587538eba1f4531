"""Records as JSON: how bytes are spelled, written once for every JSON record contract.

Contract: a spelling (:data:`Spelling`) says how a key, value or header value travels in
JSON: ``text`` (UTF-8 text; the writer needs valid UTF-8), ``base64``, or ``tagged``
(text when it is UTF-8, else ``{"b64": "..."}``); JSON null is a null field in every
spelling. :func:`spell_bytes` gives the writer of a spelling, :func:`read_bytes` reads a
value back (raising the caller's error type with a message naming ``where``), and
:func:`json_bytes` writes a document as compact JSON. The WebAssembly host's two ABIs
and ``kiproxy check``'s sample lines use these; nothing else spells bytes in JSON.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = ["SPELLINGS", "Spelling", "json_bytes", "read_bytes", "spell_bytes"]

Spelling = Literal["text", "base64", "tagged"]
SPELLINGS: tuple[Spelling, ...] = ("text", "base64", "tagged")
json_bytes: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=False,
                                                   separators=(",", ":")).encode
"""A document as compact JSON text, non-ASCII written as is (``.encode()`` it for UTF-8)."""


def _text(data: bytes | None) -> Any:
    return None if data is None else data.decode()


def _base64(data: bytes | None) -> Any:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _tagged(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(data).decode()}


_SPELL: dict[str, Callable[[bytes | None], Any]] = {
    "text": _text, "base64": _base64, "tagged": _tagged}


def spell_bytes(spelling: Spelling) -> Callable[[bytes | None], Any]:
    """The function writing bytes (or None, JSON null) as ``spelling`` says; ``text``
    needs valid UTF-8 (the adapter checks first)."""
    return _SPELL[spelling]


def read_bytes(value: Any, spelling: Spelling, where: str,
               error: type[Exception]) -> bytes | None:
    """Bytes spelled as ``spelling`` (JSON null is None); ``error(message)`` when not."""
    if value is None:
        return None
    if spelling == "tagged":
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, Mapping) and set(value) == {"b64"} and isinstance(value["b64"],
                                                                              str):
            try:
                return base64.b64decode(value["b64"], validate=True)
            except ValueError as exc:
                raise error(f"{where} is not valid base64: {exc}") from None
        raise error(f"{where} must be null, a string or {{\"b64\": \"...\"}}, "
                    f"not {type(value).__name__}")
    if not isinstance(value, str):
        raise error(f"{where} must be a string or null, not {type(value).__name__}")
    if spelling == "base64":
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as exc:  # binascii.Error, and a ValueError for non-ASCII text
            raise error(f"{where} is not base64 ({exc})") from None
    return value.encode()
