"""``kiproxy.interceptors.builtin.wasm:WasmInterceptor`` - interceptors compiled to WebAssembly.

A module (``.wasm``, or ``.wat`` text for small examples) is compiled once with
wasmtime and called for every batch, sandboxed: it sees only the bytes the host
writes into its linear memory, may import nothing but WASI (given no files, no
environment and no network), and is bounded by an instruction budget (fuel),
a memory cap and the batch deadline.

Config (every key: ``docs/builtin-settings.md``, from :class:`WasmSettings`)::

    interceptor:
      class: kiproxy.interceptors.builtin.wasm:WasmInterceptor
      timeout_ms: 5000
      config:
        module: examples/wasm/uppercase.wat   # default module (optional when `topics` is set)
        # The next three override what the module declares about itself (see below):
        function: transform                   # exported function (default transform)
        abi: 1                                # 1: one record per call; 2: the whole batch
        encoding: binary                      # json (default) or binary
        topics:                               # per-topic modules (exact topic names)
          orders: orders.wasm                 #   a path, or a mapping that overrides any
          audit: {module: audit.wasm, abi: 2, function: check_batch}   # of the keys above
        fuel: 500000000                       # instruction budget per batch
        max_memory_bytes: 268435456           # linear-memory cap per instance (256 MiB)
        error: INVALID_RECORD                 # error code of rejections the module asks for
        reload_interval_ms: 1000              # stat the file this often; 0: every batch; -1: never
        threaded: true                        # run Wasm on worker threads (see below)
        workers: 1                            # worker threads of each module = its instances

Topics that match neither ``topics`` nor a default ``module`` pass untouched.
Relative paths are resolved against the proxy's working directory.

Self-description: a module declares its entry function, ABI version and
encoding in a ``kiproxy.interceptor`` custom section (see
:mod:`~kiproxy.interceptors.builtin.wasm.declaration`), so ``module:`` alone is
enough; the three config keys override the declaration (logged at start, and
named in a rejection when a call then traps or returns something unreadable).
A module that declares nothing is called with ``transform``, ABI 1, JSON.

ABI (docs/wasm.md has the full description and a worked example). The module
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

Failures: out of fuel, a trap, running out of memory (``max_memory_bytes``,
256 MiB unless set: "... ran out of memory (limit 256 MiB, setting
max_memory_bytes) on record 3 of orders[0]") and a malformed result reject the
batch (INVALID_RECORD) with a message naming the module, the function and the
reason, as a plugin fault (the runtime's own trace is logged at DEBUG); the
instance is thrown away and a fresh one (a new store, nothing compiled) serves the
next batch. After three crashes in a row the module is backed off: for 0.1 s,
doubling with each further crash up to 5 s, its batches are refused at once with
the last reason (:class:`~kiproxy.interceptors.builtin.sandbox.Backoff`). The
batch deadline (``interceptor.timeout_ms``) interrupts a call that is still
running (REQUEST_TIMED_OUT, retriable).

Fuel and the deadline: fuel is deterministic - the same batch always burns the
same fuel - so it is what bounds a runaway module. On a 2-core x86-64 VM a
tight Wasm loop burns about 2x10^9 fuel per second, so the default 5x10^8 per
batch is about 0.25 s of pure Wasm, well inside the default 5 s deadline; keep
``fuel / 2e9 s`` under ``timeout_ms`` on your hardware. The deadline is the
backstop: wasmtime's epoch interruption stops the call at ``ctx.deadline``
(10 ms granularity) so a worker is never held past it.

Threads (``threaded: true``, the default): a plain ``intercept`` runs inline
on the proxy's event loop and cannot be pre-empted (see ``proxy/produce/pipeline.py``),
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

from collections.abc import Awaitable
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    TopicPattern,
    TopicSelector,
)
from kiproxy.interceptors.builtin.sandbox import (
    DEFAULT_MAX_MEMORY_BYTES,
    SandboxHost,
    file_or_settings,
    inherited,
    refuse_stored_keys,
    runtime_module,
)
from kiproxy.interceptors.builtin.wasm.abi import (
    STATUS_OK,
    STATUS_REJECT,
    STATUS_UNCHANGED,
    decode_result,
    encode_input,
)
from kiproxy.interceptors.settings import ErrorName

if TYPE_CHECKING:
    from kiproxy.interceptors.builtin.wasm.engine import EpochClock, Program, Target

__all__ = [
    "STATUS_OK",
    "STATUS_REJECT",
    "STATUS_UNCHANGED",
    "WasmInterceptor",
    "WasmSettings",
    "WasmTarget",
    "decode_result",
    "encode_input",
]

DEFAULT_FUEL = 500_000_000


def _engine() -> Any:
    """The wasmtime-backed engine module, or an error saying how to install wasmtime."""
    return runtime_module("kiproxy.interceptors.builtin.wasm.engine", ("wasmtime",),
                          "the wasm interceptor needs wasmtime: "
                          "pip install '.[wasm]' (from a kiproxy checkout)")


def _abi(value: Any) -> Any:
    """``1``, ``"1"``, ``"v1"`` (any case) as 1; anything else is not an ABI."""
    text = str(value).lower().removeprefix("v")
    if isinstance(value, bool) or text not in ("1", "2"):
        raise ValueError(f"must be 1 (per record) or 2 (per batch), not {value!r}")
    return int(text)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


class WasmTarget(PluginSettings):
    """A module and how it is called; a topic's entry sets any of these keys (a key it
    leaves out is the top-level one), or is a module path alone."""

    module: str | None = None
    """A ``.wasm`` or ``.wat`` file: the default module (optional when ``topics`` is set)."""
    function: str | None = None
    """The exported function; unset: the module's declaration, else ``transform``."""
    abi: Annotated[Literal[1, 2] | None, BeforeValidator(_abi)] = None
    """``1``: one record per call; ``2``: the whole batch. Unset: the module's declaration,
    else 1."""
    encoding: Annotated[Literal["json", "binary"] | None, BeforeValidator(_lower)] = None
    """The bytes the host writes for a call. Unset: the module's declaration, else json."""
    fuel: int = Field(default=DEFAULT_FUEL, gt=0, strict=True)
    """Instruction budget per batch (deterministic: the same batch always burns the same)."""
    max_memory_bytes: int = Field(default=DEFAULT_MAX_MEMORY_BYTES, ge=65536, strict=True)
    """Linear-memory cap per instance (256 MiB); at least one Wasm page (65536)."""
    error: ErrorName = "INVALID_RECORD"
    """The error code of rejections the module asks for."""

    def target(self) -> Target:
        """The engine's description of this module (a module is set)."""
        assert self.module is not None
        return _engine().Target(  # type: ignore[no-any-return]
            module=self.module, function=self.function, abi=self.abi, encoding=self.encoding,
            fuel=self.fuel, max_memory=self.max_memory_bytes, error=self.error)


