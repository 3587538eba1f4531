"""Running an interceptor over replayed batches, with the proxy's rules.

The interceptor is loaded once per executor process through the same loader
and public API as the proxy (:func:`kiproxy.interceptors.loader.load_interceptor`), and
each batch is judged by the proxy's own verdict function
(:func:`kiproxy.interceptors.verdict.judge_sync`), so a dry run predicts the
proxy exactly: ``RejectBatch`` rejects with its error; any other exception, a
returned batch with another record count, or something that is not a
``RecordBatch`` rejects with INVALID_RECORD; an ``async def intercept`` that
misses ``timeout_ms`` (or a plain one that returns late) rejects with
REQUEST_TIMED_OUT. The answer is the verdict's
:class:`~kiproxy.interceptors.verdict.Outcome`, as the plugin test kit reports it:
``unchanged`` when the records come back equal in every field (offset deltas
included), ``transformed`` otherwise, or ``rejected``.

A replayed batch comes with an :class:`InterceptContext` whose ``client_id`` is
``kiproxy-replay``, ``client_address`` is ``replay``, ``api_version`` is -1 (no
produce request), ``received_at_ms`` is the batch's newest record timestamp,
and ``extra`` holds ``{"replay": True, "offsets": (first, last)}``, so a plugin
can tell a replay from live traffic. In a backfill to a topic (``--output-topic``) the
batch names the output topic, as a proxy in front of that topic would: what the
interceptor does by topic (a key per topic, ciphertext bound to its topic) is done for
the topic the records are written to.

With ``--fetch-hook`` the stored records are first read through that fetch-side hook
(its ``on_consume``, judged by
:func:`~kiproxy.interceptors.consume_verdict.judge_consume` as the proxy's fetch path
judges it, with a :class:`ConsumeContext` whose ``client_id`` is ``kiproxy-replay``):
the interceptor then sees what a consumer through the proxy would read. A refused
batch is reported as rejected with the hook's error code and message. The hook reads
the batch under its source topic.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import inspect
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiproxy.interceptors.api import InterceptContext, RecordBatch
from kiproxy.interceptors.awaiting import within
from kiproxy.interceptors.consume import ConsumeContext, ConsumedBatch, consume_hook
from kiproxy.interceptors.consume_verdict import (
    ConsumeRefusal,
    consume_encodable,
    judge_consume,
)
from kiproxy.interceptors.errors import error_name
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor
from kiproxy.interceptors.verdict import Fault, Outcome, Rejected, encodable, judge_sync
from kiproxy.pipelines.sources import SourceBatch

__all__ = ["InterceptorRunner", "InterceptorSpec", "error_name", "runner_for"]

@dataclass(frozen=True, slots=True)
class InterceptorSpec:
    """Everything an executor needs to load the interceptor (picklable)."""

    spec: str
    """``MODULE:CLASS`` or an entry-point name."""
    config: Mapping[str, Any] = field(default_factory=dict)
    plugins_dir: str | None = None
    """A plugins directory readable where the executors run (local mode)."""
    plugins_archive: str | None = None
    """Name of the plugins archive shipped with ``SparkContext.addArchive`` (cluster mode)."""
    timeout_ms: int = 5000
    fetch_hook: str | None = None
    """A fetch-side hook the stored records are read through first (``--fetch-hook``)."""
    fetch_hook_config: Mapping[str, Any] = field(default_factory=dict)

    def resolved_plugins_dir(self) -> str | None:
        """The plugins directory on this machine (the unpacked archive on an executor)."""
        if self.plugins_archive is not None:
            from pyspark import SparkFiles

            return str(Path(SparkFiles.get(self.plugins_archive)))
        return self.plugins_dir


class InterceptorRunner:
    """One loaded interceptor and the event loop its ``async def intercept`` runs on."""

    def __init__(self, spec: InterceptorSpec) -> None:
        self.spec = spec
        self.name = spec.spec
        self.timeout = spec.timeout_ms / 1000
        self.interceptor = load_interceptor(spec.spec, spec.resolved_plugins_dir(),
                                            dict(spec.config))
        self.reader = None if spec.fetch_hook is None else load_interceptor(
            spec.fetch_hook, spec.resolved_plugins_dir(), dict(spec.fetch_hook_config))
        if self.reader is not None and consume_hook(self.reader) is None:
            raise PluginLoadError(f"--fetch-hook {spec.fetch_hook} has no fetch-side hook "
                                  "(on_consume)")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host = socket.gethostname()

    def close(self) -> None:
        """Run the interceptor's ``close()`` and drop the event loop."""
        for plugin in (self.interceptor, self.reader):
            close = getattr(plugin, "close", None)
            if close is not None:
                result = close()
                if inspect.isawaitable(result):
                    self._run(result, None)
        if self._loop is not None:
            pending = asyncio.all_tasks(self._loop)
            if pending:  # plugin coroutines that ran on past their deadline: let them end
                self._loop.run_until_complete(asyncio.wait(pending, timeout=self.timeout))
            self._loop.close()
            self._loop = None

    def _run(self, awaitable: Any, timeout: float | None) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(within(awaitable, timeout, self.name))

    def apply(self, batch: SourceBatch, *, topic: str | None = None) -> Outcome:
        """The verdict on ``batch``; never raises for anything the plugin does. ``topic``:
        the topic the interceptor is told the batch goes to (a backfill's output topic,
        as a proxy in front of it would tell it); the source's by default. The fetch-side
        hook always reads it as the source's."""
        if self.reader is not None:
            read = self._read_through(batch)
            if isinstance(read, ConsumeRefusal):
                return Outcome.of(Rejected(code=read.code, message=read.message,
                                           fault=_FAULTS.get(read.reason, "raised")))
            batch = dataclasses.replace(batch, records=read.records)
        view = RecordBatch(
            topic=topic or batch.topic, partition=batch.partition, records=batch.records,
            producer_id=batch.producer_id, producer_epoch=batch.producer_epoch,
            base_sequence=batch.base_sequence, transactional=batch.transactional,
            compression=batch.compression,
        )
        ctx = InterceptContext(
            client_id="kiproxy-replay", client_address="replay", principal=None,
            api_version=-1, acks=-1, transactional_id=None,
            deadline=time.monotonic() + self.timeout,
            received_at_ms=max((r.timestamp for r in batch.records), default=0),
            proxy_host=self._host,
            extra={"replay": True, "offsets": (batch.offsets[0], batch.offsets[-1])},
        )
        return Outcome.of(encodable(judge_sync(self.interceptor, view, ctx, name=self.name,
                                               timeout=self.timeout, run=self._run),
                                    view, self.name))


    def _read_through(self, batch: SourceBatch) -> ConsumedBatch | ConsumeRefusal:
        """``batch`` as the fetch-side hook hands it to a consumer, or its refusal."""
        fetched = ConsumedBatch(
            topic=batch.topic, partition=batch.partition, base_offset=batch.offsets[0],
            records=batch.records, producer_id=batch.producer_id,
            producer_epoch=batch.producer_epoch, transactional=batch.transactional,
            compression=batch.compression)
        ctx = ConsumeContext(client_id="kiproxy-replay", client_address="replay",
                             principal=None, api_version=-1,
                             deadline=time.monotonic() + self.timeout, proxy_host=self._host,
                             extra={"replay": True})
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        name = self.spec.fetch_hook or ""
        return consume_encodable(self._loop.run_until_complete(judge_consume(
            self.reader, fetched, ctx, name=name, timeout=self.timeout)), fetched, name)


_FAULTS: dict[str, Fault | None] = {"refused": None, "timeout": "timeout",
                                    "record_count": "record_count",
                                    "output_size": "output_size",
                                    "bad_return": "return_type"}
"""A fetch-side refusal's reason as the report's fault (None: refused by policy)."""

_runners: dict[tuple[str, str, str | None, str | None, int, str | None, str],
               InterceptorRunner] = {}


def runner_for(spec: InterceptorSpec) -> InterceptorRunner:
    """The runner of ``spec`` in this process, loaded on first use and then reused."""
    import json

    key = (spec.spec, json.dumps(dict(spec.config), sort_keys=True, default=str),
           spec.plugins_dir, spec.plugins_archive, spec.timeout_ms, spec.fetch_hook,
           json.dumps(dict(spec.fetch_hook_config), sort_keys=True, default=str))
    runner = _runners.get(key)
    if runner is None:
        runner = _runners[key] = InterceptorRunner(spec)
        atexit.register(_close_quietly, runner)  # the plugin's close() when the worker exits
    return runner


def _close_quietly(runner: InterceptorRunner) -> None:
    with contextlib.suppress(Exception):
        runner.close()
