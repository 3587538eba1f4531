"""``kiproxy.interceptors.builtin.wasm:WasmInterceptor`` - interceptors compiled to WebAssembly.

A module (``.wasm``, or ``.wat`` text for small examples) is compiled once with
wasmtime and called for every batch, sandboxed: it sees only the bytes the host
writes into its linear memory, may import nothing but WASI (given no files, no
environment and no network), and is bounded by an instruction budget (fuel),
a memory cap and the batch deadline.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.wasm:WasmInterceptor
      timeout_ms: 5000
      config:
        module: examples/wasm/uppercase.wat   # default module (optional when `topics` is set)
        function: transform                   # exported function (default transform)
        abi: 1                                # 1: one record per call; 2: the whole batch
        encoding: binary                      # json (default) or binary
        topics:                               # per-topic modules (exact topic names)
          orders: orders.wasm                 #   a path, or a mapping that overrides any
          audit: {module: audit.wasm, abi: 2, function: check_batch}   # of the keys above
        fuel: 500000000                       # instruction budget per batch
        max_memory_bytes: 67108864            # linear-memory cap per instance
        error: INVALID_RECORD                 # error code of rejections the module asks for
        reload_interval_ms: 1000              # stat the file this often; 0: every batch; -1: never
        threaded: true                        # run Wasm on worker threads (see below)
        workers: 1                            # worker threads = instances per module

Topics that match neither ``topics`` nor a default ``module`` pass untouched.
Relative paths are resolved against the proxy's working directory.

ABI (the README has the full description and a worked example). The module
exports ``memory``, ``alloc(size: i32) -> i32`` (0 = cannot allocate),
optionally ``dealloc(ptr: i32, size: i32)``, and the function
``(ptr: i32, len: i32) -> i64``. The host asks ``alloc`` for an input buffer
(kept and reused while it is big enough; ``dealloc`` is called when the host
replaces it), writes the input there, calls the function, and reads the result
at ``(ret >> 32, ret & 0xffffffff)``. The result starts with a status byte:
``0`` a record (v1) or batch (v2) follows, ``1`` reject (a UTF-8 reason follows),
``2`` unchanged. The result belongs to the module and must stay valid until
its next call. With ABI v1 the function is called once per record and any
rejection rejects the whole batch (as a broker-side plugin would); with ABI v2
it is called once per batch. A module exporting ``_initialize`` (a WASI
reactor) has it called once per instance.

Failures: out of fuel, a trap, running out of memory (``max_memory_bytes``)
and a malformed result reject the batch (INVALID_RECORD) with a message naming
the module, the function and the reason; the instance is thrown away and a
fresh one serves the next batch. The batch deadline (``interceptor.timeout_ms``)
interrupts a call that is still running (REQUEST_TIMED_OUT, retriable).

Fuel and the deadline: fuel is deterministic - the same batch always burns the
same fuel - so it is what bounds a runaway module. On a 2-core x86-64 VM a
tight Wasm loop burns about 2x10^9 fuel per second, so the default 5x10^8 per
batch is about 0.25 s of pure Wasm, well inside the default 5 s deadline; keep
``fuel / 2e9 s`` under ``timeout_ms`` on your hardware. The deadline is the
backstop: wasmtime's epoch interruption stops the call at ``ctx.deadline``
(10 ms granularity) so a worker is never held past it.

Threads (``threaded: true``, the default): a plain ``intercept`` runs inline
on the proxy's event loop and cannot be pre-empted (see ``proxy/produce.py``),
so ``intercept`` returns an awaitable that runs the Wasm call on a worker
thread. wasmtime releases the GIL while Wasm runs, so other connections keep
being served while a module works; the pipeline cancels the wait at the
deadline and the epoch interruption frees the worker. ``threaded: false`` runs
the call inline (lowest latency for tiny modules; a slow module then stalls
every connection up to the deadline).

Reload: before a batch, at most every ``reload_interval_ms``, the module file
is stat'ed; a changed size or modification time recompiles it, and new
instances use the new code from the next batch on. A file that fails to
compile is logged and the previous module keeps serving. Replace module files
atomically (write a temporary file, then rename it).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import wasmtime

from kiproxy.interceptors import (
    Header,
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
)

__all__ = [
    "STATUS_OK",
    "STATUS_REJECT",
    "STATUS_UNCHANGED",
    "WasmInterceptor",
    "decode_result",
    "encode_input",
]

log = logging.getLogger("kiproxy.wasm")

STATUS_OK = 0
"""Result status: the (transformed) record or batch follows."""
STATUS_REJECT = 1
"""Result status: reject the batch; a UTF-8 reason follows."""
STATUS_UNCHANGED = 2
"""Result status: the record (v1) or batch (v2) passes unchanged."""

DEFAULT_FUEL = 500_000_000
DEFAULT_MAX_MEMORY = 64 * 2**20
_TICK_S = 0.01  # epoch-interruption granularity
_MIN_INPUT_BUFFER = 4096
_WASI_MODULES = ("wasi_snapshot_preview1", "wasi_unstable")
_ENCODINGS = ("json", "binary")
_TARGET_KEYS = {"module", "function", "abi", "encoding", "fuel", "max_memory_bytes", "error"}
_CONFIG_KEYS = _TARGET_KEYS | {"topics", "reload_interval_ms", "threaded", "workers"}


class _Malformed(Exception):
    """The module's result does not follow the ABI."""