Entry = Annotated[WasmTarget, BeforeValidator(file_or_settings("module", "a module path"))]


class WasmSettings(WasmTarget):
    """Settings of ``wasm``."""

    topics: dict[str, Entry] = Field(default_factory=dict)
    """Exact topic name -> its module: a path, or a mapping that overrides any of the
    top-level keys above."""
    reload_interval_ms: int = Field(default=1000, ge=-1, strict=True)
    """Stat the module file this often (a change recompiles it); 0: every batch; -1: never."""
    threaded: bool = True
    """Run Wasm on worker threads (``false``: inline on the event loop)."""
    workers: int = Field(default=1, gt=0, strict=True)
    """Worker threads of each module, and its instances."""

    @model_validator(mode="after")
    def _modules(self) -> WasmSettings:
        if not self.module and not self.topics:
            raise ValueError("set module (a .wasm or .wat file) or topics")
        for topic, entry in self.topics.items():
            if not self.module and not entry.module:
                raise ValueError(f"topics.{topic}: module (path to a .wasm or .wat file) is "
                                 "required")
        return self

    def entry(self, topic: str) -> WasmTarget:
        """The topic's entry, with the keys it leaves out taken from the top level."""
        return inherited(self.topics[topic], self, WasmTarget.model_fields)


class WasmInterceptor(ProduceRequestInterceptor[WasmSettings]):
    """Runs a WebAssembly module (per topic, optionally) on every batch."""

    def __init__(self) -> None:
        self._host: SandboxHost[Target, Program] | None = None
        self._clock: EpochClock | None = None

    def configure(self, config: WasmSettings) -> None:
        """Compile every configured module (errors name the key and the file)."""
        interval = config.reload_interval_ms
        reload_interval = None if interval < 0 else interval / 1000
        engine = _engine()
        wasm_engine, self._clock = engine.new_engine()
        clock = self._clock
        host: SandboxHost[Target, Program] = SandboxHost(
            lambda target: engine.Program(wasm_engine, clock, target, reload_interval),
            config.workers, thread_name="kiproxy-wasm", threaded=config.threaded)
        self._host = host
        default = host.load(config.target()) if config.module else None
        host.route(((TopicPattern.name(topic), host.load(config.entry(topic).target()))
                    for topic in config.topics), default)

    @property
    def threaded(self) -> bool:
        """Whether modules run on worker threads (``threaded``), else inline."""
        return self._host is None or self._host.threaded

    @property
    def topics(self) -> TopicSelector[Program]:
        """Each topic's module."""
        return self._host.topics if self._host is not None else TopicSelector(())

    @property
    def programs(self) -> list[Program]:
        """Every loaded module (for stats and tests)."""
        return list(self._host.loaded.values()) if self._host is not None else []

    @property
    def default(self) -> Program | None:
        """The module of topics without one of their own."""
        return self.topics.default

    def _program_for(self, topic: str) -> Program | None:
        return self.topics.select(topic)

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Run the topic's module on the batch (on a worker thread when ``threaded``)."""
        program = self._program_for(batch.topic)
        if program is None or not batch.records:
            return batch
        refuse_stored_keys(batch, "wasm")
        assert self._host is not None
        # No stop: epoch interruption ends a call at the deadline inside the engine.
        return self._host.call(program, partial(program.run, batch, ctx.deadline), ctx.deadline)

    def close(self) -> None:
        """Stop the worker threads and the epoch clock."""
        if self._host is not None:
            self._host.close()
        if self._clock is not None:
            self._clock.close()
