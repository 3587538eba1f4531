"""The Wasm interceptor's engine: compiled modules and sandboxed instances (wasmtime).

A :class:`Program` is one compiled module file (checked against the ABI when
compiled: ``memory``, ``alloc``, the function, optional ``dealloc`` and
``_initialize``, only WASI imports), its idle :class:`Instance` s (one store
each, fuel and memory capped, WASI with no files, environment or network),
and its reload state. :meth:`Program.run` runs one batch through the ABI of
:mod:`kiproxy.interceptors.builtin.wasm.abi` and returns the batch or raises
``RejectBatch`` (a trap, running out of fuel or memory and a malformed result
are a :class:`~kiproxy.interceptors.verdict.PluginFault`, INVALID_RECORD, the
runtime's own text logged at DEBUG; the deadline, enforced by epoch interruption
ticked by an :class:`EpochClock`, is REQUEST_TIMED_OUT); a failed instance is
thrown away, and a module that keeps crashing is backed off
(:class:`~kiproxy.interceptors.builtin.sandbox.Backoff`).
:func:`new_engine` makes the wasmtime engine every program of one
interceptor shares. Importing this module needs ``wasmtime``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import wasmtime

from kiproxy.interceptors import Record, RecordBatch, RejectBatch
from kiproxy.interceptors.builtin.sandbox import (
    Backoff,
    FileWatch,
    InstancePool,
    out_of_memory,
)
from kiproxy.interceptors.builtin.wasm.abi import Malformed, decode_result, encode_input
from kiproxy.interceptors.builtin.wasm.declaration import (
    SECTION,
    Binding,
    Declaration,
    bind,
    read_declaration,
)
from kiproxy.interceptors.verdict import PluginFault, output_limits, output_size

__all__ = ["EpochClock", "Instance", "Program", "Target", "new_engine"]

log = logging.getLogger("kiproxy.wasm")

_TICK_S = 0.01  # epoch-interruption granularity
_MIN_INPUT_BUFFER = 4096
_WASI_MODULES = ("wasi_snapshot_preview1", "wasi_unstable")


def new_engine() -> tuple[wasmtime.Engine, EpochClock]:
    """A wasmtime engine with fuel and epoch interruption on, and its epoch clock."""
    wasm_config = wasmtime.Config()
    wasm_config.consume_fuel = True
    wasm_config.epoch_interruption = True
    engine = wasmtime.Engine(wasm_config)
    return engine, EpochClock(engine)


class EpochClock:
    """Advances the engine's epoch every tick while any Wasm call is running."""

    def __init__(self, engine: wasmtime.Engine) -> None:
        self.engine = engine
        self._active = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> None:
        with self._cond:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kiproxy-wasm-epoch",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            time.sleep(_TICK_S)
            self.engine.increment_epoch()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


@dataclass(frozen=True, slots=True)
class Target:
    """One module file and how the config asks to call it (None: as the module declares)."""

    module: str
    function: str | None
    abi: int | None
    encoding: str | None
    fuel: int
    max_memory: int
    error: str


