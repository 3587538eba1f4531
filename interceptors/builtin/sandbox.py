"""The WebAssembly host: what runs a plugin, whichever ABI it speaks (``wasm`` or ``extism``).

The two Wasm built-ins are thin adapters over this module: ``wasm`` speaks kiproxy's
own ABI on wasmtime (:mod:`~kiproxy.interceptors.builtin.wasm`), ``extism`` Extism's
ABI through the Extism SDK (:mod:`~kiproxy.interceptors.builtin.extism`). Each
adapter compiles a module, makes instances and moves a batch in and out of them;
the host owns the rest, once.

Contract:

* :class:`SandboxHost` - per-topic plugin selection and the calls: each distinct
  plugin spec is loaded once (:meth:`SandboxHost.load`), topics pick one through the
  shared :class:`~kiproxy.interceptors.topics.TopicSelector`, and a batch's call runs
  on one of its plugin's own ``workers`` threads (the runtimes release the GIL; a
  plugin busy on all of its threads holds up no other plugin) or inline. At the
  batch deadline the wait is given up and the adapter's ``stop`` is fired; the
  call's outcome is then dropped. :meth:`SandboxHost.files` are the plugin files.
* :class:`InstancePool` - idle instances reused across batches, one call each at a
  time; at most ``limit`` exist (a caller past it waits for one to be given back:
  callers are the worker threads, so the wait is short). A crashed instance is
  discarded; a new generation (a reloaded module) drops the old instances.
* :class:`FileWatch` - reload of a changed plugin file: stat'ed at most every
  interval; a changed size, modification time or inode is loaded again, and a file
  that fails to load is not retried until it changes again.
* :data:`DEFAULT_MAX_MEMORY_BYTES` is the linear-memory cap of every Wasm instance
  that its config does not cap otherwise (``max_memory_bytes`` on both ABIs; Extism's
  ``max_pages`` too). A plugin holds at most ``workers`` (``pool_size``) times the cap.
* :class:`Backoff` remembers a plugin's crashes (traps, out of memory, out of fuel).
  From the :data:`BACKOFF_AFTER`-th crash in a row on, the plugin is left alone for a
  period that starts at :data:`BACKOFF_FIRST_S` and doubles with each further crash
  up to :data:`BACKOFF_MAX_S`: meanwhile :meth:`Backoff.refusal` gives the message a
  batch is refused with at once (the last crash's reason), and no instance is built.
  A call that returns (whatever it answers) ends the backoff.
* Records as JSON: :func:`json_bytes` writes a document as compact UTF-8 JSON, and
  bytes (a key, a value, a header value) are spelled one of three ways
  (:data:`SPELLINGS`): ``text`` (UTF-8 text; the Extism ABI's ``binary: refuse``),
  ``base64`` (a base64 string; ``binary: base64``) or ``tagged`` (text when it is
  UTF-8, else ``{"b64": "..."}``; kiproxy's JSON encoding). :func:`read_bytes` reads
  them back, raising the adapter's error class with a message naming ``where``.
* :func:`mib` writes a byte count the way the messages do, :func:`out_of_memory` a call
  the memory cap stopped; :func:`runtime_module` imports an adapter's runtime or says
  which extra to install.
* Settings: a topic's entry is a file alone or a mapping of settings
  (:func:`file_or_settings`), and the keys it leaves out are the top level's
  (:func:`inherited`).

Thread-safe; the standard library and the public API only (the runtimes are imported
by the adapters).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import importlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kiproxy.interceptors.api import RecordBatch, RejectBatch, header_key_text
from kiproxy.interceptors.json_spelling import (
    SPELLINGS,
    Spelling,
    json_bytes,
    read_bytes,
    spell_bytes,
)
from kiproxy.interceptors.topics import TopicPattern, TopicSelector

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["BACKOFF_AFTER", "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "DEFAULT_MAX_MEMORY_BYTES",
           "SPELLINGS", "Backoff", "FileWatch", "InstancePool", "SandboxHost", "Spelling",
           "file_or_settings", "inherited", "json_bytes", "mib", "out_of_memory", "read_bytes",
           "refuse_stored_keys", "runtime_module", "spell_bytes"]

DEFAULT_MAX_MEMORY_BYTES = 256 * 2**20
"""Linear memory of one Wasm instance, at most, unless its config says otherwise."""
BACKOFF_AFTER = 3
"""Crashes in a row before batches are refused without running the plugin: one or two
are the cost of a record that crashes it (the instance is rebuilt for the next batch)."""
BACKOFF_FIRST_S = 0.1
"""The first backoff period; each further crash doubles it."""
BACKOFF_MAX_S = 5.0
"""The longest backoff period."""


def refuse_stored_keys(batch: RecordBatch, runtime: str) -> None:
    """Raise a ``RejectBatch`` (INVALID_RECORD, a record error per record) when a header
    key of ``batch`` is not UTF-8: brokers store such keys as a client sent them, and
    they are read as lone surrogates, but a Wasm plugin's record contract gives header
    keys as text whatever its ``binary``/``encoding`` says."""
    problems: list[tuple[int, str]] = []
    for i, record in enumerate(batch.records):
        for header in record.headers:
            text = header_key_text(header.key)
            if text != header.key:
                problems.append((i, f"header key '{text}' not valid UTF-8"))
                break
    if problems:
        raise RejectBatch(
            f"{runtime}: {len(problems)} record(s) of {batch.topic}[{batch.partition}] have "
            f"a header key that is not valid UTF-8 (first, record {problems[0][0]}: "
            f"{problems[0][1]}); header keys reach the plugin as text", "INVALID_RECORD",
            problems[:50])


def runtime_module(module: str, runtimes: tuple[str, ...], install: str) -> Any:
    """The adapter module that imports a Wasm runtime, imported now; when the runtime (one
    of ``runtimes``) is not installed, ImportError(``install``): what to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in runtimes:
            raise
        raise ImportError(install) from None