# ------------------------------------------------------------------------ encoding


_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


_NULL = b"\xff\xff\xff\xff"
_I64_I32 = struct.Struct("<qi")


def _record_parts(parts: list[bytes], record: Record) -> None:
    """Append the binary layout of ``record`` to ``parts`` (joined once per call)."""
    key, value, headers = record.key, record.value, record.headers
    parts.append(_I64_I32.pack(record.timestamp, -1 if key is None else len(key)))
    if key:
        parts.append(key)
    if value is None:
        parts.append(_NULL)
    else:
        parts.append(_I32.pack(len(value)))
        parts.append(value)
    parts.append(_U32.pack(len(headers)))
    for header in headers:
        name, data = header.key.encode(), header.value
        parts.append(_U32.pack(len(name)))
        parts.append(name)
        if data is None:
            parts.append(_NULL)
        else:
            parts.append(_I32.pack(len(data)))
            parts.append(data)


def _json_bytes(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(data).decode()}


def _json_record(record: Record) -> dict[str, Any]:
    return {
        "key": _json_bytes(record.key),
        "value": _json_bytes(record.value),
        "headers": [[h.key, _json_bytes(h.value)] for h in record.headers],
        "timestamp": record.timestamp,
    }


def encode_input(
    abi: int, encoding: str, topic: str, partition: int, records: Sequence[Record]
) -> bytes:
    """The bytes the host writes into the module's memory for one call.

    ABI v1 takes exactly one record; ABI v2 the whole batch.
    """
    if encoding == "json":
        doc: dict[str, Any] = {"topic": topic, "partition": partition}
        if abi == 1:
            doc.update(_json_record(records[0]))
        else:
            doc["records"] = [_json_record(r) for r in records]
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    name = topic.encode()
    parts = [_U32.pack(len(name)), name, _I32.pack(partition)]
    if abi == 1:
        _record_parts(parts, records[0])
    else:
        parts.append(_U32.pack(len(records)))
        for record in records:
            _record_parts(parts, record)
    return b"".join(parts)


