"""WasmInterceptor through the interceptor API: ABIs, encodings, faults, deadline, reload.

The modules are the shipped WAT examples (examples/wasm/) and test modules in
tests/wasm/ (echo.wat returns its input; faults.wat fails in every way a module
can), plus a few tiny modules written inline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import Header, InterceptContext, Record, RecordBatch, RejectBatch
from kiproxy.interceptors.builtin.wasm import (
    STATUS_OK,
    WasmInterceptor,
    decode_result,
    encode_input,
)
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    PluginFault,
    Rejected,
    Unchanged,
    judge,
    output_limits,
    output_size,
)

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
UPPERCASE = ROOT / "examples" / "wasm" / "uppercase.wat"
REJECT_SHOUTING = ROOT / "examples" / "wasm" / "reject_shouting.wat"
ECHO = TESTS / "wasm" / "echo.wat"
FAULTS = TESTS / "wasm" / "faults.wat"

INVALID_RECORD = 87
POLICY_VIOLATION = 44
REQUEST_TIMED_OUT = 7

# Keys and values null and binary, repeated header keys in order, null header values.
RECORDS = (
    Record(key=b"k0", value=b"hello world", headers=[("h", b"1"), ("h", b"2"), ("n", None)],
           timestamp=1_700_000_000_123, offset_delta=0),
    Record(key=None, value=b"MiXeD 42", headers=[], timestamp=1_700_000_000_124, offset_delta=1),
    Record(key=b"k2", value=None, headers=[("only", b"")], timestamp=5, offset_delta=2),
    Record(key=b"\x00\xff", value=b"\xff\xfe binary \x00",
           headers=[("b", b"\x80"), ("\u00e9", b"x")], timestamp=-1, offset_delta=3),
)

_OPEN: list[WasmInterceptor] = []


@pytest.fixture(autouse=True)
def _close_interceptors() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def ctx(seconds: float = 5.0) -> InterceptContext:
    """A context whose deadline is ``seconds`` away."""
    return InterceptContext(client_id="test", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + seconds)


def batch(records: tuple[Record, ...] = RECORDS, topic: str = "orders") -> RecordBatch:
    return RecordBatch(topic=topic, partition=3, records=records)


def wasm(threaded: bool = False, **config: Any) -> WasmInterceptor:
    """A configured WasmInterceptor (inline calls unless ``threaded``)."""
    plugin = WasmInterceptor()
    plugin.configure({"threaded": threaded, **{k: str(v) if isinstance(v, Path) else v
                                                for k, v in config.items()}})
    _OPEN.append(plugin)
    return plugin


def run(plugin: WasmInterceptor, b: RecordBatch, seconds: float = 5.0) -> RecordBatch:
    result = plugin.intercept(b, ctx(seconds))
    assert isinstance(result, RecordBatch)
    return result


def rejection(plugin: WasmInterceptor, b: RecordBatch, seconds: float = 5.0) -> RejectBatch:
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(b, ctx(seconds))
    return info.value


# ---------------------------------------------------------------------------- the examples


@pytest.mark.parametrize(("function", "abi"), [("transform", 1), ("transform_batch", 2)])
def test_uppercase_example_uppercases_values_only(function: str, abi: int) -> None:
    plugin = wasm(module=UPPERCASE, encoding="binary", function=function, abi=abi)
    out = run(plugin, batch())
    assert [r.value for r in out.records] == [b"HELLO WORLD", b"MIXED 42", None,
                                               b"\xff\xfe BINARY \x00"]
    for got, sent in zip(out.records, RECORDS, strict=True):
        assert (got.key, got.headers, got.timestamp) == (sent.key, sent.headers, sent.timestamp)


@pytest.mark.parametrize(("function", "abi"), [("transform", 1), ("transform_batch", 2)])
def test_reject_shouting_example(function: str, abi: int) -> None:
    plugin = wasm(module=REJECT_SHOUTING, encoding="binary", function=function, abi=abi)
    calm = batch()
    assert run(plugin, calm) is calm, "a batch the module leaves alone is returned as it is"
    loud = batch((RECORDS[0], RECORDS[0].with_value(b"STOP SHOUTING!"), RECORDS[2]))
    exc = rejection(plugin, loud)
    assert exc.error_code == INVALID_RECORD
    assert "reject_shouting.wat" in exc.message and "value is all upper case" in exc.message
    if abi == 1:
        assert "record 1 of orders[3]" in exc.message
        assert exc.record_errors == ((1, "value is all upper case"),)
    # A rejection is the module's answer, not a fault: the instance is kept.
    assert plugin.programs[0].faults == 0
    assert run(plugin, calm) is calm


def test_a_stored_header_key_that_is_not_utf8_is_refused_by_name() -> None:
    """Brokers store header keys whatever their bytes; the record contract gives keys as
    text in either encoding, so a key that is not UTF-8 (read as lone surrogates) is
    refused by name before the call: it failed in the encoder, a plugin crash that cost
    an instance."""
    plugin = wasm(module=UPPERCASE, encoding="binary")
    key = b"\xffk".decode("utf-8", "surrogateescape")
    bad = batch((RECORDS[0], RECORDS[1].with_headers((Header(key, b"v"),))))
    exc = rejection(plugin, bad)
    assert exc.error_code == INVALID_RECORD
    assert exc.record_errors == ((1, "header key '\\xffk' not valid UTF-8"),)
    assert "header keys reach the plugin as text" in exc.message
    assert plugin.programs[0].faults == 0
    assert [r.value for r in run(plugin, batch(RECORDS[:1])).records] == [b"HELLO WORLD"]


def test_rejection_error_code_is_configurable() -> None:
    plugin = wasm(module=REJECT_SHOUTING, encoding="binary", error="POLICY_VIOLATION")
    assert rejection(plugin, batch((Record(value=b"NO"),))).error_code == POLICY_VIOLATION


# ---------------------------------------------------------------------------- encodings


@pytest.mark.parametrize("abi", [1, 2])
@pytest.mark.parametrize(("encoding", "function"), [("json", "echo_json"),
                                                    ("binary", "echo_binary")])
def test_an_echoed_batch_comes_back_identical(abi: int, encoding: str, function: str) -> None:
    """Every field survives both encodings: null vs empty, binary bytes, header order."""
    plugin = wasm(module=ECHO, function=function, abi=abi, encoding=encoding)
    b = batch()
    out = run(plugin, b)
    assert out is b, "records equal to the input are the input records (forwarded as-is)"


def test_json_input_layout() -> None:
    doc = json.loads(encode_input(1, "json", "orders", 3, RECORDS[:1]))
    assert doc == {"topic": "orders", "partition": 3, "key": "k0", "value": "hello world",
                   "headers": [["h", "1"], ["h", "2"], ["n", None]],
                   "timestamp": 1_700_000_000_123}
    doc = json.loads(encode_input(2, "json", "orders", 3, RECORDS[2:]))
    assert doc["records"][0] == {"key": "k2", "value": None, "headers": [["only", ""]],
                                 "timestamp": 5}
    assert doc["records"][1]["key"] == {"b64": "AP8="}


def test_binary_input_layout() -> None:
    data = encode_input(1, "binary", "t", 7, (Record(key=None, value=b"v",
                                                      headers=[("h", None)], timestamp=9),))
    assert data == (b"\x01\x00\x00\x00t" + b"\x07\x00\x00\x00"
                    + (9).to_bytes(8, "little") + b"\xff\xff\xff\xff"
                    + b"\x01\x00\x00\x00v" + b"\x01\x00\x00\x00"
                    + b"\x01\x00\x00\x00h" + b"\xff\xff\xff\xff")


def test_json_result_fields_left_out_are_kept() -> None:
    original = RECORDS[0]
    (record,) = decode_result(1, "json", bytes([STATUS_OK]) + b'{"value": {"b64": "AAE="}}',
                              (original,)) or ()
    assert isinstance(record, Record)
    assert record.value == b"\x00\x01"
    assert (record.key, record.headers, record.timestamp) == (original.key, original.headers,
                                                              original.timestamp)
    (record,) = decode_result(1, "json", bytes([STATUS_OK]) + b'{"key": null, "headers": []}',
                              (original,)) or ()
    assert isinstance(record, Record)
    assert record.key is None and record.headers == () and record.value == original.value


@pytest.mark.parametrize(("abi", "encoding", "result", "reason"), [
    (1, "json", b"\x00{", "not JSON"),
    (1, "json", b'\x00{"vaule": "x"}', "unknown field(s) vaule"),
    (1, "json", b'\x00{"value": 5}', "value must be null, a string"),
    (1, "json", b'\x00{"headers": [["a"]]}', "header 0 must be a [key, value] pair"),
    (2, "json", b'\x00{"records": []}', "holds 0 records for a batch of 1"),
    (2, "json", b'\x00[]', "v2 result must be a JSON object"),
    # an OverflowError from building the record, before
    (1, "json", b'\x00{"timestamp": 99999999999999999999999}', "beyond 64 bits"),
    # ignored before (the record stayed where it was, and nothing said so)
    (1, "json", b'\x00{"topic": "elsewhere"}', "names topic 'elsewhere', not 'orders'"),
    (2, "json", b'\x00{"records": [{"partition": 3}]}', "names partition 3, not 0"),
    # accepted before: a v2 result's own fields were not looked at beside its records
    (2, "json", b'\x00{"records": [{}], "topic": "zzz"}', "result names topic 'zzz', not"),
    (2, "json", b'\x00{"records": [{}], "x": 1}', "the result has unknown field(s) x"),
    (1, "binary", b"\x00\x01\x02", "runs past the end"),
    (1, "binary", b"", "empty"),
    (1, "binary", b"\x09", "unknown status byte 9"),
    (2, "binary", b"\x00\x02\x00\x00\x00", "holds 2 records for a batch of 1"),
])
def test_malformed_results_are_named(abi: int, encoding: str, result: bytes,
                                     reason: str) -> None:
    from kiproxy.interceptors.builtin.wasm.abi import Malformed as _Malformed

    with pytest.raises(_Malformed, match=re.escape(reason)):
        decode_result(abi, encoding, result, (RECORDS[0],), place=("orders", 0))
    if b"topic" not in result and b"partition" not in result:  # and without a place
        with pytest.raises(_Malformed, match=re.escape(reason)):
            decode_result(abi, encoding, result, (RECORDS[0],))


def test_a_rejection_reason_is_utf8_text() -> None:
    assert decode_result(1, "binary", b"\x01caf\xc3\xa9", (RECORDS[0],)) == "caf\u00e9"
    assert decode_result(2, "json", b"\x02", RECORDS) is None


# ---------------------------------------------------------------------------- faults


def test_an_infinite_loop_runs_out_of_fuel_quickly_and_the_next_batch_is_served() -> None:
    plugin = wasm(module=FAULTS, function="spin_on_bang", encoding="binary", fuel=50_000_000)
    started = time.monotonic()
    exc = rejection(plugin, batch((Record(value=b"fine"), Record(value=b"!loop"))))
    assert time.monotonic() - started < 2
    assert exc.error_code == INVALID_RECORD
    assert "faults.wat" in exc.message and "spin_on_bang" in exc.message
    assert "ran out of fuel (50000000 per batch)" in exc.message
    assert "record 1 of orders[3]" in exc.message and "instance reset" in exc.message
    program = plugin.programs[0]
    assert program.faults == 1
    ok = batch((Record(value=b"fine"),))
    assert run(plugin, ok) is ok


def test_fuel_is_a_budget_per_batch_not_per_record() -> None:
    # Each call to uppercase burns a little fuel; 20 records exceed a budget that 1 fits.
    one = batch((Record(value=b"x" * 200),))
    plugin = wasm(module=UPPERCASE, encoding="binary", fuel=6_000)
    run(plugin, one)
    exc = rejection(plugin, batch(tuple(Record(value=b"x" * 200) for _ in range(20))))
    assert "ran out of fuel (6000 per batch)" in exc.message


@pytest.mark.parametrize(("function", "reason"), [
    ("trap", "trapped: wasm trap: integer divide by zero"),
    ("bad_pointer", "returned a malformed result: 10 bytes at 2147418112 is not inside"),
    ("bad_status", "returned a malformed result: unknown status byte 7"),
    ("empty_result", "returned a malformed result: it is empty (0 bytes; a status byte "
     "comes first)"),
    ("truncated", "returned a malformed result: record 0 timestamp runs past the end"),
])
def test_faults_reject_the_batch_naming_module_and_reason(function: str, reason: str) -> None:
    plugin = wasm(module=FAULTS, function=function, encoding="binary")
    exc = rejection(plugin, batch())
    assert exc.error_code == INVALID_RECORD
    assert f"wasm module {FAULTS} ({function}, abi v1) {reason}" in exc.message
    assert "on record 0 of orders[3]; batch rejected, instance reset" in exc.message


def test_malformed_json_result() -> None:
    plugin = wasm(module=FAULTS, function="bad_json", encoding="json")
    assert "malformed result: the result is not JSON" in rejection(plugin, batch()).message


def test_a_v2_result_with_the_wrong_record_count_is_malformed() -> None:
    plugin = wasm(module=FAULTS, function="empty_batch", encoding="binary", abi=2)
    exc = rejection(plugin, batch())
    assert "malformed result: the result holds 0 records for a batch of 4" in exc.message
    assert "on orders[3]" in exc.message


def test_out_of_memory_names_the_limit_and_its_setting() -> None:
    plugin = wasm(module=FAULTS, function="oom", encoding="binary", max_memory_bytes=1 << 20)
    exc = rejection(plugin, batch())
    assert isinstance(exc, PluginFault) and exc.fault == "crashed"
    assert "(oom, abi v1) ran out of memory (limit 1 MiB, setting max_memory_bytes; raise it " \
        "if the module needs more) on record 0 of orders[3]" in exc.message
    assert "backtrace" not in exc.message


def test_every_instance_is_capped_at_256_mib_unless_configured() -> None:
    plugin = wasm(module=FAULTS, function="oom", encoding="binary")
    exc = rejection(plugin, batch())
    assert "ran out of memory (limit 256 MiB, setting max_memory_bytes" in exc.message


def test_a_module_that_keeps_crashing_is_backed_off_without_instantiating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiproxy.interceptors.builtin.wasm import engine

    plugin = wasm(module=FAULTS, function="trap", encoding="binary")
    built: list[object] = []
    original = engine.Instance.__init__

    def counting(self: Any, program: Any) -> None:
        built.append(self)
        original(self, program)

    monkeypatch.setattr(engine.Instance, "__init__", counting)
    for _ in range(3):
        assert "trapped: wasm trap: integer divide by zero" in rejection(plugin, batch()).message
    assert len(built) == 3
    refused = rejection(plugin, batch())
    assert isinstance(refused, PluginFault) and refused.error_code == INVALID_RECORD
    assert "trapped: wasm trap: integer divide by zero" in refused.message
    assert "crashed 3 times in a row; its batches are refused without running it" \
        in refused.message
    assert " on " not in refused.message.split(" (it crashed")[0]  # not the last batch's place
    assert len(built) == 3, "a backed-off module builds no instance"


def test_an_input_larger_than_max_memory_is_out_of_memory() -> None:
    plugin = wasm(module=UPPERCASE, encoding="binary", abi=2, function="transform_batch",
                  max_memory_bytes=256 * 1024)
    exc = rejection(plugin, batch((Record(value=b"x" * 300_000),)))
    assert "ran out of memory" in exc.message
    run(plugin, batch())  # a batch that fits still works


def test_a_faulted_instance_is_replaced() -> None:
    """State a module kept in memory does not survive a fault: the instance is new."""
    plugin = wasm(module=FAULTS, function="spin_on_bang", encoding="binary", fuel=10_000_000)
    program = plugin.programs[0]
    run(plugin, batch((Record(value=b"a"),)))
    first = program._idle[0]
    rejection(plugin, batch((Record(value=b"!"),)))
    assert program._idle == []
    run(plugin, batch((Record(value=b"a"),)))
    assert program._idle[0] is not first
    run(plugin, batch((Record(value=b"b"),)))
    assert len(program._idle) == 1, "instances are reused between batches"


def test_the_deadline_interrupts_a_call_that_fuel_would_not_stop() -> None:
    plugin = wasm(module=FAULTS, function="spin", encoding="binary", fuel=10**15)
    started = time.monotonic()
    exc = rejection(plugin, batch(), seconds=0.3)
    elapsed = time.monotonic() - started
    assert 0.25 < elapsed < 1.0
    assert exc.error_code == REQUEST_TIMED_OUT
    assert "interrupted at the batch deadline" in exc.message


def test_a_batch_whose_deadline_passed_while_queued_is_not_run() -> None:
    plugin = wasm(module=UPPERCASE, encoding="binary")
    run(plugin, batch())
    exc = rejection(plugin, batch(), seconds=-0.1)
    assert exc.error_code == REQUEST_TIMED_OUT
    assert exc.message.endswith("was not called: the batch deadline had passed on record 0 "
                                "of orders[3]; batch rejected")
    assert len(plugin.programs[0]._idle) == 1, "the instance is fine and kept"


async def test_threaded_calls_keep_the_event_loop_responsive() -> None:
    plugin = wasm(threaded=True, module=FAULTS, function="spin", encoding="binary",
                  fuel=600_000_000)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    pending = plugin.intercept(batch(), ctx())
    assert not isinstance(pending, RecordBatch), "threaded mode returns an awaitable"
    with pytest.raises(RejectBatch, match="ran out of fuel"):
        await pending
    elapsed = time.monotonic() - started
    task.cancel()
    assert elapsed > 0.1, "the module did run for a while"
    # The loop kept ticking while Wasm ran on the worker thread.
    assert ticks >= elapsed / 0.01 * 0.25


async def test_threaded_call_cancelled_at_the_deadline_frees_the_worker() -> None:
    """The pipeline's wait_for gives up at the deadline; the epoch interruption stops the
    Wasm call so the (single) worker serves the next batch."""
    plugin = wasm(threaded=True, topics={"slow": {"module": str(FAULTS), "function": "spin",
                                                  "fuel": 10**15},
                                         "fast": str(UPPERCASE)},
                  encoding="binary")
    c = ctx(0.3)
    with pytest.raises(TimeoutError):
        pending = plugin.intercept(batch(topic="slow"), c)
        assert not isinstance(pending, RecordBatch)
        await asyncio.wait_for(pending, c.deadline - time.monotonic())
    started = time.monotonic()
    result = plugin.intercept(batch(topic="fast"), ctx())
    assert not isinstance(result, RecordBatch)
    out = await result
    assert out.records[0].value == b"HELLO WORLD"
    assert time.monotonic() - started < 0.5


# ---------------------------------------------------------------------------- routing, config


def test_topics_map_to_modules_and_other_topics_pass() -> None:
    plugin = wasm(encoding="binary", topics={
        "upper": str(UPPERCASE),
        "strict": {"module": str(REJECT_SHOUTING), "error": "POLICY_VIOLATION"},
        "upper2": {"module": str(UPPERCASE), "function": "transform_batch", "abi": "v2"},
    })
    assert run(plugin, batch(topic="upper")).records[0].value == b"HELLO WORLD"
    assert run(plugin, batch(topic="upper2")).records[1].value == b"MIXED 42"
    assert rejection(plugin, batch((Record(value=b"LOUD"),), topic="strict")).error_code == \
        POLICY_VIOLATION
    other = batch(topic="other")
    assert run(plugin, other) is other
    # the same file with the same settings is compiled once
    assert len(plugin.programs) == 3


def test_a_default_module_serves_unlisted_topics() -> None:
    plugin = wasm(module=UPPERCASE, encoding="binary", topics={"quiet": str(REJECT_SHOUTING)})
    assert run(plugin, batch(topic="any")).records[0].value == b"HELLO WORLD"
    assert run(plugin, batch(topic="quiet")).records[0].value == b"hello world"


@pytest.mark.parametrize(("config", "message"), [
    ({}, "set module"),
    ({"module": "x.wasm", "colour": 1}, "colour: unknown key; valid keys here: module,"),
    ({"module": str(UPPERCASE), "abi": 3}, "abi: must be 1 (per record) or 2 (per batch), not 3"),
    ({"module": str(UPPERCASE), "encoding": "xml"},
     "encoding: expected 'json' or 'binary', got 'xml'"),
    ({"module": str(UPPERCASE), "fuel": 0}, "fuel: must be greater than 0, got 0"),
    # accepted before, and then every batch failed (or the interval meant "never")
    ({"module": str(UPPERCASE), "max_memory_bytes": 1000},
     "max_memory_bytes: must be at least 65536, got 1000"),
    ({"module": str(UPPERCASE), "reload_interval_ms": -5},
     "reload_interval_ms: must be at least -1, got -5"),
    ({"module": str(UPPERCASE), "error": "NOPE"}, "unknown Kafka error"),
    ({"module": "/nonexistent/m.wasm"}, "cannot read wasm module /nonexistent/m.wasm"),
    ({"module": str(UPPERCASE), "function": "nope"}, "exports no function 'nope'"),
    ({"topics": {"t": {"module": str(UPPERCASE), "colour": 1}}}, "topics.t.colour: unknown key"),
    ({"topics": {"t": 5}}, "topics.t: expected a module path or a mapping of settings"),
])
def test_config_errors_name_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        WasmInterceptor().configure(config)


def _wat(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_abi_problems_are_reported_at_start(tmp_path: Path) -> None:
    module = _wat(tmp_path, "bad.wat", """(module
      (import "env" "now" (func (result i64)))
      (func (export "transform") (param i32) (result i32) (i32.const 0)))""")
    with pytest.raises(ValueError) as info:
        WasmInterceptor().configure({"module": str(module)})
    message = str(info.value)
    assert "does not follow the kiproxy ABI" in message
    assert "exports no memory named 'memory'" in message
    assert "exports no function 'alloc'" in message
    assert "transform must be (i32, i32) -> i64, not (i32) -> i32" in message
    assert "imports env.now; only WASI imports are provided" in message


def test_a_module_that_does_not_compile(tmp_path: Path) -> None:
    module = _wat(tmp_path, "broken.wat", "(module (func")
    with pytest.raises(ValueError, match=r"broken\.wat does not compile"):
        WasmInterceptor().configure({"module": str(module)})


_MINIMAL = """(module
  (import "wasi_snapshot_preview1" "proc_exit" (func (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\\02")
  (global $ready (mut i32) (i32.const 0))
  (func (export "_initialize") (global.set $ready (i32.const 1)))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "transform") (param i32 i32) (result i64)
    (if (i32.eqz (global.get $ready)) (then unreachable))
    (i64.or (i64.shl (i64.const 16) (i64.const 32)) (i64.const 1))))"""


def test_wasi_reactor_modules_are_instantiated_and_initialized(tmp_path: Path) -> None:
    plugin = wasm(module=_wat(tmp_path, "reactor.wat", _MINIMAL))
    b = batch()
    assert run(plugin, b) is b


# ---------------------------------------------------------------------------- reload


def _replace(path: Path, source: Path) -> None:
    """Atomically replace ``path`` with a copy of ``source`` (as the README advises)."""
    tmp = path.with_suffix(".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def test_a_changed_module_file_is_picked_up_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = tmp_path / "live.wat"
    shutil.copyfile(UPPERCASE, module)
    plugin = wasm(module=module, encoding="binary", reload_interval_ms=0)
    program = plugin.programs[0]
    assert run(plugin, batch()).records[0].value == b"HELLO WORLD"

    _replace(module, REJECT_SHOUTING)
    calm = batch()
    assert run(plugin, calm) is calm, "the new module (reject_shouting) serves the next batch"
    assert program.reloads == 1
    assert "value is all upper case" in rejection(plugin, batch((Record(value=b"LOUD"),))).message

    # A file that does not compile is logged; the previous module keeps serving.
    module.write_text("(module (func")
    with caplog.at_level(logging.ERROR, logger="kiproxy.wasm"):
        assert run(plugin, calm) is calm
    assert "changed but cannot be loaded; keeping the previous module" in caplog.text
    assert program.reloads == 1

    _replace(module, UPPERCASE)
    assert run(plugin, batch()).records[0].value == b"HELLO WORLD"
    assert program.reloads == 2


def test_reload_checks_are_rate_limited(tmp_path: Path) -> None:
    module = tmp_path / "live.wat"
    shutil.copyfile(UPPERCASE, module)
    plugin = wasm(module=module, encoding="binary", reload_interval_ms=60_000)
    _replace(module, REJECT_SHOUTING)
    assert run(plugin, batch()).records[0].value == b"HELLO WORLD", "not checked yet"
    plugin.programs[0]._checked_at -= 61
    calm = batch()
    assert run(plugin, calm) is calm


def test_reload_can_be_switched_off(tmp_path: Path) -> None:
    module = tmp_path / "live.wat"
    shutil.copyfile(UPPERCASE, module)
    plugin = wasm(module=module, encoding="binary", reload_interval_ms=-1)
    _replace(module, REJECT_SHOUTING)
    plugin.programs[0]._checked_at -= 10**6
    assert run(plugin, batch()).records[0].value == b"HELLO WORLD"


def test_headers_survive_a_transform_in_order() -> None:
    """A module that rewrites a record must hand back every header; uppercase does."""
    headers = [Header("a", b"1"), Header("b", None), Header("a", b"2")]
    b = batch((Record(value=b"v", headers=headers, timestamp=1),))
    out = run(wasm(module=UPPERCASE, encoding="binary"), b)
    assert list(out.records[0].headers) == headers


@pytest.mark.parametrize("threaded", [False, True])
def test_an_answer_past_the_output_bound_is_stopped_as_it_is_read(threaded: bool) -> None:
    """ABI v1 calls the module record by record: the bound is checked as the answers
    come, so a module answering every record with 64 MiB is refused before a batch of
    40 records holds 2.6 GB. ``judge`` hands the bound to the host (also on its thread)."""
    plugin = wasm(module=UPPERCASE, function="transform", encoding="binary", threaded=threaded)
    first = output_size(run(wasm(module=UPPERCASE, encoding="binary"), batch()).records[:1])
    limits = OutputLimits(max_bytes=first + 1)  # the first record fits, the second not

    async def judged() -> Any:
        return await judge(plugin, batch(), ctx(), name="w", timeout=5, limits=limits)

    verdict = asyncio.run(judged())
    assert isinstance(verdict, Rejected) and verdict.fault == "output_size"
    assert (f"returned more than {first + 1} bytes of records for orders[3] by record 1 of 4"
            in verdict.message)
    assert output_limits() == DEFAULT_OUTPUT_LIMITS  # set for the call only

    # an unchanged batch is not measured (as by the verdict): an echo passes any bound
    echo = wasm(module=ECHO, function="echo_binary", encoding="binary", threaded=threaded)
    tiny = OutputLimits(max_bytes=1)
    assert asyncio.run(judge(echo, batch(), ctx(), name="e", timeout=5, limits=tiny)) == \
        Unchanged(batch())