def out_of_memory(cap: int, setting: str, what: str) -> str:
    """How a call stopped by the memory cap is described (``what``: plugin, module)."""
    return (f"ran out of memory (limit {mib(cap)}, setting {setting}; raise it if the "
            f"{what} needs more)")


def mib(size: int) -> str:
    """``256 MiB`` (whole MiB), or ``1536 KiB``, or ``100 bytes``."""
    if size >= 2**20 and size % 2**20 == 0:
        return f"{size // 2**20} MiB"
    if size >= 2**10 and size % 2**10 == 0:
        return f"{size // 2**10} KiB"
    return f"{size} bytes"


# -- settings ----------------------------------------------------------------------------

def file_or_settings(key: str, what: str) -> Callable[[Any], Any]:
    """A settings model's before-validator: a file path alone is ``{key: PATH}``, a mapping
    is itself, anything else an error saying the entry is ``what`` or a mapping."""
    def entry(value: Any) -> Any:
        if isinstance(value, str):
            return {key: value}
        if not isinstance(value, Mapping):
            raise ValueError(f"expected {what} or a mapping of settings, got {value!r}")
        return value
    return entry


M = TypeVar("M", bound="BaseModel")


def inherited(entry: M, top: BaseModel, keys: Iterable[str]) -> M:
    """``entry`` with each of ``keys`` it does not set itself taken from ``top``."""
    return entry.model_copy(update={name: getattr(top, name) for name in keys
                                    if name not in entry.model_fields_set})


# -- records as JSON: the spelling of bytes (kiproxy.interceptors.json_spelling) -------

# -- crashes -----------------------------------------------------------------------------

