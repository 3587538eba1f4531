"""What a Wasm module says about itself, and how the host calls it: declaration plus config.

A module declares its entry function, ABI version and encoding in a custom
section named ``kiproxy.interceptor`` holding a UTF-8 JSON object::

    {"function": "transform", "abi": 1, "encoding": "binary",
     "functions": {"transform_batch": {"abi": 2}}}

``function``/``abi``/``encoding`` describe the default entry (defaults
``transform``, 1, ``json``); ``functions`` lists further entries, each
inheriting the top-level ``abi`` and ``encoding`` unless it sets its own. In
WebAssembly text it is one line, ``(@custom "kiproxy.interceptor" "{...}")``;
in Rust a ``#[link_section = "kiproxy.interceptor"]`` static.

:func:`read_declaration` finds and checks it (pure: it parses the module's
bytes, no wasmtime); :func:`bind` combines it with the config's ``function``,
``abi`` and ``encoding`` keys, which override it, and keeps a note of every
disagreement so that start-up logs and rejection messages can say that the
host and the module disagree. A module that declares nothing is called with
the host's defaults (``transform``, ABI 1, JSON), as before declarations
existed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kiproxy.interceptors.config_keys import check_keys

__all__ = [
    "ABIS",
    "ENCODINGS",
    "SECTION",
    "Binding",
    "Declaration",
    "Entry",
    "bind",
    "custom_sections",
    "read_declaration",
]

SECTION = "kiproxy.interceptor"
"""The name of the custom section that holds a module's declaration."""
ABIS = (1, 2)
"""ABI versions this host runs: 1 (one record per call) and 2 (the whole batch)."""
ENCODINGS = ("json", "binary")
"""Encodings of the bytes the host writes for a call."""
_DEFAULT_FUNCTION = "transform"
_KEYS = {"function", "abi", "encoding", "functions"}
_MAGIC = b"\0asm"


@dataclass(frozen=True, slots=True)
class Entry:
    """One function a module declares, with its ABI version and encoding."""

    abi: int
    encoding: str


@dataclass(frozen=True, slots=True)
class Declaration:
    """A module's ``kiproxy.interceptor`` section: its default entry and every entry."""

    function: str
    """The default entry function."""
    entries: Mapping[str, Entry]
    """Every declared function (the default one included)."""

    @property
    def default(self) -> Entry:
        """The default entry's ABI and encoding."""
        return self.entries[self.function]

    def describe(self) -> str:
        """``transform (abi v1, binary), transform_batch (abi v2, binary)``."""
        return ", ".join(f"{name} (abi v{e.abi}, {e.encoding})"
                         for name, e in self.entries.items())


def _leb128(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 28:
            raise ValueError("truncated or oversized LEB128 number")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def custom_sections(wasm: bytes) -> Iterator[tuple[str, bytes]]:
    """``(name, payload)`` of each custom section of a binary module, in order."""
    if wasm[:4] != _MAGIC:
        raise ValueError("not a binary WebAssembly module (no \\0asm magic bytes)")
    pos = 8
    while pos < len(wasm):
        section_id = wasm[pos]
        size, pos = _leb128(wasm, pos + 1)
        end = pos + size
        if end > len(wasm):
            raise ValueError(f"section {section_id} runs past the end of the module")
        if section_id == 0:
            length, start = _leb128(wasm, pos)
            if start + length > end:
                raise ValueError("custom section name runs past its section")
            yield wasm[start:start + length].decode("utf-8", "replace"), wasm[start + length:end]
        pos = end


def _abi(value: Any, where: str) -> int:
    if isinstance(value, bool) or value not in ABIS:
        raise ValueError(
            f"{where} declares abi {json.dumps(value)}, which this kiproxy does not know: it "
            "runs abi 1 (one record per call) and 2 (the whole batch); rebuild the module "
            "for one of them or upgrade kiproxy")
    return int(value)


def _encoding(value: Any, where: str) -> str:
    if value not in ENCODINGS:
        raise ValueError(f"{where} declares encoding {json.dumps(value)}; "
                         "known: json, binary")
    return str(value)


def _parse(payload: bytes, where: str) -> Declaration:
    try:
        doc = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{where} is not a UTF-8 JSON object: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where} must be a JSON object, not {json.dumps(doc)}")
    check_keys(doc, _KEYS, f"{where} has ")
    function = doc.get("function", _DEFAULT_FUNCTION)
    if not isinstance(function, str) or not function:
        raise ValueError(f"{where}: function must be the name of an exported function")
    default = Entry(abi=_abi(doc.get("abi", 1), f"{where} (function {function!r})"),
                    encoding=_encoding(doc.get("encoding", "json"), where))
    entries = {function: default}
    functions = doc.get("functions", {})
    if not isinstance(functions, dict):
        raise ValueError(f"{where}: functions must map function names to {{\"abi\": ..., "
                         "\"encoding\": ...}}")
    for name, spec in functions.items():
        at = f"{where} (function {name!r})"
        if not isinstance(spec, dict) or set(spec) - {"abi", "encoding"}:
            raise ValueError(f"{at} must be an object with abi and/or encoding")
        entries[name] = Entry(abi=_abi(spec.get("abi", default.abi), at),
                              encoding=_encoding(spec.get("encoding", default.encoding), at))
    return Declaration(function=function, entries=entries)


