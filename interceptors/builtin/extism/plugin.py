"""One Extism plugin: compiled per pool slot, called for a batch on a worker thread.

:class:`PluginSpec` is what the config says about a topic's plugin; :class:`ExtismPlugin`
runs it. The manifest (the file's bytes) is read once, at configure, and compiled
there once as a check, so a file that does not load fails there and a reload keeps
the old plugin.

Pool: the host's :class:`~kiproxy.interceptors.builtin.sandbox.InstancePool` of at
most ``pool_size`` slots (the interceptor's worker threads, so never more than the
calls that can run at once). A slot is one compiled copy of the plugin
(``extism``'s ``CompiledPlugin``: its own Wasm engine) and its current instance; a
batch takes a slot and gives it back, so no instance is used by two threads at once
(the Extism runtime does not allow it). Each slot compiles once: Extism stops a call
(``timeout_ms``, cancel) by advancing its engine's epoch, which stops every call then
running on that engine, so slots do not share one - and each engine has a cache
thread of wasmtime's, so compiling per failed instance, as an unbounded pool would,
grows the proxy's threads. An instance whose call failed in the runtime (trap,
timeout, out of memory) or was cancelled is freed at once, and the next batch on the
slot instantiates a fresh one from the slot's compiled copy (no compiling). An instance
that runs out of memory after serving earlier batches has grown over them (a module
without a garbage collector, such as AssemblyScript's ``--runtime stub``, only grows):
it is replaced and the batch run again, once, on the fresh instance, so only a batch
that alone needs more than the cap is refused.

Limits: ``timeout_ms`` (per call; Extism stops the guest) and the memory cap
(``max_memory_bytes``, default
:data:`~kiproxy.interceptors.builtin.sandbox.DEFAULT_MAX_MEMORY_BYTES`, or Extism's
``max_pages``; the manifest's ``memory.max_pages`` is kept when smaller). Besides,
:meth:`ExtismPlugin.run` is given a :class:`Cancel` that the interceptor fires at the
batch deadline. Crashes (a trap, out of memory, past ``timeout_ms``) raise
:class:`~kiproxy.interceptors.verdict.PluginFault` with a message in a user's words
(the runtime's own text goes to the log at DEBUG), and a plugin that keeps crashing is
backed off (:class:`~kiproxy.interceptors.builtin.sandbox.Backoff`).
"""

from __future__ import annotations

import json
import logging
import re
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
from kiproxy.interceptors.builtin.sandbox import (
    DEFAULT_MAX_MEMORY_BYTES,
    Backoff,
    InstancePool,
    out_of_memory,
)
from kiproxy.interceptors.verdict import PluginFault

__all__ = ["Cancel", "ExtismPlugin", "PluginSpec"]

log = logging.getLogger("kiproxy.extism")

_PAGE = 65536
_TRAP = re.compile(r"^wasm trap: |error while executing at wasm backtrace|^Function not found")
"""What the runtime's own messages hold (a trap, a missing export); anything else is the
plugin's own error message."""
_OUT_OF_MEMORY = re.compile(
    r"^oom$|^failed to allocate extism memory|^[0-9a-f-]{36} out of memory$")
