"""One Extism plugin: compiled once, instances pooled, called for a batch on a worker thread.

:class:`PluginSpec` is what the config says about a topic's plugin; :class:`ExtismPlugin`
compiles it (``extism``'s ``CompiledPlugin``: the file is read and checked once, at
configure, so a file that does not load fails there and a reload keeps the old
plugin) and keeps a pool of instances. An instance is taken from the pool for one
batch and put back after it, so no instance is ever used by two threads at once
(the Extism runtime does not allow it); an instance whose call failed in the
runtime (trap, timeout, memory) or was cancelled is dropped and a fresh one
created next time. Each instance is compiled from the manifest on its own (see
``_new``); the manifest - the file's bytes - is read once, at configure.

Limits come from the Extism manifest: ``timeout_ms`` (per call; Extism stops the
guest and the call fails with ``timeout``) and ``memory.max_pages`` (64 KiB
pages; an allocation beyond it fails). Besides, :meth:`ExtismPlugin.run` is
given a :class:`Cancel` that the interceptor fires at the batch deadline, which
stops a running call through Extism's cancel handle.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import extism
from extism.extism import CompiledPlugin

from kiproxy.interceptors.api import RecordBatch, RejectBatch
from kiproxy.interceptors.builtin.extism.records import (
    Binary,
    ContractError,
    decode_records,
    encode_record,
    encode_records,
)

__all__ = ["Cancel", "ExtismPlugin", "PluginSpec"]

_RUNTIME_ERRORS = ("wasm trap:", "error while executing at wasm backtrace", "Function not found")
"""What the runtime's own messages hold (a trap, a missing export); anything else is the
plugin's own error message."""


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """A topic's plugin, as configured."""

    source: str
    """A ``.wasm`` file, or an Extism manifest (a ``.json`` file)."""
    function: str = "transform"
    """The per-record export."""
    batch_function: str | None = None
    """An export taking and returning a JSON array of records (used instead, when set)."""
    config: tuple[tuple[str, str], ...] = ()
    """Extism config values the plugin reads (``Config.get``)."""
    wasi: bool = False
    timeout_ms: int | None = None
    """Per call; None: until the batch deadline."""
    max_pages: int | None = None
    """Linear memory cap in 64 KiB pages; None: Extism's default (no cap)."""
    binary: Binary = "refuse"
    error: str = "POLICY_VIOLATION"
    """The error code of a batch the plugin refuses (its own error)."""

    def manifest(self) -> dict[str, Any]:
        """The Extism manifest: the file's own (a ``.json`` manifest) or one around the
        ``.wasm``, with this spec's config and limits over it."""
        path = Path(self.source)
        if path.suffix == ".json":
            manifest: dict[str, Any] = json.loads(path.read_text())
            if not isinstance(manifest, dict) or "wasm" not in manifest:
                raise ValueError(f"{path}: an Extism manifest is a JSON object with \"wasm\"")
        else:
            manifest = {"wasm": [{"data": path.read_bytes()}]}
        config = {**manifest.get("config", {}), **dict(self.config)}
        if config:
            manifest["config"] = config
        if self.timeout_ms is not None:
            manifest["timeout_ms"] = self.timeout_ms
        if self.max_pages is not None:
            manifest["memory"] = {**manifest.get("memory", {}), "max_pages": self.max_pages}
        return manifest


@dataclass(slots=True)
class Cancel:
    """Stops the call running for one batch (fired at the deadline, from the event loop)."""

    fired: bool = False
    _handle: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, handle: Any) -> None:
        """The running call's cancel handle (None once it returned)."""
        with self._lock:
            self._handle = handle
            if handle is not None and self.fired:
                handle.cancel()

    def fire(self) -> None:
        """Stop the running call, and any call the batch would start after it."""
        with self._lock:
            self.fired = True
            if self._handle is not None:
                self._handle.cancel()


