"""``extism`` (``kiproxy.interceptors.builtin.extism:ExtismInterceptor``) - Extism Wasm plugins.

Runs plugins built with Extism's plugin development kits (Rust, Go, JavaScript,
AssemblyScript, C, Zig, .NET, ...) unchanged, per topic, the way the broker-side
Wasm produce interceptor does: the export ``transform`` is called once per
record with the record as JSON and returns the record as JSON (the contract:
:mod:`~kiproxy.interceptors.builtin.extism.records`); a plugin error rejects the
whole batch with the plugin's own message. Needs the ``extism`` host SDK
(``pip install '.[extism]' (from a kiproxy checkout)``).

Config (every key: ``docs/builtin-settings.md``, from :class:`ExtismSettings`)::

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
        pool_size: 2                    # worker threads of each plugin (and its instances)

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

Threads: each plugin's calls run on ``pool_size`` worker threads of its own, in the Wasm
host that the ``wasm`` built-in runs on too
(:class:`~kiproxy.interceptors.builtin.sandbox.SandboxHost`; the Extism runtime releases
the GIL), so a slow plugin never holds the event loop, other connections keep being
served, and a plugin busy on all its threads holds up no other plugin's topics. Each
plugin keeps at most ``pool_size`` instances, reused across batches, each compiled once
(:mod:`.plugin`); an instance serves one batch at a time. Memory held by a plugin is
therefore at most ``pool_size`` times its cap.

Reload: the plugin files are compiled at configure. A proxy reload (file watch
- the plugin and properties files are watched - SIGHUP or ``POST /reload``)
builds a new interceptor; a file that does not load fails the reload and the
running plugins keep serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
    TopicPattern,
    TopicSelector,
)
from kiproxy.interceptors.builtin.extism.records import Binary, non_utf8_fields
from kiproxy.interceptors.builtin.sandbox import (
    DEFAULT_MAX_MEMORY_BYTES,
    SandboxHost,
    file_or_settings,
    inherited,
    refuse_stored_keys,
    runtime_module,
)
from kiproxy.interceptors.settings import ErrorName, SettingsError, parse_settings
from kiproxy.interceptors.topics import topic_regex

__all__ = ["ExtismInterceptor", "ExtismSettings"]


def _plugin_module() -> Any:
    """The module that needs the ``extism`` SDK, or an error naming the extra to install."""
    return runtime_module("kiproxy.interceptors.builtin.extism.plugin",
                          ("extism", "javaproperties"),
                          "the extism interceptor needs the extism host SDK: "
                          "pip install '.[extism]' (from a kiproxy checkout)")


def _config_values(value: Any) -> Any:
    """Extism config values are strings: scalars given otherwise are written as text."""
    if isinstance(value, Mapping):
        return {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}
    return value


_BOTH_CAPS = ("set max_memory_bytes or max_pages, not both (they are the same cap, in bytes "
              "or in 64 KiB pages)")


class ExtismTarget(PluginSettings):
    """A plugin and how it is called; a topic's entry sets any of these keys (a key it
    leaves out but ``plugin`` is the top-level one), or is a plugin file alone."""

    plugin: str | None = None
    """A ``.wasm`` file or an Extism manifest (``.json``); at the top level, the plugin of
    every topic no entry names."""
    function: str = "transform"
    """The per-record export."""
    batch_function: str | None = None
    """An export taking and returning a JSON array of records (used instead, when set)."""
    config: Annotated[dict[str, str], BeforeValidator(_config_values)] = Field(
        default_factory=dict)
    """Extism config values the plugin reads (``Config.get``)."""
    wasi: bool = False
    """Give the plugin WASI (no files, no environment, no network)."""
    timeout_ms: int | None = Field(default=None, gt=0, strict=True)
    """Per call (Extism's manifest ``timeout_ms``); unset: until the batch deadline."""
    max_memory_bytes: int | None = Field(default=None, ge=65536, strict=True)
    """Linear-memory cap per instance; unset: 256 MiB, unless ``max_pages`` is set."""
    max_pages: int | None = Field(default=None, gt=0, strict=True)
    """The cap in 64 KiB pages (manifest ``memory.max_pages``) instead of
    ``max_memory_bytes``: set one of them, not both."""
    binary: Binary = "refuse"
    """Bytes that are not UTF-8: refuse the batch, or hand them to the plugin as base64."""
    error: ErrorName = "POLICY_VIOLATION"
    """The error code of a batch the plugin refuses."""

    def spec(self) -> Any:
        """The plugin's ``PluginSpec`` (``plugin`` is set)."""
        assert self.plugin is not None
        return _plugin_module().PluginSpec(
            source=self.plugin, function=self.function, batch_function=self.batch_function,
            config=tuple(sorted(self.config.items())), wasi=self.wasi,
            timeout_ms=self.timeout_ms, max_pages=self.max_pages,
            max_memory_bytes=(DEFAULT_MAX_MEMORY_BYTES if self.max_memory_bytes is None
                              else self.max_memory_bytes),
            binary=self.binary, error=self.error)


class ExtismPattern(ExtismTarget):
    """A regular expression (matched against the whole topic name) and its plugin."""

    pattern: Annotated[str, AfterValidator(topic_regex)]
    """The regular expression."""


Entry = Annotated[ExtismTarget, BeforeValidator(file_or_settings("plugin", "a plugin file"))]


class ExtismTopics(PluginSettings):
    """Just ``topics``: how a properties file's topics are validated."""

    topics: dict[str, Entry] = Field(default_factory=dict)
    """Exact topic name -> its plugin: a file, or a mapping of the keys below."""


class ExtismSettings(ExtismTarget, ExtismTopics):
    """Settings of ``extism``."""

    patterns: list[ExtismPattern] = Field(default_factory=list)
    """Regular expressions matched against the whole topic name, tried in order after
    ``topics``: ``{pattern, plugin, ...}``."""
    properties: str | None = None
    """A broker-style ``.properties`` file of topics (``topics`` wins over it)."""
    pool_size: int = Field(default=2, gt=0, strict=True)
    """Worker threads of each plugin, and its instances."""

    @model_validator(mode="after")
    def _plugins(self) -> ExtismSettings:
        if not (self.plugin or self.topics or self.patterns or self.properties):
            raise ValueError("set plugin, topics, patterns or properties: no topic has a plugin")
        if self.max_pages is not None and self.max_memory_bytes is not None:
            raise ValueError(_BOTH_CAPS)
        entries = [*((f"topics.{t}", e) for t, e in self.topics.items()),
                   *((f"patterns[{i}]", e) for i, e in enumerate(self.patterns))]
        for where, entry in entries:
            problem = self.merged(entry)[1]
            if problem:
                raise ValueError(f"{where}: {problem}")
        return self

    def merged(self, entry: ExtismTarget) -> tuple[ExtismTarget, str]:
        """``entry`` with the keys it leaves out (but ``plugin``) taken from the top level,
        and what is wrong with it ("" if nothing)."""
        merged = inherited(entry, self, (k for k in ExtismTarget.model_fields if k != "plugin"))
        if not merged.plugin:
            return merged, "plugin (a .wasm file or an Extism manifest) is required"
        if merged.max_pages is not None and merged.max_memory_bytes is not None:
            return merged, _BOTH_CAPS
        return merged, ""


def _read_properties(file: Path) -> dict[str, ExtismTarget]:
    """The topics of a broker-style properties file, validated as ``topics`` entries."""
    from kiproxy.interceptors.builtin.extism.properties import read_properties

    try:
        return parse_settings(ExtismTopics, {"topics": read_properties(file)}).topics
    except SettingsError as exc:
        raise ValueError(f"properties file {file}: {exc}") from None


class ExtismInterceptor(ProduceRequestInterceptor[ExtismSettings]):
    """Runs the topic's Extism plugin on every record of a batch (see the module docstring)."""

    def __init__(self) -> None:
        self.topics: dict[str, Any] = {}
        """Exact topic name -> its plugin."""
        self._host: SandboxHost[Any, Any] | None = None
        self._properties: Path | None = None

    def configure(self, config: ExtismSettings) -> None:
        """Compile every configured plugin (errors name the key and the file)."""
        module = _plugin_module()
        topics: dict[str, ExtismTarget] = {}
        if config.properties:
            self._properties = Path(config.properties)
            topics.update(_read_properties(self._properties))
        topics.update(config.topics)
        workers = config.pool_size
        host: SandboxHost[Any, Any] = SandboxHost(
            lambda spec: module.ExtismPlugin(spec, f"extism plugin {spec.source}", workers),
            workers, thread_name="kiproxy-extism")
        self._host = host

        def plugin(entry: ExtismTarget, where: str) -> Any:
            merged, problem = config.merged(entry)
            if problem:  # a properties file's entry: the settings' own are checked
                raise ValueError(f"{where}: {problem}")
            return host.load(merged.spec())

        self.topics = {t: plugin(e, f"topics.{t}") for t, e in topics.items()}
        host.route([*((TopicPattern.name(t), p) for t, p in self.topics.items()),
                    *((TopicPattern(p.pattern), plugin(p, f"patterns[{i}]"))
                      for i, p in enumerate(config.patterns))],
                   plugin(config, "plugin") if config.plugin else None)

    @property
    def plugins(self) -> TopicSelector[Any]:
        """Every topic's plugin: the exact names, the patterns in order, the default."""
        return self._host.topics if self._host is not None else TopicSelector(())

    @property
    def watched_files(self) -> tuple[Path, ...]:
        """The plugin files and the properties file: a change reloads the proxy."""
        files = self._host.files if self._host is not None else ()
        return files + ((self._properties,) if self._properties else ())

    def plugin_for(self, topic: str) -> Any:
        """The topic's plugin (exact name first, then the patterns in order), or None."""
        return self.plugins.select(topic)

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        """The batch as the topic's plugin returns it (on a worker thread), or RejectBatch."""
        plugin = self.plugin_for(batch.topic)
        if plugin is None or not batch.records:
            return batch
        if plugin.spec.binary == "refuse":
            _refuse_non_utf8(batch)
        refuse_stored_keys(batch, "extism")
        assert self._host is not None
        cancel = _plugin_module().Cancel()
        return self._host.call(plugin, partial(plugin.run, batch, cancel), ctx.deadline,
                               cancel.fire)

    def close(self) -> None:
        """Stop the worker threads (a running call is stopped by its deadline)."""
        if self._host is not None:
            self._host.close()


def _refuse_non_utf8(batch: RecordBatch) -> None:
    problems = [(i, f"{', '.join(bad)} not valid UTF-8") for i, r in enumerate(batch.records)
                if (bad := non_utf8_fields(r))]
    if problems:
        raise RejectBatch(
            f"extism: {len(problems)} record(s) of {batch.topic}[{batch.partition}] hold bytes "
            f"that are not valid UTF-8 (first, record {problems[0][0]}: {problems[0][1]}); "
            "the plugin reads text: set binary: base64 to hand such bytes to it as base64",
            "INVALID_RECORD", problems[:50])