class Backoff:
    """A plugin's crashes in a row and, past :data:`BACKOFF_AFTER`, when it runs again."""

    __slots__ = ("_clock", "_crashes", "_lock", "_reason", "_until")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._crashes = 0
        self._reason = ""
        self._until = 0.0

    @property
    def crashes(self) -> int:
        """Crashes in a row so far."""
        return self._crashes

    def refusal(self) -> str | None:
        """Why a batch is refused now without running the plugin, or None: run it."""
        if not self._until:  # never backed off, or an answer ended it: no lock taken
            return None
        with self._lock:
            left = self._until - self._clock()
            if left <= 0:
                return None
            return (f"{self._reason} (it crashed {self._crashes} times in a row; its "
                    f"batches are refused without running it for {left:.1f} s more)")

    def crashed(self, reason: str) -> None:
        """The plugin crashed with ``reason``: what happened, not on which batch (the
        batches refused while it is backed off are told it, and may be another topic's)."""
        with self._lock:
            self._crashes += 1
            self._reason = reason
            over = self._crashes - BACKOFF_AFTER
            if over >= 0:
                period = min(BACKOFF_FIRST_S * 2 ** min(over, 16), BACKOFF_MAX_S)
                self._until = self._clock() + period

    def answered(self) -> None:
        """A call returned: the crashes in a row are over."""
        if self._crashes:
            with self._lock:
                self._crashes = 0
                self._until = 0.0


# -- instances ---------------------------------------------------------------------------

class Pooled(Protocol):
    """What a pool holds: anything that knows the generation it was made in."""

    @property
    def generation(self) -> int: ...


Inst = TypeVar("Inst", bound=Pooled)


class InstancePool(Generic[Inst]):
    """Idle instances of one plugin, reused across batches (see the module docstring)."""

    __slots__ = ("_cond", "_make", "generation", "idle", "limit", "size")

    def __init__(self, make: Callable[[], Inst], limit: int | None = None,
                 first: Inst | None = None) -> None:
        self._make = make
        self._cond = threading.Condition()
        self.limit = limit
        """Instances that may exist at once (None: as many as calls run at once)."""
        self.generation = 0
        """Bumped by :meth:`renew`; an instance of an older one is not reused."""
        self.idle: list[Inst] = [] if first is None else [first]
        """Instances waiting for a batch (the last given back is taken first)."""
        self.size = len(self.idle)
        """Instances made and not discarded."""

    def take(self) -> Inst:
        """An idle instance, a new one while under ``limit``, else the next given back."""
        with self._cond:
            while True:
                if self.idle:
                    return self.idle.pop()
                if self.limit is None or self.size < self.limit:
                    self.size += 1
                    break
                self._cond.wait()
        try:
            return self._make()
        except BaseException:
            self.discard()
            raise

    def give(self, instance: Inst) -> None:
        """``instance`` is free again: reused, unless the pool was renewed since."""
        with self._cond:
            if instance.generation == self.generation:
                self.idle.append(instance)
            else:
                self.size -= 1
            self._cond.notify()

    def discard(self) -> None:
        """An instance taken is not coming back (it crashed): another may be made."""
        with self._cond:
            self.size -= 1
            self._cond.notify()

    def renew(self) -> None:
        """A new generation (a reloaded module): the idle instances are dropped now, the
        busy ones when given back."""
        with self._cond:
            self.generation += 1
            self.size -= len(self.idle)
            self.idle.clear()
            self._cond.notify_all()

    def drain(self) -> list[Inst]:
        """Take every idle instance out (to free them at close)."""
        with self._cond:
            drained, self.idle = self.idle, []
            self.size -= len(drained)
            return drained


# -- reload ------------------------------------------------------------------------------

Stamp = tuple[int, int, int]
_GONE: Stamp = (0, 0, 0)


def _stamp(path: Path) -> Stamp:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


class FileWatch:
    """A plugin file, stat'ed at most every ``interval`` seconds (None: never)."""

    __slots__ = ("_failed", "_lock", "_stamp", "checked_at", "interval", "path")

    def __init__(self, path: Path, interval: float | None) -> None:
        self.path = path
        self.interval = interval
        self.checked_at = time.monotonic()
        """When the file was last stat'ed."""
        self._lock = threading.Lock()
        self._stamp = _stamp(path)  # OSError: the file cannot be read
        self._failed: Stamp | None = None

    def poll(self, load: Callable[[], bool], unreadable: Callable[[OSError], None]) -> None:
        """When due and the file changed, ``load()`` it (True: loaded); a stamp that
        failed, or a file that cannot be stat'ed (``unreadable``, said once), waits
        for the next change. One caller looks at a time; the others go on."""
        if self.interval is None or time.monotonic() - self.checked_at < self.interval:
            return
        if not self._lock.acquire(blocking=False):
            return  # another worker is looking right now
        try:
            self.checked_at = time.monotonic()
            try:
                stamp = _stamp(self.path)
            except OSError as exc:
                if self._failed != _GONE:
                    unreadable(exc)
                    self._failed = _GONE
                return
            if stamp == self._stamp or stamp == self._failed:
                return
            if load():
                self._stamp, self._failed = stamp, None
            else:
                self._failed = stamp
        finally:
            self._lock.release()


