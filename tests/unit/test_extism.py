"""The extism interceptor with real Extism plugins (AssemblyScript, compiled by the
``extism_plugins`` fixture), judged by the proxy's rules through the test kit."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import Header
from kiproxy.interceptors.builtin.extism.properties import read_properties
from kiproxy.interceptors.testing import load, make_batch, make_record, run_interceptor

TOPIC = "test-topic"


def plugin(extism_plugins: dict[str, Path], name: str, **settings: Any) -> Any:
    return load("extism", config={"topics": {TOPIC: {"plugin": str(extism_plugins[name]),
                                                     **settings}}})


def test_uppercase_keeps_keys_headers_in_order_and_timestamps(
        extism_plugins: dict[str, Path]) -> None:
    headers = [Header("h", b"one"), Header("n", None), Header("h", b"two \xc3\xa9")]
    records = [make_record(b'hello "kafka" \\ \xc3\xa9', key=b"k1", headers=headers,
                           timestamp=1_700_000_000_123, offset_delta=0),
               make_record(None, key=None, timestamp=1_700_000_000_456, offset_delta=1),
               make_record(b"", key=b"", timestamp=1_700_000_000_789, offset_delta=2)]
    for settings in ({}, {"batch_function": "transform_batch"}):
        with plugin(extism_plugins, "uppercase", **settings) as p:
            out = p.run(make_batch(records=records, topic=TOPIC))
        assert out.kind == "transformed", out.message
        assert [(r.key, r.value, r.headers, r.timestamp, r.offset_delta) for r in out.records] == [
            (b"k1", b'HELLO "KAFKA" \\ \xc3\xa9', tuple(headers), 1_700_000_000_123, 0),
            (None, None, (), 1_700_000_000_456, 1), (b"", b"", (), 1_700_000_000_789, 2)]


def test_other_topics_pass_untouched(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "uppercase") as p:
        assert p.run(make_batch(b"quiet", topic="other")).kind == "unchanged"


def test_the_plugins_own_error_rejects_the_batch_with_its_message(
        extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "shouting") as p:
        assert p.run(make_batch(b"calm", b"still calm", topic=TOPIC)).kind == "unchanged"
        out = p.run(make_batch(b"calm", b"LOUD", topic=TOPIC))
    assert (out.kind, out.error) == ("rejected", "POLICY_VIOLATION")
    assert out.message == "stop shouting, you are hurting my ears"
    assert out.record_errors == ((1, "stop shouting, you are hurting my ears"),)


def test_two_records_for_one_breaks_the_record_count_rule(
        extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "twice") as p:
        out = p.run(make_batch(b"a", b"b", topic=TOPIC))
    assert (out.kind, out.fault) == ("rejected", "record_count")
    assert "returned 4 records for a batch of 2" in (out.message or "")


def test_config_values_reach_the_plugin(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "config", config={"greeting": "hej"}) as p:
        assert p.run(make_batch(b"a", topic=TOPIC)).values == [b"hej"]
    with plugin(extism_plugins, "config") as p:
        out = p.run(make_batch(b"a", topic=TOPIC))
    assert (out.kind, out.message) == ("rejected", "config value greeting is not set")


def test_an_infinite_loop_is_stopped_by_timeout_ms_and_the_deadline(
        extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "loop", timeout_ms=200) as p:
        out = p.run(make_batch(b"x", topic=TOPIC))
        assert (out.kind, out.error) == ("rejected", "INVALID_RECORD")
        assert "loop.wasm ran past its timeout_ms (200 ms) in transform on record 0 of " \
            "test-topic[0]" in (out.message or "")
    with plugin(extism_plugins, "loop") as p:  # no timeout_ms: the batch deadline stops it
        out = p.run(make_batch(b"x", topic=TOPIC), timeout_ms=300)
        assert (out.kind, out.error) == ("rejected", "REQUEST_TIMED_OUT")
        # The stopped call freed its worker: the next batch is judged, and stopped, too.
        assert p.run(make_batch(b"y", topic=TOPIC), timeout_ms=300).error == "REQUEST_TIMED_OUT"


def test_max_pages_stops_a_plugin_that_needs_more_memory(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "uppercase", max_pages=4) as p:
        assert p.run(make_batch(b"small", topic=TOPIC)).values == [b"SMALL"]
        out = p.run(make_batch(b"x" * 400_000, topic=TOPIC))
        assert (out.kind, out.error) == ("rejected", "INVALID_RECORD")
        assert "ran out of memory (limit 256 KiB, setting max_pages" in (out.message or "")
        assert p.run(make_batch(b"small again", topic=TOPIC)).values == [b"SMALL AGAIN"]


def test_non_utf8_is_refused_or_passed_as_base64(extism_plugins: dict[str, Path]) -> None:
    batch = make_batch(b"fine", make_record(b"\x80abc", headers=[("h", b"\x80")]), topic=TOPIC)
    with plugin(extism_plugins, "uppercase") as p:
        out = p.run(batch)
    assert (out.kind, out.error) == ("rejected", "INVALID_RECORD")
    assert out.record_errors == ((1, "value, header 'h' not valid UTF-8"),)
    # base64: the bytes reach the plugin intact (the validator returns them as they came).
    with plugin(extism_plugins, "shouting", binary="base64") as p:
        assert p.run(batch).kind == "unchanged"


def test_a_stored_header_key_that_is_not_utf8_is_refused_in_either_rule(
        extism_plugins: dict[str, Path]) -> None:
    """Brokers store header keys whatever their bytes; the record contract gives keys as
    text, so a key that is not UTF-8 (read as lone surrogates) is refused by name rather
    than failing in the JSON writer."""
    key = b"\xffk".decode("utf-8", "surrogateescape")
    batch = make_batch(b"fine", make_record(b"abc", headers=[(key, b"v"), ("h", b"w")]),
                       topic=TOPIC)
    for binary in ("refuse", "base64"):
        with plugin(extism_plugins, "uppercase", binary=binary) as p:
            out = p.run(batch)
        assert (out.kind, out.error) == ("rejected", "INVALID_RECORD")
        assert out.record_errors == ((1, "header key '\\xffk' not valid UTF-8"),)
        assert "header keys reach the plugin as text" in (out.message or "")


def test_a_topic_in_the_answer_must_be_the_batchs(extism_plugins: dict[str, Path]) -> None:
    from kiproxy.interceptors.builtin.extism.records import ContractError, decode_records

    original = make_record(b"v")
    assert decode_records(b'{"value": "w"}', [original], "t", "refuse", "p")[0].value == b"w"
    with pytest.raises(ContractError, match="names topic 'elsewhere'"):
        decode_records(b'{"topic": "elsewhere", "value": "w"}', [original], "t", "refuse", "p")


def test_patterns_and_the_properties_file(extism_plugins: dict[str, Path],
                                          tmp_path: Path) -> None:
    shutil_copy = tmp_path / "up.wasm"
    shutil_copy.write_bytes(extism_plugins["uppercase"].read_bytes())
    props = tmp_path / "broker.properties"
    props.write_text("broker.id=1\nproduce.request.interceptor.wasm.topics=test-topic, b.c\n"
                     "produce.request.interceptor.wasm.test-topic.path=up.wasm\n"
                     f"produce.request.interceptor.wasm.b.c.path={extism_plugins['config']}\n"
                     "produce.request.interceptor.wasm.b.c.config.greeting=hi\n")
    assert read_properties(props)["test-topic"] == {"plugin": str(shutil_copy)}
    with load("extism", config={"properties": str(props), "patterns": [
            {"pattern": "logs-.*", "plugin": str(extism_plugins["uppercase"])}]}) as p:
        assert p.run(make_batch(b"a", topic=TOPIC)).values == [b"A"]
        assert p.run(make_batch(b"a", topic="b.c")).values == [b"hi"]
        assert p.run(make_batch(b"a", topic="logs-1")).values == [b"A"]
        assert p.run(make_batch(b"a", topic="logs")).kind == "unchanged"
        assert set(p.interceptor.watched_files) >= {shutil_copy, props}
    props.write_text("produce.request.interceptor.wasm.topics=t\n"
                     "produce.request.interceptor.wasm.t.paht=x.wasm\n")
    with pytest.raises(ValueError,
                       match=r"unknown key produce\.request\.interceptor\.wasm\.t\.paht"):
        read_properties(props)


def test_a_file_that_does_not_load_is_refused_naming_it(tmp_path: Path) -> None:
    from kiproxy.interceptors.loader import PluginLoadError

    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"\0asm garbage")
    with pytest.raises(PluginLoadError, match=r"extism plugin .*bad\.wasm does not load"):
        load("extism", config={"topics": {TOPIC: str(bad)}})


def test_instances_are_pooled_and_never_shared(extism_plugins: dict[str, Path]) -> None:
    with plugin(extism_plugins, "uppercase", batch_function="transform_batch") as p:
        interceptor = p.interceptor
        errors: list[Any] = []

        def work(n: int) -> None:
            for i in range(20):
                out = run_interceptor(p, make_batch(f"t{n}-{i}", topic=TOPIC))
                if out.values != [f"T{n}-{i}".encode()]:
                    errors.append(out)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # At most one instance per worker thread (pool_size, 2), reused across batches.
        compiled = interceptor.topics[TOPIC]
        assert 1 <= compiled.slots <= 2


def test_kiproxy_check_runs_an_extism_plugin_over_samples(
        extism_plugins: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kiproxy.interceptors.check import main

    sample = tmp_path / "sample.jsonl"
    sample.write_text('{"key": "k", "value": "hello", "headers": [["h", "1"], ["h", "2"]]}\n'
                      '{"value": "LOUD"}\n')
    for name, status, line in (
            ("uppercase", 0, 'record 0: {"key": "k", "value": "HELLO", "headers": [["h", "1"], '
                             '["h", "2"]]'),
            ("shouting", 2, "rejected with POLICY_VIOLATION (44): stop shouting, you are "
                            "hurting my ears")):
        config = json.dumps({"plugin": str(extism_plugins[name])})
        assert main(["extism", "--config", config, "--sample", str(sample),
                     "--fail-on-reject"]) == status
        assert line in capsys.readouterr().out


def test_replay_runs_an_extism_plugin_as_the_proxy_does(extism_plugins: dict[str, Path]) -> None:
    from kiproxy.interceptors import Record
    from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec
    from kiproxy.pipelines.sources import SourceBatch

    def batch(*values: bytes) -> SourceBatch:
        return SourceBatch(topic=TOPIC, partition=0, offsets=tuple(range(len(values))),
                           records=tuple(Record(value=v, timestamp=5, offset_delta=i)
                                         for i, v in enumerate(values)), stored=True)

    runner = InterceptorRunner(InterceptorSpec(
        "extism", {"plugin": str(extism_plugins["shouting"])}, timeout_ms=2000))
    try:
        assert runner.apply(batch(b"calm")).kind == "unchanged"
        out = runner.apply(batch(b"calm", b"LOUD"))
        assert (out.kind, out.message, out.record_errors) == (
            "rejected", "stop shouting, you are hurting my ears",
            ((1, "stop shouting, you are hurting my ears"),))
    finally:
        runner.close()


def test_a_trap_rejects_the_batch_as_a_runtime_failure(tmp_path: Path) -> None:
    import wasmtime

    trap = tmp_path / "trap.wasm"
    trap.write_bytes(wasmtime.wat2wasm('(module (func (export "transform") (result i32) '
                                       "unreachable))"))
    with load("extism", config={"plugin": str(trap)}) as p:
        out = p.run(make_batch(b"a", topic=TOPIC))
    assert (out.kind, out.error, out.fault) == ("rejected", "INVALID_RECORD", "crashed")
    assert out.message == (f"extism plugin {trap} crashed (a WebAssembly trap) in transform "
                           f"on record 0 of {TOPIC}[0]")


def test_an_instance_that_grew_over_earlier_batches_is_replaced_not_the_batch_refused(
        extism_plugins: dict[str, Path]) -> None:
    """AssemblyScript's ``--runtime stub`` (the test plugins' build) frees nothing, so an
    instance grows with every call; once it outgrows the cap, the batch runs again on a
    fresh instance instead of being refused. A batch too big on its own still is."""
    with plugin(extism_plugins, "uppercase", max_pages=64) as p:  # 4 MiB
        for i in range(60):  # tens of MiB allocated over the run
            out = p.run(make_batch(b"x" * 100_000, topic=TOPIC))
            assert out.kind == "transformed", (i, out.message)
        too_big = p.run(make_batch(b"y" * 8_000_000, topic=TOPIC))
        assert too_big.kind == "rejected" and "ran out of memory" in (too_big.message or "")
