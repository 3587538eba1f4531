"""``extism`` (``kiproxy.interceptors.builtin.extism:ExtismInterceptor``) - Extism Wasm plugins.

Runs plugins built with Extism's plugin development kits (Rust, Go, JavaScript,
AssemblyScript, C, Zig, .NET, ...) unchanged, per topic, the way the broker-side
Wasm produce interceptor does: the export ``transform`` is called once per
record with the record as JSON and returns the record as JSON (the contract:
:mod:`~kiproxy.interceptors.builtin.extism.records`); a plugin error rejects the
whole batch with the plugin's own message. Needs the ``extism`` host SDK
(``pip install '.[extism]' (from a kiproxy checkout)``).

Config::

    interceptor:
      class: extism
      timeout_ms: 5000                  # the batch deadline: stops a running call
      config:
        topics:                         # exact topic names: a plugin file, or settings
          orders: plugins/orders.wasm
          audit: {plugin: audit.json, function: check, config: {level: strict}}
        patterns:                       # regexes matched against the whole topic name,
          - {pattern: "logs\\\\..*", plugin: redact.wasm}   # tried in order after `topics`
        properties: broker.properties   # broker-style topics (read_properties); `topics` wins
        plugin: default.wasm            # optional: the plugin of every other topic
        # Defaults for every topic (each may be set per topic too):
        function: transform             # the per-record export
        batch_function: transform_batch # optional: an export taking a JSON array of records
        config: {}                      # Extism config values (strings)
        wasi: false
        timeout_ms: 1000                # per call (Extism's manifest timeout_ms)
        max_memory_bytes: 268435456     # linear-memory cap per instance (the default, 256 MiB)
        # max_pages: 4096               # or the cap in 64 KiB pages (manifest memory.max_pages)
        binary: refuse                  # non-UTF-8 bytes: refuse the batch, or base64
        error: POLICY_VIOLATION         # the code of a batch the plugin refuses
        pool_size: 2                    # worker threads (and instances per plugin)

A plugin is a ``.wasm`` file or an Extism manifest (``.json``). Topics that match
nothing pass untouched. Relative paths are resolved against the proxy's working
directory (in a properties file, against the file's folder).

Errors: the plugin's own error (Extism ``error_set`` with a non-zero return)
rejects the batch with ``error`` and the plugin's message as the partition's
message and as the record error of the record that caused it. A trap, a
``timeout_ms`` overrun or running out of memory (``max_memory_bytes``, default
256 MiB, or ``max_pages``) reject it with INVALID_RECORD, "extism plugin FILE ran
out of memory (limit 256 MiB, setting max_memory_bytes; ...) in transform on record
0 of orders[0]" (the runtime's own text is logged at DEBUG); the instance is freed. After
three such crashes in a row the plugin is backed off: for 0.1 s, doubling with each
further crash up to 5 s, its batches are refused at once with the last reason and
nothing is instantiated (:class:`~kiproxy.interceptors.builtin.sandbox.Backoff`).
An answer that breaks the contract (not JSON, no ``"value"``, another topic) is
INVALID_RECORD naming the record. The batch deadline stops a running call through
Extism's cancel handle (REQUEST_TIMED_OUT). Returning another number of records,
or more bytes than the proxy's ``max_plugin_output_*`` allow, is the verdict's
rejection, as for every interceptor.

Threads: calls run on ``pool_size`` worker threads (the Extism runtime releases
the GIL), so a slow plugin never holds the event loop and other connections
keep being served. Each plugin keeps at most ``pool_size`` instances, reused
across batches, each compiled once (:mod:`.plugin`); an instance serves one batch
at a time. Memory held by a plugin is therefore at most ``pool_size`` times its cap.

Reload: the plugin files are compiled at configure. A proxy reload (file watch
- the plugin and properties files are watched - SIGHUP or ``POST /reload``)
builds a new interceptor; a file that does not load fails the reload and the
running plugins keep serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
    error_code,
)
from kiproxy.interceptors.builtin.extism.records import BINARY_RULES, non_utf8_fields
from kiproxy.interceptors.builtin.sandbox import DEFAULT_MAX_MEMORY_BYTES
from kiproxy.interceptors.config_keys import check_keys

__all__ = ["ExtismInterceptor"]

_SPEC_KEYS = {"function", "batch_function", "config", "wasi", "timeout_ms", "max_pages",
              "max_memory_bytes", "binary", "error"}
_TOPIC_KEYS = _SPEC_KEYS | {"plugin"}
_CONFIG_KEYS = _SPEC_KEYS | {"plugin", "topics", "patterns", "properties", "pool_size"}


def _plugin_module() -> Any:
    """The module that needs the ``extism`` SDK, or an error naming the extra to install."""
    try:
        from kiproxy.interceptors.builtin.extism import plugin
    except ModuleNotFoundError as exc:
        if exc.name not in ("extism", "javaproperties"):
            raise
        raise ImportError("the extism interceptor needs the extism host SDK: "
                          "pip install '.[extism]' (from a kiproxy checkout)") from None
    return plugin


def _positive(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where} must be a positive integer, not {value!r}")
    return value


def _spec(defaults: Mapping[str, Any], entry: Any, where: str) -> Any:
    if isinstance(entry, str):
        entry = {"plugin": entry}
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a plugin file or a mapping of settings")
    check_keys(entry, _TOPIC_KEYS, f"{where}: ")
    merged = {**defaults, **entry}
    if not merged.get("plugin"):
        raise ValueError(f"{where}: plugin (a .wasm file or an Extism manifest) is required")
    config = merged.get("config") or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}.config must map names to values")
    binary = str(merged.get("binary", "refuse"))
    if binary not in BINARY_RULES:
        raise ValueError(f"{where}.binary must be refuse or base64, not {binary!r}")
    error = str(merged.get("error", "POLICY_VIOLATION"))
    error_code(error)  # an unknown error name fails at start
    timeout = merged.get("timeout_ms")
    pages = merged.get("max_pages")
    memory = merged.get("max_memory_bytes")
    if pages is not None and memory is not None:
        raise ValueError(f"{where}: set max_memory_bytes or max_pages, not both (they are "
                         "the same cap, in bytes or in 64 KiB pages)")
    batch_function = merged.get("batch_function")
    return _plugin_module().PluginSpec(
        source=str(merged["plugin"]), function=str(merged.get("function", "transform")),
        batch_function=None if batch_function is None else str(batch_function),
        config=tuple(sorted((str(k), str(v)) for k, v in config.items())),
        wasi=bool(merged.get("wasi", False)),
        timeout_ms=None if timeout is None else _positive(timeout, f"{where}.timeout_ms"),
        max_pages=None if pages is None else _positive(pages, f"{where}.max_pages"),
        max_memory_bytes=(DEFAULT_MAX_MEMORY_BYTES if memory is None
                          else _positive(memory, f"{where}.max_memory_bytes")),
        binary=binary, error=error)


class ExtismInterceptor(ProduceRequestInterceptor):
    """Runs the topic's Extism plugin on every record of a batch (see the module docstring)."""

    def __init__(self) -> None:
        self.topics: dict[str, Any] = {}
        self.patterns: list[tuple[re.Pattern[str], Any]] = []
        self._plugins: dict[Any, Any] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._properties: Path | None = None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Compile every configured plugin (errors name the key and the file)."""
        check_keys(config, _CONFIG_KEYS)
        module = _plugin_module()
        defaults = {k: v for k, v in config.items() if k in _SPEC_KEYS}
        topics: dict[str, Any] = {}
        if config.get("properties"):
            from kiproxy.interceptors.builtin.extism.properties import read_properties

            self._properties = Path(str(config["properties"]))
            topics.update(read_properties(self._properties))
        given = config.get("topics") or {}
        if not isinstance(given, Mapping):
            raise ValueError("topics must map topic names to a plugin file or settings")
        topics.update(given)
        patterns = config.get("patterns") or []
        if not isinstance(patterns, list):
            raise ValueError("patterns must be a list of {pattern: REGEX, plugin: FILE, ...}")
        if config.get("plugin"):
            patterns = [*patterns, {"pattern": ".*", "plugin": config["plugin"]}]
        if not topics and not patterns:
            raise ValueError("set plugin, topics, patterns or properties: no topic has a plugin")
        workers = _positive(config.get("pool_size", 2), "pool_size")

        def plugin(entry: Any, where: str) -> Any:
            spec = _spec(defaults, entry, where)
            found = self._plugins.get(spec)
            if found is None:
                found = self._plugins[spec] = module.ExtismPlugin(
                    spec, f"extism plugin {spec.source}", workers)
            return found

        for topic, entry in topics.items():
            self.topics[str(topic)] = plugin(entry, f"topics.{topic}")
        for i, entry in enumerate(patterns):
            where = f"patterns[{i}]"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("pattern"), str):
                raise ValueError(f"{where} must be a mapping with pattern (a regex) and plugin")
            try:
                regex = re.compile(entry["pattern"])
            except re.error as exc:
                raise ValueError(f"{where}.pattern {entry['pattern']!r}: {exc}") from None
            rest = {k: v for k, v in entry.items() if k != "pattern"}
            self.patterns.append((regex, plugin(rest, where)))
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kiproxy-extism")

    @property
    def watched_files(self) -> tuple[Path, ...]:
        """The plugin files and the properties file: a change reloads the proxy."""
        files = [f for p in self._plugins.values() for f in p.files]
        return tuple(files + ([self._properties] if self._properties else []))

    def plugin_for(self, topic: str) -> Any:
        """The topic's plugin (exact name first, then the patterns in order), or None."""
        found = self.topics.get(topic)
        if found is None:
            found = next((p for regex, p in self.patterns if regex.fullmatch(topic)), None)
        return found

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        """The batch as the topic's plugin returns it (on a worker thread), or RejectBatch."""
        plugin = self.plugin_for(batch.topic)
        if plugin is None or not batch.records:
            return batch
        if plugin.spec.binary == "refuse":
            _refuse_non_utf8(batch)
        return self._run(plugin, batch, ctx.deadline)

    async def _run(self, plugin: Any, batch: RecordBatch, deadline: float) -> RecordBatch:
        assert self._executor is not None
        loop = asyncio.get_running_loop()
        cancel = _plugin_module().Cancel()
        timer = loop.call_later(max(deadline - time.monotonic(), 0), cancel.fire)
        future = loop.run_in_executor(self._executor, plugin.run, batch, cancel)
        # Given up on at the deadline, the call still ends (stopped): its outcome is dropped.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.fire()  # the caller gave up (its deadline): stop the call
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        """Stop the worker threads (a running call is stopped by its deadline)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for plugin in self._plugins.values():
            plugin.close()


def _refuse_non_utf8(batch: RecordBatch) -> None:
    problems = [(i, f"{', '.join(bad)} not valid UTF-8") for i, r in enumerate(batch.records)
                if (bad := non_utf8_fields(r))]
    if problems:
        raise RejectBatch(
            f"extism: {len(problems)} record(s) of {batch.topic}[{batch.partition}] hold bytes "
            f"that are not valid UTF-8 (first, record {problems[0][0]}: {problems[0][1]}); "
            "the plugin reads text: set binary: base64 to hand such bytes to it as base64",
            "INVALID_RECORD", problems[:50])