class ExtismPlugin:
    """A compiled Extism plugin and its pool of instances (see the module docstring)."""

    def __init__(self, spec: PluginSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        """How messages name it: ``extism plugin FILE``."""
        try:
            self._manifest = spec.manifest()
            probe = self._new()
        except (OSError, ValueError, extism.Error) as exc:
            raise ValueError(f"{name} does not load: {exc}") from None
        for export in (spec.batch_function or spec.function,):
            if not probe.function_exists(export):
                raise ValueError(f"{name} does not export {export!r} (set function or "
                                 "batch_function to one it exports)")
        self._idle: queue.SimpleQueue[extism.Plugin] = queue.SimpleQueue()
        self._idle.put(probe)

    @property
    def files(self) -> tuple[Path, ...]:
        """The files it was loaded from (for the file watch)."""
        return (Path(self.spec.source),)

    def _new(self) -> extism.Plugin:
        # Each instance is compiled on its own: instances of one CompiledPlugin share a
        # Wasm engine, and Extism stops a call (timeout_ms, cancel) by advancing that
        # engine's epoch, which would stop every call then running on any of them.
        return extism.Plugin(CompiledPlugin(self._manifest, self.spec.wasi, []), functions=[])

    def _take(self) -> extism.Plugin:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return self._new()

    def run(self, batch: RecordBatch, cancel: Cancel) -> RecordBatch:
        """Call the plugin for ``batch`` (on a worker thread); RejectBatch on any failure."""
        instance = self._take()
        healthy = False
        try:
            cancel.attach(instance.cancel_handle())
            if self.spec.batch_function is not None:
                records = self._call(instance, self.spec.batch_function,
                                     encode_records(batch.records, batch.topic, self.spec.binary),
                                     batch, range(len(batch.records)), cancel)
            else:
                records = []
                for i, record in enumerate(batch.records):
                    records += self._call(instance, self.spec.function,
                                          encode_record(record, batch.topic, self.spec.binary),
                                          batch, range(i, i + 1), cancel)
            # A cancel fired as the call returned may still reach the instance: drop it.
            healthy = not cancel.fired
        except RejectBatch as exc:
            healthy = not getattr(exc, "runtime", False) and not cancel.fired
            raise
        finally:
            cancel.attach(None)
            if healthy:
                self._idle.put(instance)
        return batch.with_records(records)

    def _call(self, instance: extism.Plugin, function: str, data: bytes, batch: RecordBatch,
              indices: range, cancel: Cancel) -> list[Any]:
        where = f"{self.name} {function}"
        if cancel.fired:
            raise _runtime_failure(f"{where}: the batch deadline passed", indices,
                                   "REQUEST_TIMED_OUT")
        try:
            output = instance.call(function, data)
        except extism.Error as exc:
            raise self._failure(str(exc), where, indices, cancel) from None
        originals = batch.records[indices.start:indices.stop]
        try:
            return decode_records(output, originals, batch.topic, self.spec.binary, where)
        except ContractError as exc:
            raise RejectBatch(str(exc), "INVALID_RECORD",
                              [(indices.start, str(exc))]) from None

    def _failure(self, text: str, where: str, indices: range, cancel: Cancel) -> RejectBatch:
        if text == "timeout":
            if cancel.fired:
                return _runtime_failure(f"{where} was stopped at the batch deadline", indices,
                                        "REQUEST_TIMED_OUT")
            return _runtime_failure(f"{where} was stopped: it ran past its timeout_ms "
                                    f"({self.spec.timeout_ms} ms)", indices, "INVALID_RECORD")
        if text.startswith("failed to allocate"):
            return _runtime_failure(f"{where} was stopped: out of memory (max_pages "
                                    f"{self.spec.max_pages}): {text}", indices, "INVALID_RECORD")
        if any(marker in text for marker in _RUNTIME_ERRORS):
            return _runtime_failure(f"{where} failed: {text}", indices, "INVALID_RECORD")
        # The plugin's own error (error_set and a non-zero return): its message, as is.
        # A batch export's error concerns the batch: every record (up to 50) carries it.
        return RejectBatch(text, self.spec.error, [(i, text) for i in indices[:50]])


def _runtime_failure(message: str, indices: range, error: str) -> RejectBatch:
    exc = RejectBatch(message, error, [(indices.start, message)])
    exc.runtime = True  # type: ignore[attr-defined]  # the instance is not reused
    return exc