class _Reader:
    """Bounds-checked reads of the binary result layout."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise _Malformed(f"{what} runs past the end of the result "
                             f"({n} bytes at offset {self.pos} of {len(self.data)})")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def i32(self, what: str) -> int:
        value: int = _I32.unpack(self.take(4, what))[0]
        return value

    def u32(self, what: str) -> int:
        value: int = _U32.unpack(self.take(4, what))[0]
        return value

    def nullable(self, what: str) -> bytes | None:
        n = self.i32(f"{what} length")
        if n == -1:
            return None
        if n < 0:
            raise _Malformed(f"{what} length {n} is negative (only -1, null, is allowed)")
        return self.take(n, what)

    def record(self, original: Record, index: int) -> Record:
        where = f"record {index}"
        (timestamp,) = _I64.unpack(self.take(8, f"{where} timestamp"))
        key = self.nullable(f"{where} key")
        value = self.nullable(f"{where} value")
        count = self.u32(f"{where} header count")
        if count > len(self.data):
            raise _Malformed(f"{where} claims {count} headers in a {len(self.data)}-byte result")
        headers = []
        for h in range(count):
            raw = self.take(self.u32(f"{where} header {h} key length"), f"{where} header {h} key")
            try:
                hkey = raw.decode()
            except UnicodeDecodeError:
                raise _Malformed(f"{where} header {h} key is not UTF-8") from None
            headers.append(Header(hkey, self.nullable(f"{where} header {h} value")))
        return _rebuilt(original, key, value, tuple(headers), timestamp)


def _binary_records(data: bytes, pos: int, originals: Sequence[Record]) -> tuple[list[Record], int]:
    """Decode ``len(originals)`` records of the binary layout from ``pos``: the fast path.

    Raises ``_Malformed`` with a precise reason (found by re-reading with ``_Reader``)
    when the bytes do not follow the layout.
    """
    unpack_i32, unpack_u32, unpack_i64 = (_I32.unpack_from, _U32.unpack_from,
                                          _I64.unpack_from)
    size = len(data)
    start = pos
    out: list[Record] = []
    try:
        for original in originals:
            (timestamp,) = unpack_i64(data, pos)
            (n,) = unpack_i32(data, pos + 8)
            pos += 12
            key: bytes | None = None
            if n != -1:
                if n < 0 or pos + n > size:
                    raise ValueError
                key = data[pos:pos + n]
                pos += n
            (n,) = unpack_i32(data, pos)
            pos += 4
            value: bytes | None = None
            if n != -1:
                if n < 0 or pos + n > size:
                    raise ValueError
                value = data[pos:pos + n]
                pos += n
            (count,) = unpack_u32(data, pos)
            pos += 4
            if count > size:
                raise ValueError
            headers = []
            for _ in range(count):
                (n,) = unpack_u32(data, pos)
                pos += 4
                if pos + n > size:
                    raise ValueError
                hkey = data[pos:pos + n].decode()
                pos += n
                (n,) = unpack_i32(data, pos)
                pos += 4
                hvalue: bytes | None = None
                if n != -1:
                    if n < 0 or pos + n > size:
                        raise ValueError
                    hvalue = data[pos:pos + n]
                    pos += n
                headers.append(Header(hkey, hvalue))
            out.append(_rebuilt(original, key, value, tuple(headers), timestamp))
    except (struct.error, ValueError):  # UnicodeDecodeError is a ValueError
        reader = _Reader(data, start)
        for i, original in enumerate(originals):
            reader.record(original, i)
        raise _Malformed("the records do not follow the binary layout") from None
    return out, pos


def _rebuilt(
    original: Record, key: bytes | None, value: bytes | None, headers: tuple[Header, ...],
    timestamp: int,
) -> Record:
    """The record with these fields - the original object itself when nothing changed."""
    if (key == original.key and value == original.value and timestamp == original.timestamp
            and headers == original.headers):
        return original
    return Record(key=key, value=value, headers=headers, timestamp=timestamp,
                  offset_delta=original.offset_delta)


def _from_json_bytes(value: Any, what: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Mapping) and set(value) == {"b64"} and isinstance(value["b64"], str):
        try:
            return base64.b64decode(value["b64"], validate=True)
        except ValueError as exc:
            raise _Malformed(f"{what} is not valid base64: {exc}") from None
    raise _Malformed(f"{what} must be null, a string or {{\"b64\": \"...\"}}, "
                     f"not {type(value).__name__}")


_JSON_RECORD_KEYS = {"key", "value", "headers", "timestamp", "topic", "partition"}


def _json_to_record(doc: Any, original: Record, index: int) -> Record:
    where = f"record {index}"
    if not isinstance(doc, Mapping):
        raise _Malformed(f"{where} must be a JSON object, not {type(doc).__name__}")
    unknown = set(doc) - _JSON_RECORD_KEYS
    if unknown:
        raise _Malformed(f"{where} has unknown field(s) {', '.join(sorted(unknown))} "
                         "(allowed: key, value, headers, timestamp)")
    key = _from_json_bytes(doc["key"], f"{where} key") if "key" in doc else original.key
    value = _from_json_bytes(doc["value"], f"{where} value") if "value" in doc else original.value
    timestamp = original.timestamp
    if "timestamp" in doc:
        timestamp = doc["timestamp"]
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise _Malformed(f"{where} timestamp must be an integer (ms)")
    headers = original.headers
    if "headers" in doc:
        raw = doc["headers"]
        if not isinstance(raw, list):
            raise _Malformed(f"{where} headers must be a list of [key, value] pairs")
        out = []
        for h, pair in enumerate(raw):
            if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str)):
                raise _Malformed(f"{where} header {h} must be a [key, value] pair "
                                 "with a string key")
            out.append(Header(pair[0], _from_json_bytes(pair[1], f"{where} header {h} value")))
        headers = tuple(out)
    return _rebuilt(original, key, value, headers, timestamp)


def decode_result(
    abi: int, encoding: str, result: bytes, originals: Sequence[Record]
) -> tuple[Record, ...] | str | None:
    """Interpret a module's result for ``originals`` (one record for v1).

    Returns the records (same count as ``originals``), the reason string of a
    rejection, or None for "unchanged". Raises ``_Malformed`` when the result
    does not follow the ABI.
    """
    if not result:
        raise _Malformed("the result is empty (expected a status byte)")
    status = result[0]
    if status == STATUS_UNCHANGED:
        return None
    if status == STATUS_REJECT:
        return result[1:].decode(errors="replace") or "(no reason given)"
    if status != STATUS_OK:
        raise _Malformed(f"unknown status byte {status} (0 ok, 1 reject, 2 unchanged)")
    if encoding == "json":
        try:
            doc = json.loads(result[1:])
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Malformed(f"the result is not JSON: {exc}") from None
        if abi == 1:
            return (_json_to_record(doc, originals[0], 0),)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("records"), list):
            raise _Malformed('a v2 result must be a JSON object {"records": [...]}')
        items = doc["records"]
        if len(items) != len(originals):
            raise _Malformed(f"the result holds {len(items)} records for a batch of "
                             f"{len(originals)}")
        return tuple(_json_to_record(d, o, i) for i, (d, o) in
                     enumerate(zip(items, originals, strict=True)))
    pos = 1
    if abi == 2:
        count = _Reader(result, 1).u32("record count")
        if count != len(originals):
            raise _Malformed(f"the result holds {count} records for a batch of "
                             f"{len(originals)}")
        pos = 5
    records, pos = _binary_records(result, pos, originals)
    if pos != len(result):
        raise _Malformed(f"{len(result) - pos} unexpected bytes after the records")
    return tuple(records)


# ------------------------------------------------------------------------ runtime


class _EpochClock:
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
class _Target:
    """One module file and how to call it."""

    module: str
    function: str
    abi: int
    encoding: str
    fuel: int
    max_memory: int
    error: str


class _Fault(Exception):
    """A Wasm call failed; the instance must be thrown away."""

    def __init__(self, reason: str, timed_out: bool = False, reset: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out
        self.reset = reset


def _trap_reason(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("wasm trap:"):
            return line
    return lines[-1] if lines else type(exc).__name__


class _Instance:
    """One instance of a module in a store of its own; one call at a time."""

    def __init__(self, program: _Program) -> None:
        self.program = program
        self.generation = program.generation
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
        func = exports.get(target.function)
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
            raise _Fault(f"ran out of memory: alloc({capacity}) returned {ptr} "
                         f"(max_memory_bytes {self.program.target.max_memory})")
        if ptr + capacity > self.memory.data_len(self.store):
            self.in_cap = 0
            raise _Fault(f"returned a malformed result: alloc({capacity}) returned {ptr}, "
                         "past the end of memory")
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
            if code == wasmtime.TrapCode.OUT_OF_FUEL:
                raise _Fault(f"ran out of fuel ({target.fuel} per batch)") from exc
            if code == wasmtime.TrapCode.INTERRUPT:
                raise _Fault("was interrupted at the batch deadline", timed_out=True) from exc
            reason = _trap_reason(exc)
            if self._memory_exhausted():
                raise _Fault(f"ran out of memory (max_memory_bytes {target.max_memory}): "
                             f"{reason}") from exc
            raise _Fault(f"trapped: {reason}") from exc
        except wasmtime.WasmtimeError as exc:
            raise _Fault(f"failed: {_trap_reason(exc)}") from exc
        if not isinstance(ret, int):
            raise _Fault(f"returned a malformed result: {ret!r} is not an i64")
        ret &= 0xFFFF_FFFF_FFFF_FFFF
        out_ptr, out_len = ret >> 32, ret & 0xFFFF_FFFF
        size = self.memory.data_len(self.store)
        if out_len == 0 or out_ptr + out_len > size:
            raise _Fault(f"returned a malformed result: {out_len} bytes at {out_ptr} "
                         f"is not inside its {size}-byte memory")
        return bytes(self.memory.read(self.store, out_ptr, out_ptr + out_len))

    def _memory_exhausted(self) -> bool:
        page = self.memory.page_size(self.store)
        return self.memory.data_len(self.store) + page > self.program.target.max_memory


class _Program:
    """A compiled module, its idle instances and what is needed to reload it."""

    def __init__(self, engine: wasmtime.Engine, clock: _EpochClock, target: _Target,
                 reload_interval: float | None) -> None:
        self.engine = engine
        self.clock = clock
        self.target = target
        self.path = Path(target.module)
        self.reload_interval = reload_interval
        self.generation = 0
        self.reloads = 0
        self.faults = 0
        self._idle: list[_Instance] = []
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._checked_at = time.monotonic()
        try:
            self._stamp = self._stat()  # before reading, so a change while compiling is seen
        except OSError as exc:
            raise ValueError(f"cannot read wasm module {target.module}: {exc}") from None
        self._failed_stamp: tuple[int, int, int] | None = None
        self.module, self.wasi = self._compile()
        self.linker = self._linker()

    @property
    def name(self) -> str:
        return f"wasm module {self.target.module} ({self.target.function}, abi v{self.target.abi})"

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _compile(self) -> tuple[wasmtime.Module, bool]:
        target = self.target
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read wasm module {target.module}: {exc}") from None
        try:
            source: str | bytes = data if data[:4] == b"\0asm" else data.decode()
            module = wasmtime.Module(self.engine, source)
        except (wasmtime.WasmtimeError, UnicodeDecodeError) as exc:
            raise ValueError(f"wasm module {target.module} does not compile: "
                             f"{_trap_reason(exc)}") from None
        exports = {e.name: e.type for e in module.exports}
        problems = []
        if not isinstance(exports.get("memory"), wasmtime.MemoryType):
            problems.append("it exports no memory named 'memory'")
        i32, i64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
        for name, params, results in (("alloc", [i32], [i32]),
                                      (target.function, [i32, i32], [i64])):
            ty = exports.get(name)
            if not isinstance(ty, wasmtime.FuncType):
                problems.append(f"it exports no function {name!r}")
            elif ty.params != params or ty.results != results:
                problems.append(
                    f"{name} must be ({', '.join(map(str, params))}) -> "
                    f"{', '.join(map(str, results))}, not ({', '.join(map(str, ty.params))}) "
                    f"-> {', '.join(map(str, ty.results)) or '()'}")
        dealloc = exports.get("dealloc")
        if dealloc is not None and (not isinstance(dealloc, wasmtime.FuncType)
                                    or dealloc.params != [i32, i32] or dealloc.results):
            problems.append("dealloc must be (i32, i32) -> ()")
        foreign = sorted(f"{i.module}.{i.name}" for i in module.imports
                         if i.module not in _WASI_MODULES)
        if foreign:
            problems.append(f"it imports {', '.join(foreign)}; only WASI imports are provided")
        if problems:
            raise ValueError(f"wasm module {target.module} does not follow the kiproxy ABI: "
                             + "; ".join(problems))
        wasi = any(i.module in _WASI_MODULES for i in module.imports)
        return module, wasi

    def _linker(self) -> wasmtime.Linker:
        linker = wasmtime.Linker(self.engine)
        if self.wasi:
            linker.define_wasi()
        return linker

    def maybe_reload(self) -> None:
        """Recompile the module when its file changed (checked at most every interval)."""
        if self.reload_interval is None:
            return
        now = time.monotonic()
        if now - self._checked_at < self.reload_interval:
            return
        if not self._reload_lock.acquire(blocking=False):
            return  # another worker is checking right now
        try:
            self._checked_at = now
            self._reload()
        finally:
            self._reload_lock.release()

    def _reload(self) -> None:
        try:
            stamp = self._stat()
        except OSError as exc:
            if self._failed_stamp != (0, 0, 0):
                log.error("%s: cannot stat the module file (%s); keeping the loaded module",
                          self.name, exc)
                self._failed_stamp = (0, 0, 0)
            return
        if stamp == self._stamp or stamp == self._failed_stamp:
            return
        try:
            module, wasi = self._compile()
        except ValueError as exc:
            log.error("%s changed but cannot be loaded; keeping the previous module: %s",
                      self.name, exc)
            self._failed_stamp = stamp
            return
        with self._lock:
            self.module, self.wasi = module, wasi
            self.linker = self._linker()
            self.generation += 1
            self._idle.clear()
            self._stamp = stamp
            self._failed_stamp = None
            self.reloads += 1
        log.info("%s reloaded (file changed)", self.name)

    def _acquire(self) -> _Instance:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Instance(self)

    def _release(self, instance: _Instance) -> None:
        with self._lock:
            if instance.generation == self.generation:
                self._idle.append(instance)

    def run(self, batch: RecordBatch, deadline: float) -> RecordBatch:
        """Call the module for ``batch``; raise RejectBatch when it or the call fails."""
        self.maybe_reload()
        target = self.target
        where = f"{batch.topic}[{batch.partition}]"
        index = 0
        try:
            instance = self._acquire()
        except _Fault as exc:
            self.faults += 1
            raise self._reject(exc, where, None) from exc
        healthy = False
        try:
            instance.store.set_fuel(target.fuel)
            if target.abi == 1:
                out: list[Record] = []
                changed = False
                for index, record in enumerate(batch.records):
                    result = self._decoded(instance, (record,), batch, deadline)
                    if isinstance(result, str):
                        healthy = True
                        raise RejectBatch(f"{self.name} rejected record {index} of {where}: "
                                          f"{result}", target.error, [(index, result)])
                    if result is None or result[0] is record:
                        out.append(record)
                    else:
                        out.append(result[0])
                        changed = True
                healthy = True
                return batch.with_records(out) if changed else batch
            result = self._decoded(instance, batch.records, batch, deadline)
            healthy = True
            if isinstance(result, str):
                raise RejectBatch(f"{self.name} rejected {where}: {result}", target.error)
            if result is None or all(a is b for a, b in zip(result, batch.records,
                                                            strict=True)):
                return batch
            return batch.with_records(result)
        except _Fault as exc:
            self.faults += 1
            healthy = not exc.reset
            raise self._reject(exc, where, index if target.abi == 1 else None) from exc
        finally:
            if healthy:
                self._release(instance)

    def _decoded(self, instance: _Instance, records: Sequence[Record], batch: RecordBatch,
                 deadline: float) -> tuple[Record, ...] | str | None:
        target = self.target
        payload = encode_input(target.abi, target.encoding, batch.topic, batch.partition,
                               records)
        raw = instance.call(payload, deadline)
        try:
            return decode_result(target.abi, target.encoding, raw, records)
        except _Malformed as exc:
            raise _Fault(f"returned a malformed result: {exc}") from exc

    def _reject(self, fault: _Fault, where: str, index: int | None) -> RejectBatch:
        at = f"record {index} of {where}" if index is not None else where
        message = f"{self.name} {fault.reason} on {at}; batch rejected" + (
            ", instance reset" if fault.reset else "")
        log.warning("%s", message)
        if fault.timed_out:
            return RejectBatch(message, "REQUEST_TIMED_OUT")
        return RejectBatch(message, "INVALID_RECORD")


def _parse_abi(value: Any, where: str) -> int:
    text = str(value).lower().removeprefix("v")
    if text not in ("1", "2"):
        raise ValueError(f"{where}: abi must be 1 (per record) or 2 (per batch), not {value!r}")
    return int(text)


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where} must be a positive integer, not {value!r}")
    return value


def _target(base: Mapping[str, Any], override: Mapping[str, Any], where: str) -> _Target:
    merged = {**base, **override}
    if not merged.get("module"):
        raise ValueError(f"{where}: module (path to a .wasm or .wat file) is required")
    encoding = str(merged.get("encoding", "json")).lower()
    if encoding not in _ENCODINGS:
        raise ValueError(f"{where}: encoding must be json or binary, not {encoding!r}")
    error = str(merged.get("error", "INVALID_RECORD"))
    error_code(error)  # an unknown error name fails at start
    return _Target(
        module=str(merged["module"]),
        function=str(merged.get("function", "transform")),
        abi=_parse_abi(merged.get("abi", 1), f"{where}.abi"),
        encoding=encoding,
        fuel=_positive_int(merged.get("fuel", DEFAULT_FUEL), f"{where}.fuel"),
        max_memory=_positive_int(merged.get("max_memory_bytes", DEFAULT_MAX_MEMORY),
                                 f"{where}.max_memory_bytes"),
        error=error,
    )


class WasmInterceptor(ProduceRequestInterceptor):
    """Runs a WebAssembly module (per topic, optionally) on every batch."""

    def __init__(self) -> None:
        self.default: _Program | None = None
        self.topics: dict[str, _Program] = {}
        self.threaded = True
        self._programs: dict[_Target, _Program] = {}
        self._engine: wasmtime.Engine | None = None
        self._clock: _EpochClock | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Compile every configured module (errors name the key and the file)."""
        unknown = set(config) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(_CONFIG_KEYS))}")
        base = {k: v for k, v in config.items() if k in _TARGET_KEYS}
        topics = config.get("topics") or {}
        if not isinstance(topics, Mapping):
            raise ValueError("topics must be a mapping of topic name to module path or settings")
        if not config.get("module") and not topics:
            raise ValueError("set module (a .wasm or .wat file) or topics")
        interval = config.get("reload_interval_ms", 1000)
        if isinstance(interval, bool) or not isinstance(interval, int):
            raise ValueError(f"reload_interval_ms must be an integer, not {interval!r}")
        reload_interval = None if interval < 0 else interval / 1000
        self.threaded = bool(config.get("threaded", True))
        workers = _positive_int(config.get("workers", 1), "workers")

        wasm_config = wasmtime.Config()
        wasm_config.consume_fuel = True
        wasm_config.epoch_interruption = True
        self._engine = wasmtime.Engine(wasm_config)
        self._clock = _EpochClock(self._engine)

        def program(target: _Target) -> _Program:
            found = self._programs.get(target)
            if found is None:
                assert self._engine is not None and self._clock is not None
                found = _Program(self._engine, self._clock, target, reload_interval)
                self._programs[target] = found
            return found

        if config.get("module"):
            self.default = program(_target(base, {}, "config"))
        for topic, entry in topics.items():
            where = f"topics.{topic}"
            if isinstance(entry, str):
                override: Mapping[str, Any] = {"module": entry}
            elif isinstance(entry, Mapping):
                bad = set(entry) - _TARGET_KEYS
                if bad:
                    raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(bad))}; "
                                     f"known: {', '.join(sorted(_TARGET_KEYS))}")
                override = entry
            else:
                raise ValueError(f"{where} must be a module path or a mapping of settings")
            self.topics[str(topic)] = program(_target(base, override, where))
        if self.threaded:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="kiproxy-wasm")

    @property
    def programs(self) -> list[_Program]:
        """Every loaded module (for stats and tests)."""
        return list(self._programs.values())

    def _program_for(self, topic: str) -> _Program | None:
        return self.topics.get(topic, self.default)

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Run the topic's module on the batch (on a worker thread when ``threaded``)."""
        program = self._program_for(batch.topic)
        if program is None or not batch.records:
            return batch
        if self._executor is None:
            return program.run(batch, ctx.deadline)
        return self._run_threaded(program, batch, ctx.deadline)

    async def _run_threaded(self, program: _Program, batch: RecordBatch,
                            deadline: float) -> RecordBatch:
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, program.run, batch, deadline)

    def close(self) -> None:
        """Stop the worker threads and the epoch clock."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._clock is not None:
            self._clock.close()