def read_declaration(wasm: bytes, module: str) -> Declaration | None:
    """The declaration in binary module ``wasm`` (read from file ``module``), or None.

    Raises ValueError naming the file and the section when the declaration is
    malformed or declares an ABI or encoding this host does not know.
    """
    where = f"wasm module {module}: custom section {SECTION!r}"
    found = [payload for name, payload in custom_sections(wasm) if name == SECTION]
    if len(found) > 1:
        raise ValueError(f"{where} appears {len(found)} times; declare once")
    return _parse(found[0], where) if found else None


@dataclass(frozen=True, slots=True)
class Binding:
    """How the host calls a module: the function, its ABI and encoding, and why."""

    function: str
    abi: int
    encoding: str
    overrides: tuple[str, ...] = ()
    """Where the config contradicts the module's declaration (logged at start)."""
    defaulted: tuple[str, ...] = ()
    """Settings neither the module nor the config gave (``abi``, ``encoding``): host defaults."""

    @property
    def hint(self) -> str:
        """What to suspect when a call traps or returns something unreadable ("" if nothing)."""
        if self.overrides:
            return ("The host and the module disagree: " + "; ".join(self.overrides)
                    + ". Remove the override from the config or rebuild the module.")
        if self.defaulted:
            used = {"abi": f"abi v{self.abi}", "encoding": f"the {self.encoding} encoding"}
            return (f"The module does not declare how {self.function!r} is called (no "
                    f"{SECTION!r} custom section entry for it) and the config does not say "
                    f"either, so the host used its default "
                    f"{' and '.join(used[name] for name in self.defaulted)}; "
                    "if the module was built for another, declare it in the module or set "
                    f"{' and '.join(self.defaulted)} in the config.")
        return ""


def _unset(abi: int | None, encoding: str | None) -> tuple[str, ...]:
    return tuple(name for name, value in (("abi", abi), ("encoding", encoding)) if value is None)


def bind(declaration: Declaration | None, *, function: str | None, abi: int | None,
         encoding: str | None) -> Binding:
    """The call settings: the config's keys (None when unset) over the module's declaration."""
    if declaration is None:
        return Binding(function=function or _DEFAULT_FUNCTION, abi=abi or 1,
                       encoding=encoding or "json", defaulted=_unset(abi, encoding))
    if function is None:
        function = declaration.function
        if abi is not None and declaration.default.abi != abi:
            # `abi: 2` alone picks the function the module declares for ABI 2.
            function = next((n for n, e in declaration.entries.items() if e.abi == abi),
                            function)
    entry = declaration.entries.get(function)
    if entry is None:
        return Binding(function=function, abi=abi or 1,
                       encoding=encoding or declaration.default.encoding,
                       defaulted=_unset(abi, None))
    overrides = []
    if abi is not None and abi != entry.abi:
        overrides.append(f"the config sets abi {abi} but the module declares abi {entry.abi} "
                         f"for {function!r}")
    if encoding is not None and encoding != entry.encoding:
        overrides.append(f"the config sets encoding {encoding} but the module declares "
                         f"{entry.encoding} for {function!r}")
    return Binding(function=function, abi=abi or entry.abi, encoding=encoding or entry.encoding,
                   overrides=tuple(overrides))