"""Extism's words for a call stopped by the memory cap: ``oom`` when the guest's memory
would grow past it, the kernel's allocation failures otherwise."""


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
    """Linear memory cap in 64 KiB pages (Extism's term); None: ``max_memory_bytes``."""
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES
    """Linear memory cap in bytes, unless ``max_pages`` is set."""
    binary: Binary = "refuse"
    error: str = "POLICY_VIOLATION"
    """The error code of a batch the plugin refuses (its own error)."""

    def manifest(self) -> tuple[dict[str, Any], tuple[str, int]]:
        """The Extism manifest: the file's own (a ``.json`` manifest) or one around the
        ``.wasm``, with this spec's config and limits over it; and the setting that caps
        its memory with the cap in bytes: ``max_pages`` when set, else the manifest's own
        ``memory.max_pages`` when it is the smaller, else ``max_memory_bytes``."""
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
        memory = dict(manifest.get("memory") or {})
        own = memory.get("max_pages")
        cap = ("max_memory_bytes", self.max_memory_bytes)
        if self.max_pages is not None:
            cap = ("max_pages", self.max_pages * _PAGE)
        elif isinstance(own, int) and 0 < own * _PAGE < self.max_memory_bytes:
            cap = (f"memory.max_pages of {path.name}", own * _PAGE)  # the manifest's own
        manifest["memory"] = {**memory, "max_pages": max(cap[1] // _PAGE, 1)}
        return manifest, cap


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


class _Slot:
    """One compiled copy of the plugin (its own engine) and its current instance."""

    __slots__ = ("compiled", "generation", "instance")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.instance: Any = None
        self.generation = 0  # a slot outlives its instances: it is never renewed

    def ready(self) -> Any:
        """The instance, instantiated from the compiled copy if there is none."""
        if self.instance is None:
            self.instance = extism.Plugin(self.compiled, functions=[])
        return self.instance

    def drop_instance(self) -> None:
        """Free the instance now (its memory goes at once, not when collected)."""
        instance, self.instance = self.instance, None
        if instance is not None:
            instance.__exit__(None, None, None)  # the SDK's way to free a plugin


class _Crash(Exception):
    """A call the runtime stopped: the instance is not reused."""

    def __init__(self, fault: PluginFault | RejectBatch, out_of_memory: bool = False,
                 what: str | None = None) -> None:
        super().__init__(str(fault))
        self.fault = fault
        self.out_of_memory = out_of_memory
        self.what = what
        """What happened, without the batch it happened on (the plugin, the fault, the
        export): what the batches refused during the back-off are told."""


class ExtismPlugin:
    """A compiled Extism plugin and its pool of slots (see the module docstring)."""

    def __init__(self, spec: PluginSpec, name: str, pool_size: int = 2) -> None:
        self.spec = spec
        self.name = name
        """How messages name it: ``extism plugin FILE``."""
        self.pool_size = pool_size
        self.backoff = Backoff()
        try:
            # The cap as compiled: the file may change later.
            self._manifest, self._memory = spec.manifest()
            probe = _Slot(self._compile())
            instance = probe.ready()
        except (OSError, ValueError, extism.Error) as exc:
            raise ValueError(f"{name} does not load: {exc}") from None
        for export in (spec.batch_function or spec.function,):
            if not instance.function_exists(export):
                raise ValueError(f"{name} does not export {export!r} (set function or "
                                 "batch_function to one it exports)")
        self._pool = InstancePool(lambda: _Slot(self._compile()), pool_size, first=probe)

    @property
    def files(self) -> tuple[Path, ...]:
        """The files it was loaded from (for the file watch)."""
        return (Path(self.spec.source),)

    @property
    def slots(self) -> int:
        """Slots compiled so far (at most ``pool_size``)."""
        return self._pool.size

    def _compile(self) -> Any:
        return CompiledPlugin(self._manifest, self.spec.wasi, [])

    def run(self, batch: RecordBatch, cancel: Cancel) -> RecordBatch:
        """Call the plugin for ``batch`` (on a worker thread); RejectBatch or PluginFault
        on any failure."""
        refusal = self.backoff.refusal()
        if refusal is not None:
            raise PluginFault(refusal, [(0, refusal)])
        slot = self._pool.take()
        try:
            records = self._run_once_more_if_grown(slot, batch, cancel)
        except _Crash as crash:
            slot.drop_instance()
            if isinstance(crash.fault, PluginFault):
                self.backoff.crashed(crash.what or crash.fault.message)
            raise crash.fault from None
        except (RejectBatch, PluginFault):  # it answered: its own error, or unreadable
            self.backoff.answered()
            raise
        except BaseException:
            slot.drop_instance()
            raise
        else:
            self.backoff.answered()
        finally:
            if cancel.fired:  # a cancel fired as the call returned may still reach it
                slot.drop_instance()
            self._pool.give(slot)
        return batch.with_records(records)

    def _run_once_more_if_grown(self, slot: _Slot, batch: RecordBatch, cancel: Cancel
                                ) -> list[Any]:
        """:meth:`_run`; an instance that had served earlier batches and runs out of
        memory is replaced, and the batch run again on the fresh one (see the module)."""
        grown = slot.instance is not None
        try:
            return self._run(slot, batch, cancel)
        except _Crash as crash:
            if not (crash.out_of_memory and grown) or cancel.fired:
                raise
            slot.drop_instance()
            log.debug("%s: an instance that grew over earlier batches ran out of memory on "
                      "%s[%d]; the batch runs again on a fresh one", self.name, batch.topic,
                      batch.partition)
            return self._run(slot, batch, cancel)

    def _run(self, slot: _Slot, batch: RecordBatch, cancel: Cancel) -> list[Any]:
        try:
            instance = slot.ready()
        except extism.Error as exc:
            raise self._crash("could not be instantiated", str(exc), batch, 0) from None
        cancel.attach(instance.cancel_handle())
        try:
            if self.spec.batch_function is not None:
                data = encode_records(batch.records, batch.topic, self.spec.binary)
                return self._call(instance, self.spec.batch_function, data, batch,
                                  range(len(batch.records)), cancel)
            records: list[Any] = []
            for i, record in enumerate(batch.records):
                data = encode_record(record, batch.topic, self.spec.binary)
                records += self._call(instance, self.spec.function, data, batch,
                                      range(i, i + 1), cancel)
            return records
        finally:
            cancel.attach(None)

    def _call(self, instance: Any, function: str, data: bytes, batch: RecordBatch,
              indices: range, cancel: Cancel) -> list[Any]:
        if cancel.fired:
            raise _Crash(_deadline(f"{self.name} {function}", batch, indices))
        try:
            output = instance.call(function, data)
        except extism.Error as exc:
            raise self._failure(str(exc), function, batch, indices, cancel) from None
        originals = batch.records[indices.start:indices.stop]
        try:
            return decode_records(output, originals, batch.topic, self.spec.binary,
                                  f"{self.name} {function}", indices.start)
        except ContractError as exc:
            raise PluginFault(str(exc), [(indices.start, str(exc))],
                              fault="return_type") from None

    def _failure(self, text: str, function: str, batch: RecordBatch, indices: range,
                 cancel: Cancel) -> Exception:
        where = f"{self.name} {function}"
        if text == "timeout":
            if cancel.fired:
                return _Crash(_deadline(where, batch, indices))
            return self._crash(f"ran past its timeout_ms ({self.spec.timeout_ms} ms)", text,
                               batch, indices.start, function)
        if _OUT_OF_MEMORY.search(text):
            setting, cap = self._memory
            return self._crash(out_of_memory(cap, setting, "plugin"), text, batch,
                               indices.start, function, out_of_memory=True)
        if _TRAP.search(text):
            return self._crash("crashed (a WebAssembly trap)", text, batch, indices.start,
                               function)
        # The plugin's own error (error_set and a non-zero return): its message, as is.
        # A batch export's error concerns the batch: every record (up to 50) carries it.
        return RejectBatch(text, self.spec.error, [(i, text) for i in indices[:50]])

    def _crash(self, what: str, raw: str, batch: RecordBatch, index: int,
               function: str | None = None, out_of_memory: bool = False) -> _Crash:
        call = f" in {function}" if function else ""
        at = (f"record {index} of " if self.spec.batch_function is None else "") + (
            f"{batch.topic}[{batch.partition}]")
        message = f"{self.name} {what}{call} on {at}"
        log.debug("%s; the runtime said: %s", message, raw)
        return _Crash(PluginFault(message, [(index, message)]), out_of_memory,
                      what=f"{self.name} {what}{call}")

    def close(self) -> None:
        """Free the idle slots' instances and compiled copies."""
        for slot in self._pool.drain():
            slot.drop_instance()
            slot.compiled = None


def _deadline(where: str, batch: RecordBatch, indices: range) -> RejectBatch:
    message = f"{where} was stopped at the batch deadline on {batch.topic}[{batch.partition}]"
    return RejectBatch(message, "REQUEST_TIMED_OUT", [(indices.start, message)])
