"""Hostile Extism plugins (``tests/extism/plugins``: grow, huge, trap, novalue) against the
extism interceptor, judged by the proxy's rules through the test kit: every one is
refused with a message naming the plugin and the cause, and none grows the process's
threads or instances without bound."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kiproxy.interceptors.testing import load, make_batch

TOPIC = "hostile"


def plugin(extism_plugins: dict[str, Path], name: str, **settings: Any) -> Any:
    return load("extism", config={"topics": {TOPIC: {"plugin": str(extism_plugins[name]),
                                                     **settings}}})


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_endless_allocation_stops_at_the_default_cap_and_says_so(
        extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "grow") as p:
        out = p.run(make_batch(b"a", topic=TOPIC))
    assert (out.kind, out.error, out.fault) == ("rejected", "INVALID_RECORD", "crashed")
    assert out.message == (
        f"extism plugin {extism_plugins['grow']} ran out of memory (limit 256 MiB, setting "
        f"max_memory_bytes; raise it if the plugin needs more) in transform on record 0 of "
        f"{TOPIC}[0]")


def test_the_cap_is_max_memory_bytes_or_max_pages(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "grow", max_memory_bytes=8 * 2**20) as p:
        assert "ran out of memory (limit 8 MiB, setting max_memory_bytes;" in (
            p.run(make_batch(b"a", topic=TOPIC)).message or "")
    with plugin(extism_plugins, "grow", max_pages=100) as p:
        assert "ran out of memory (limit 6400 KiB, setting max_pages;" in (
            p.run(make_batch(b"a", topic=TOPIC)).message or "")


def test_a_manifests_own_smaller_cap_is_the_one_named(extism_plugins: dict[str, Path],
                                                      tmp_path: Path) -> None:
    manifest = tmp_path / "grow.json"
    manifest.write_text(json.dumps({"wasm": [{"path": str(extism_plugins["grow"])}],
                                    "memory": {"max_pages": 8}}))
    config = {"topics": {TOPIC: {"plugin": str(manifest), "max_memory_bytes": 2**30}}}
    with load("extism", config=config) as p:
        message = p.run(make_batch(b"a", topic=TOPIC)).message or ""
        assert "ran out of memory (limit 512 KiB, setting memory.max_pages of grow.json;" in \
            message
        manifest.write_text('{"wasm": [')  # saved half-way: the running plugin is as loaded
        message = p.run(make_batch(b"a", topic=TOPIC)).message or ""
        assert "ran out of memory (limit 512 KiB, setting memory.max_pages of grow.json;" in \
            message


def test_a_50_mib_answer_is_refused_by_the_output_bound(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "huge") as p:
        out = p.run(make_batch(b"hello", topic=TOPIC))
    assert (out.kind, out.error, out.fault) == ("rejected", "INVALID_RECORD", "output_size")
    assert out.message == ("interceptor extism returned 52428813 bytes of records for 12 bytes "
                           "received; the limit is max_plugin_output_bytes (33554432)")


def test_an_answer_without_value_is_refused_and_an_explicit_null_stored(
        extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "novalue") as p:
        out = p.run(make_batch(b"keep me", b"and me", topic=TOPIC))
    assert (out.kind, out.error, out.fault) == ("rejected", "INVALID_RECORD", "return_type")
    message = (f'extism plugin {extism_plugins["novalue"]} transform: its answer for record 0 '
               'has no "value" (write "value": null to store a null value on purpose)')
    assert (out.message, out.record_errors) == (message, ((0, message),))
    with plugin(extism_plugins, "uppercase") as p:  # writes "value":null for a null value
        assert p.run(make_batch(None, topic=TOPIC)).values == [None]


def test_a_plugin_that_traps_on_every_call_is_backed_off_and_threads_stay_bounded(
        extism_plugins: dict[str, Path]) -> None:
    before = threads()
    with load("extism", config={"pool_size": 2, "topics": {
            TOPIC: str(extism_plugins["trap"])}}) as p:
        name = f"extism plugin {extism_plugins['trap']}"
        messages = [p.run(make_batch(b"a", topic=TOPIC)).message for _ in range(3)]
        assert messages == [f"{name} crashed (a WebAssembly trap) in transform on record 0 "
                            f"of {TOPIC}[0]"] * 3
        refused = p.run(make_batch(b"a", topic=TOPIC))
        assert (refused.error, refused.fault) == ("INVALID_RECORD", "crashed")
        # What happened, not where: the batch refused now may be another topic's.
        assert (refused.message or "").startswith(
            f"{name} crashed (a WebAssembly trap) in transform (it crashed 3 times in a row;"
            " its batches are refused without running it")
        assert f"{TOPIC}[0]" not in (refused.message or "")
        compiled = p.interceptor.topics[TOPIC]
        for _ in range(200):  # through backoff periods and probes alike
            assert p.run(make_batch(b"a", topic=TOPIC)).fault == "crashed"
            time.sleep(0.002)
        assert compiled.slots <= 2, "a slot is compiled once; a crash only re-instantiates"
        assert threads() <= before + 2 + 2 + 1  # kit loop, worker threads, cache threads
    time.sleep(0.5)
    assert threads() <= before + 2


def test_the_plugins_own_words_are_never_taken_for_a_crash(
        extism_plugins: dict[str, Path]) -> None:
    from kiproxy.interceptors import RejectBatch
    from kiproxy.interceptors.builtin.extism.plugin import Cancel
    from kiproxy.interceptors.verdict import PluginFault

    with plugin(extism_plugins, "uppercase") as p:
        compiled = p.interceptor.topics[TOPIC]
        batch = make_batch(b"a", topic=TOPIC)

        def failure(text: str) -> Exception:
            found: Exception = compiled._failure(text, "transform", batch, range(1), Cancel())
            return getattr(found, "fault", found)  # a crash carries its rejection

        for own in ("host unreachable", "value is out of memory range", "oom killer said no"):
            found = failure(own)
            assert type(found) is RejectBatch and found.message == own
        for runtime in ("oom", "error while executing at wasm backtrace:\n 0: 0x1 - f",
                        "wasm trap: wasm `unreachable` instruction executed"):
            assert isinstance(failure(runtime), PluginFault)