class _Fault(Exception):
    """A Wasm call failed; the instance must be thrown away.

    ``suspect`` marks failures that a host and module disagreeing on the ABI or
    encoding would cause (a trap, an unreadable result): their rejection says so.
    """

    def __init__(self, reason: str, timed_out: bool = False, reset: bool = True,
                 suspect: bool = False, malformed: bool = False, raw: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out
        self.reset = reset
        self.suspect = suspect
        self.malformed = malformed
        """The module answered, but not in the ABI's shape (not a crash)."""
        self.raw = raw
        """The runtime's own text (a trap's backtrace), for the DEBUG log."""


def _trap_reason(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("wasm trap:"):
            return line
    return lines[-1] if lines else type(exc).__name__


class Instance:
    """One instance of a module in a store of its own; one call at a time."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.generation = program.generation
        self.binding = program.binding
        target = program.target
        self.store = wasmtime.Store(program.engine)
        self.store.set_limits(memory_size=target.max_memory)
        if program.wasi:
            wasi = wasmtime.WasiConfig()
            wasi.inherit_stderr()  # a module's panic message reaches the proxy's log
            self.store.set_wasi(wasi)
        self.store.set_fuel(target.fuel)
        self.store.set_epoch_deadline(math.ceil(10 / _TICK_S))
        try:
            instance = program.linker.instantiate(self.store, program.module)
        except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
            raise _Fault(f"could not be instantiated: {_trap_reason(exc)}") from exc
        exports = instance.exports(self.store)
        memory = exports.get("memory")
        alloc = exports.get("alloc")
        func = exports.get(self.binding.function)
        assert isinstance(memory, wasmtime.Memory)  # checked when the module was compiled
        assert isinstance(alloc, wasmtime.Func) and isinstance(func, wasmtime.Func)
        self.memory = memory
        self.alloc = alloc
        self.func = func
        dealloc = exports.get("dealloc")
        self.dealloc = dealloc if isinstance(dealloc, wasmtime.Func) else None
        self.in_ptr = 0
        self.in_cap = 0
        initialize = exports.get("_initialize")
        if isinstance(initialize, wasmtime.Func):
            try:
                with program.clock:
                    initialize(self.store)
            except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
                raise _Fault(f"_initialize failed: {_trap_reason(exc)}") from exc

    def _input_buffer(self, size: int) -> int:
        if size <= self.in_cap:
            return self.in_ptr
        if self.in_cap and self.dealloc is not None:
            self.dealloc(self.store, self.in_ptr, self.in_cap)
        capacity = max(size, _MIN_INPUT_BUFFER, self.in_cap * 2)
        ptr = self.alloc(self.store, capacity)
        if not isinstance(ptr, int) or ptr <= 0:
            self.in_cap = 0
            raise _Fault(f"{self.program.out_of_memory} (alloc({capacity}) returned {ptr})")
        if ptr + capacity > self.memory.data_len(self.store):
            self.in_cap = 0
            raise _Fault(f"returned a malformed result: alloc({capacity}) returned {ptr}, "
                         "past the end of memory", malformed=True)
        self.in_ptr, self.in_cap = ptr, capacity
        return ptr

    def call(self, payload: bytes, deadline: float) -> bytes:
        """Write ``payload``, call the function, return a copy of its result."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Fault("was not called: the batch deadline had passed", timed_out=True,
                         reset=False)
        self.store.set_epoch_deadline(max(1, math.ceil(remaining / _TICK_S)))
        target = self.program.target
        try:
            with self.program.clock:
                ptr = self._input_buffer(len(payload))
                self.memory.write(self.store, payload, ptr)
                ret = self.func(self.store, ptr, len(payload))
        except wasmtime.Trap as exc:
            code = exc.trap_code
            raw = str(exc)
            if code == wasmtime.TrapCode.OUT_OF_FUEL:
                raise _Fault(f"ran out of fuel ({target.fuel} per batch)", raw=raw) from exc
            if code == wasmtime.TrapCode.INTERRUPT:
                raise _Fault("was interrupted at the batch deadline", timed_out=True,
                             raw=raw) from exc
            if self._memory_exhausted():
                raise _Fault(self.program.out_of_memory, raw=raw) from exc
            raise _Fault(f"trapped: {_trap_reason(exc)}", suspect=True, raw=raw) from exc
        except wasmtime.WasmtimeError as exc:
            raise _Fault(f"failed: {_trap_reason(exc)}", raw=str(exc)) from exc
        if not isinstance(ret, int):
            raise _Fault(f"returned a malformed result: {ret!r} is not an i64", suspect=True,
                         malformed=True)
        ret &= 0xFFFF_FFFF_FFFF_FFFF
        out_ptr, out_len = ret >> 32, ret & 0xFFFF_FFFF
        size = self.memory.data_len(self.store)
        if out_len == 0:
            raise _Fault("returned a malformed result: it is empty (0 bytes; a status byte "
                         "comes first)", suspect=True, malformed=True)
        if out_ptr + out_len > size:
            raise _Fault(f"returned a malformed result: {out_len} bytes at {out_ptr} "
                         f"is not inside its {size}-byte memory", suspect=True, malformed=True)
        return bytes(self.memory.read(self.store, out_ptr, out_ptr + out_len))

    def _memory_exhausted(self) -> bool:
        page = self.memory.page_size(self.store)
        return self.memory.data_len(self.store) + page > self.program.target.max_memory


def _signature(ty: wasmtime.FuncType) -> str:
    return (f"({', '.join(map(str, ty.params))}) -> "
            f"{', '.join(map(str, ty.results)) or '()'}")


def _abi_problems(exports: Mapping[str, object], binding: Binding,
                  declaration: Declaration | None) -> list[str]:
    """What a compiled module lacks to be called as ``binding`` says (empty: nothing)."""
    problems = []
    if not isinstance(exports.get("memory"), wasmtime.MemoryType):
        problems.append("it exports no memory named 'memory'")
    i32, i64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
    entry_type = wasmtime.FuncType([i32, i32], [i64])
    entries = [binding.function, *(declaration.entries if declaration else ())]
    for name, expected in (("alloc", wasmtime.FuncType([i32], [i32])),
                           *((n, entry_type) for n in dict.fromkeys(entries))):
        ty = exports.get(name)
        if not isinstance(ty, wasmtime.FuncType):
            problems.append(f"it exports no function {name!r}"
                            + _whose_function(name, binding, declaration, exports, entry_type))
        elif ty.params != expected.params or ty.results != expected.results:
            problems.append(f"{name} must be {_signature(expected)}, not {_signature(ty)}")
    dealloc = exports.get("dealloc")
    if dealloc is not None and (not isinstance(dealloc, wasmtime.FuncType)
                                or dealloc.params != [i32, i32] or dealloc.results):
        problems.append("dealloc must be (i32, i32) -> ()")
    return problems


def _whose_function(name: str, binding: Binding, declaration: Declaration | None,
                    exports: Mapping[str, object], entry_type: wasmtime.FuncType) -> str:
    """Why the host looked for ``name``, and what the module offers instead."""
    if name == "alloc":
        return ""
    offered = sorted(n for n, ty in exports.items() if isinstance(ty, wasmtime.FuncType)
                     and ty.params == entry_type.params and ty.results == entry_type.results)
    candidates = f"; its (i32, i32) -> i64 exports are: {', '.join(offered) or 'none'}"
    if declaration is not None and name in declaration.entries:
        return f" (its custom section {SECTION!r} declares it){candidates}"
    if declaration is not None:
        return (f" (the config sets function {name!r}; the module declares "
                f"{declaration.describe()}){candidates}")
    return f" (the host's default entry; the module declares none){candidates}" \
        if name == "transform" else f" (set by the config){candidates}"


class Program:
    """A compiled module, its idle instances and what is needed to reload it."""

    def __init__(self, engine: wasmtime.Engine, clock: EpochClock, target: Target,
                 reload_interval: float | None) -> None:
        self.engine = engine
        self.clock = clock
        self.target = target
        self.path = Path(target.module)
        self.reload_interval = reload_interval
        self.reloads = 0
        self.faults = 0
        self.backoff = Backoff()
        """Crashes in a row, and the period its batches are refused without a call."""
        self._pool: InstancePool[Instance] = InstancePool(lambda: Instance(self))
        self._lock = threading.Lock()
        try:  # stat'ed before reading, so a change while compiling is seen
            self._watch = FileWatch(self.path, reload_interval)
        except OSError as exc:
            raise ValueError(f"cannot read wasm module {target.module}: {exc}") from None
        self.module, self.wasi, self.binding = self._compile()
        self.linker = self._linker()
        for override in self.binding.overrides:
            log.warning("wasm module %s: %s; the config wins (remove the key to use the "
                        "module's declaration)", target.module, override)

    @property
    def name(self) -> str:
        return (f"wasm module {self.target.module} "
                f"({self.binding.function}, abi v{self.binding.abi})")

    @property
    def out_of_memory(self) -> str:
        """How a call stopped by the memory cap is described."""
        return out_of_memory(self.target.max_memory, "max_memory_bytes", "module")

    @property
    def generation(self) -> int:
        """Bumped by each reload; instances of an older one are not reused."""
        return self._pool.generation

    @property
    def files(self) -> tuple[Path, ...]:
        """The module file."""
        return (self.path,)

    @property
    def _idle(self) -> list[Instance]:
        return self._pool.idle

    @property
    def _checked_at(self) -> float:
        return self._watch.checked_at

    @_checked_at.setter
    def _checked_at(self, at: float) -> None:
        self._watch.checked_at = at

    def _binary(self) -> bytes:
        """The module file as binary Wasm (``.wat`` text is assembled)."""
        target = self.target
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read wasm module {target.module}: {exc}") from None
        if data[:4] == b"\0asm":
            return data
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if text is None or self.path.suffix == ".wasm":
            raise ValueError(
                f"wasm module {target.module} is not WebAssembly: it does not start with the "
                "Wasm magic bytes \\0asm (a binary module) and "
                + ("is not text (.wat)" if text is None else "is named .wasm, not .wat"))
        try:
            return bytes(wasmtime.wat2wasm(text))
        except wasmtime.WasmtimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            at = next((ln.removeprefix("--> <anon>:") for ln in lines if ln.startswith("-->")),
                      "")
            raise ValueError(f"wasm module {target.module} does not compile: it is not valid "
                             f"WebAssembly text: {lines[0] if lines else exc}"
                             + (f" (line:column {at})" if at else "")) from None

    def _compile(self) -> tuple[wasmtime.Module, bool, Binding]:
        target = self.target
        data = self._binary()
        try:
            declaration = read_declaration(data, target.module)
        except ValueError as exc:
            # Malformed sections are reported by the compiler below with its own words.
            if str(exc).startswith(f"wasm module {target.module}:"):
                raise
            declaration = None
        try:
            module = wasmtime.Module(self.engine, data)
        except wasmtime.WasmtimeError as exc:
            raise ValueError(f"wasm module {target.module} does not compile: "
                             f"{_trap_reason(exc)}") from None
        binding = bind(declaration, function=target.function, abi=target.abi,
                       encoding=target.encoding)
        exports = {e.name: e.type for e in module.exports}
        problems = _abi_problems(exports, binding, declaration)
        foreign = sorted(f"{i.module}.{i.name}" for i in module.imports
                         if i.module not in _WASI_MODULES)
        if foreign:
            problems.append(f"it imports {', '.join(foreign)}; only WASI imports are provided")
        if problems:
            raise ValueError(f"wasm module {target.module} does not follow the kiproxy ABI: "
                             + "; ".join(problems))
        wasi = any(i.module in _WASI_MODULES for i in module.imports)
        return module, wasi, binding

    def _linker(self) -> wasmtime.Linker:
        linker = wasmtime.Linker(self.engine)
        if self.wasi:
            linker.define_wasi()
        return linker

    def maybe_reload(self) -> None:
        """Recompile the module when its file changed (checked at most every interval)."""
        self._watch.poll(self._reload, self._unreadable)

    def _unreadable(self, exc: OSError) -> None:
        log.error("%s: cannot stat the module file (%s); keeping the loaded module",
                  self.name, exc)

    def _reload(self) -> bool:
        try:
            module, wasi, binding = self._compile()
        except ValueError as exc:
            log.error("%s changed but cannot be loaded; keeping the previous module: %s",
                      self.name, exc)
            return False
        with self._lock:
            self.module, self.wasi, self.binding = module, wasi, binding
            self.linker = self._linker()
            self._pool.renew()
            self.reloads += 1
        log.info("%s reloaded (file changed)", self.name)
        return True

    def close(self) -> None:
        """Drop the idle instances (their stores go with them)."""
        self._pool.drain()

    def run(self, batch: RecordBatch, deadline: float) -> RecordBatch:
        """Call the module for ``batch``; raise RejectBatch when it or the call fails."""
        self.maybe_reload()
        target = self.target
        where = f"{batch.topic}[{batch.partition}]"
        refusal = self.backoff.refusal()
        if refusal is not None:
            raise PluginFault(refusal)
        index = 0
        try:
            instance = self._pool.take()
        except _Fault as exc:
            self.faults += 1
            raise self._reject(exc, where, None, self.binding) from exc
        binding = instance.binding
        healthy = False
        try:
            instance.store.set_fuel(target.fuel)
            if binding.abi == 1:
                out: list[Record] = []
                changed = False
                bound, size = output_limits().max_bytes, 0
                for index, record in enumerate(batch.records):
                    result = self._decoded(instance, (record,), batch, deadline)
                    if isinstance(result, str):
                        healthy = True
                        self.backoff.answered()
                        raise RejectBatch(f"{self.name} rejected record {index} of {where}: "
                                          f"{result}", target.error, [(index, result)])
                    if result is None or result[0] is record:
                        out.append(record)
                    else:
                        out.append(result[0])
                        changed = True
                    size += output_size((out[-1],))
                    if changed and size > bound:  # stopped before the rest is read
                        # (an unchanged batch is never measured, as by the verdict)
                        healthy = True
                        self.backoff.answered()
                        raise PluginFault(
                            f"{self.name} returned more than {bound} bytes of records for "
                            f"{where} by record {index} of {len(batch.records)}; the limit is "
                            f"max_plugin_output_bytes ({bound})", fault="output_size")
                healthy = True
                self.backoff.answered()
                return batch.with_records(out) if changed else batch
            result = self._decoded(instance, batch.records, batch, deadline)
            healthy = True
            self.backoff.answered()
            if isinstance(result, str):
                raise RejectBatch(f"{self.name} rejected {where}: {result}", target.error)
            if result is None or all(a is b for a, b in zip(result, batch.records,
                                                            strict=True)):
                return batch
            return batch.with_records(result)
        except _Fault as exc:
            self.faults += 1
            healthy = not exc.reset
            raise self._reject(exc, where, index if binding.abi == 1 else None,
                               binding) from exc
        finally:
            if healthy:
                self._pool.give(instance)
            else:
                self._pool.discard()

    def _decoded(self, instance: Instance, records: Sequence[Record], batch: RecordBatch,
                 deadline: float) -> tuple[Record, ...] | str | None:
        binding = instance.binding
        payload = encode_input(binding.abi, binding.encoding, batch.topic, batch.partition,
                               records)
        raw = instance.call(payload, deadline)
        try:
            return decode_result(binding.abi, binding.encoding, raw, records,
                                 place=(batch.topic, batch.partition))
        except Malformed as exc:
            raise _Fault(f"returned a malformed result: {exc}", suspect=True,
                         malformed=True) from exc

    def _reject(self, fault: _Fault, where: str, index: int | None,
                binding: Binding) -> RejectBatch:
        at = f"record {index} of {where}" if index is not None else where
        message = f"{self.name} {fault.reason} on {at}; batch rejected" + (
            ", instance reset" if fault.reset else "")
        if fault.suspect and binding.hint:
            message += f". {binding.hint}"
        # The proxy logs the rejection itself (rate-limited); the runtime's text is detail.
        log.debug("%s%s", message, f"; the runtime said: {fault.raw}" if fault.raw else "")
        if fault.timed_out:
            return RejectBatch(message, "REQUEST_TIMED_OUT")
        records = [] if index is None else [(index, message)]
        if fault.malformed:
            return PluginFault(message, records, fault="return_type")
        self.backoff.crashed(f"{self.name} {fault.reason}")  # not where: another batch's
        return PluginFault(message, records)