# -- the host ----------------------------------------------------------------------------

class Plugin(Protocol):
    """What the host asks of an adapter's loaded plugin."""

    @property
    def files(self) -> tuple[Path, ...]:
        """The files it was loaded from."""
        ...

    def close(self) -> None:
        """Free its instances."""


K = TypeVar("K", bound=Hashable)
P = TypeVar("P", bound=Plugin)


class SandboxHost(Generic[K, P]):
    """Plugins loaded once per spec, chosen per topic, called on worker threads under the
    batch deadline (see the module docstring)."""

    def __init__(self, build: Callable[[K], P], workers: int, *, thread_name: str,
                 threaded: bool = True) -> None:
        self._build = build
        self.loaded: dict[K, P] = {}
        """Every plugin, by the spec it was loaded from."""
        self.topics: TopicSelector[P] = TopicSelector(())
        """Each topic's plugin (:meth:`route`)."""
        self._workers = workers
        self._thread_name = thread_name
        self._threaded = threaded
        self._executors: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        """Each plugin's own worker threads (by the plugin's id; the plugins are kept in
        :attr:`loaded`): a plugin that loops holds its own threads, not another's."""

    @property
    def threaded(self) -> bool:
        """Whether calls run on worker threads (else inline, on the caller's thread)."""
        return self._threaded

    def _executor_of(self, plugin: P) -> concurrent.futures.ThreadPoolExecutor:
        executor = self._executors.get(id(plugin))
        if executor is None:
            executor = self._executors[id(plugin)] = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._workers,
                thread_name_prefix=f"{self._thread_name}-{len(self._executors)}")
        return executor

    def load(self, spec: K) -> P:
        """The plugin of ``spec``, loaded the first time it is asked for."""
        found = self.loaded.get(spec)
        if found is None:
            found = self.loaded[spec] = self._build(spec)
        return found

    def route(self, entries: Iterable[tuple[TopicPattern, P]], default: P | None) -> None:
        """Which topic runs which plugin: the first pattern that matches, else ``default``."""
        self.topics = TopicSelector(entries, default)

    @property
    def files(self) -> tuple[Path, ...]:
        """Every plugin's files."""
        return tuple(f for plugin in self.loaded.values() for f in plugin.files)

    def call(self, plugin: P, run: Callable[[], RecordBatch], deadline: float,
             stop: Callable[[], None] | None = None) -> RecordBatch | Awaitable[RecordBatch]:
        """``run()``'s batch (a call of ``plugin``): inline, or awaited on one of
        ``plugin``'s worker threads; ``stop`` is fired at ``deadline``
        (``time.monotonic``) or when the caller gives up."""
        if not self._threaded:
            return run()
        return self._on_thread(self._executor_of(plugin), run, deadline, stop)

    async def _on_thread(self, executor: concurrent.futures.ThreadPoolExecutor,
                         run: Callable[[], RecordBatch], deadline: float,
                         stop: Callable[[], None] | None) -> RecordBatch:
        loop = asyncio.get_running_loop()
        # In a copy of the caller's context, as asyncio.to_thread runs a call: the verdict's
        # output_limits() reach the plugin on the thread.
        future = loop.run_in_executor(executor, contextvars.copy_context().run, run)
        if stop is None:
            return await future
        timer = loop.call_later(max(deadline - time.monotonic(), 0), stop)
        # Given up on at the deadline, the call still ends (stopped): its outcome is dropped.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            stop()  # the caller gave up (its deadline): stop the call
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        """Stop the worker threads (a running call is stopped by its deadline) and free
        the plugins."""
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for plugin in self.loaded.values():
            plugin.close()
