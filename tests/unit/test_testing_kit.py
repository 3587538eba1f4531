"""The plugin test kit (``kiproxy.interceptors.testing``) and its pytest fixtures.

That its verdicts are the proxy's is shown end to end by
``tests/integration/test_verdict_parity.py``; here: the builders' defaults,
each kind of outcome, a call from inside a running event loop, loading by
spec, and the fixtures in a pytest run of their own.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    FetchResponseInterceptor,
    Header,
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.testing import (
    Plugin,
    PluginLoadError,
    load,
    make_batch,
    make_consumed_batch,
    make_context,
    make_record,
    run_consume,
    run_interceptor,
    run_interceptor_async,
)

ROOT = Path(__file__).resolve().parents[2]


class Upper(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value((r.value or b"").upper()) for r in batch.records)


class Closed(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        raise RejectBatch("closed", "POLICY_VIOLATION", [(0, "first")])


class Sleepy(ProduceRequestInterceptor):
    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        await asyncio.sleep(1)
        return batch


class Blocking(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        time.sleep(0.05)
        return batch


def test_make_record_encodes_text_and_takes_headers_as_pairs_or_a_mapping() -> None:
    record = make_record("v", key="k", headers=[("a", "1"), ("a", None)], timestamp=5)
    assert (record.key, record.value, record.timestamp) == (b"k", b"v", 5)
    assert record.headers == (Header("a", b"1"), Header("a", None))
    assert make_record(None, headers={"h": b"x"}).headers == (Header("h", b"x"),)
    assert make_record().timestamp > 1_700_000_000_000  # now, in ms


def test_make_batch_numbers_its_records_and_defaults_to_a_plain_producer() -> None:
    batch = make_batch("a", b"b", None, topic="orders", partition=3)
    assert (batch.topic, batch.partition) == ("orders", 3)
    assert [r.value for r in batch.records] == [b"a", b"b", None]
    assert [r.offset_delta for r in batch.records] == [0, 1, 2]
    assert len({r.timestamp for r in batch.records}) == 1
    assert (batch.producer_id, batch.base_sequence, batch.compression) == (-1, -1, "none")
    assert len(make_batch()) == 1
    with pytest.raises(TypeError, match="not both"):
        make_batch("a", records=[make_record()])


def test_make_batch_numbers_records_that_all_have_the_default_offset_delta() -> None:
    """Records made with make_record all have offset delta 0, which no batch of two
    records has: numbered 0, 1, ... as values are; records that say their own deltas
    keep them, and so does a lone record."""
    made = [make_record("a"), make_record("b"), make_record("c")]
    assert [r.offset_delta for r in make_batch(records=made).records] == [0, 1, 2]
    assert [r.offset_delta for r in make_batch(*made).records] == [0, 1, 2]
    assert [r.value for r in make_batch(records=made).records] == [b"a", b"b", b"c"]
    given = [make_record("a", offset_delta=0), make_record("b", offset_delta=5)]
    assert [r.offset_delta for r in make_batch(records=given).records] == [0, 5]
    assert make_batch(records=[make_record("x", offset_delta=7)]).records[0].offset_delta == 7


def test_each_kind_of_outcome() -> None:
    batch = make_batch("a", "b")
    transformed = run_interceptor(Upper(), batch)
    assert (transformed.kind, transformed.values, transformed.forwarded) == \
        ("transformed", [b"A", b"B"], True)

    unchanged = run_interceptor(Upper(), make_batch("A"))
    assert (unchanged.kind, unchanged.values, unchanged.code) == ("unchanged", [b"A"], 0)

    rejected = run_interceptor(Closed(), batch)
    assert (rejected.kind, rejected.error, rejected.code, rejected.message,
            rejected.record_errors, rejected.fault, rejected.records) == \
        ("rejected", "POLICY_VIOLATION", 44, "closed", ((0, "first"),), None, ())


def test_deadlines_of_async_and_plain_plugins_are_the_proxys() -> None:
    late = run_interceptor(Sleepy(), make_batch(), timeout_ms=20)
    assert (late.error, late.fault, late.message) == \
        ("REQUEST_TIMED_OUT", "timeout", "interceptor Sleepy did not finish within 20 ms")
    blocked = run_interceptor(Blocking(), make_batch(), timeout_ms=1, name="mine")
    assert (blocked.error, blocked.message) == \
        ("REQUEST_TIMED_OUT", "interceptor mine did not finish within 1 ms")


async def test_it_runs_from_inside_a_running_event_loop() -> None:
    assert run_interceptor(Upper(), make_batch("x")).values == [b"X"]
    assert (await run_interceptor_async(Upper(), make_batch("y"))).values == [b"Y"]


class AsyncClose(ProduceRequestInterceptor):
    """Closes a resource bound to the loop it ran on, as an HTTP client session is."""

    def __init__(self) -> None:
        self.loops: list[asyncio.AbstractEventLoop] = []
        self.closed_on: asyncio.AbstractEventLoop | None = None

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        self.loops.append(asyncio.get_running_loop())
        return batch

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed_on = asyncio.get_running_loop()


def test_an_async_close_is_awaited_on_the_loop_the_plugin_ran_on() -> None:
    interceptor = AsyncClose()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
        with Plugin(interceptor, "async_close:AsyncClose") as plugin:
            plugin.run(make_batch())
        gc.collect()
    assert interceptor.closed_on is not None and interceptor.closed_on is interceptor.loops[0]


async def test_an_async_close_is_awaited_from_inside_a_running_event_loop() -> None:
    interceptor = AsyncClose()
    Plugin(interceptor, "async_close:AsyncClose").close()
    assert interceptor.closed_on is not None
    assert interceptor.closed_on is not asyncio.get_running_loop()


def test_the_context_is_the_callers_with_a_fresh_deadline() -> None:
    seen: list[InterceptContext] = []

    class Spy(ProduceRequestInterceptor):
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            seen.append(ctx)
            return batch

    run_interceptor(Spy(), make_batch(), make_context(principal="User:alice", deadline=0))
    assert seen[0].principal == "User:alice"
    assert seen[0].deadline > time.monotonic()


def test_load_uses_the_proxys_loader_and_names_the_spec(tmp_path: Path) -> None:
    (tmp_path / "shrinker.py").write_text(textwrap.dedent("""
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Shrink(ProduceRequestInterceptor):
            def configure(self, config):
                self.keep = config["keep"]

            def intercept(self, batch, ctx):
                return batch.with_records(batch.records[:self.keep])
    """))
    with load("shrinker:Shrink", plugins_dir=tmp_path, config={"keep": 1}) as plugin:
        outcome = plugin.run(make_batch("a", "b"))
    assert (outcome.error, outcome.fault, outcome.message) == (
        "INVALID_RECORD", "record_count",
        "interceptor shrinker:Shrink broke the record-count rule: returned 1 records for a "
        "batch of 2")
    with pytest.raises(PluginLoadError, match=r"shrinker:Shrink.configure\(\) failed: KeyError"):
        load("shrinker:Shrink", plugins_dir=tmp_path)


def _pytest(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # -p no:kiproxy: the installed entry point, if any, gives way to the module under test.
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:kiproxy",
         "-p", "kiproxy.interceptors.pytest_plugin", "-p", "no:cacheprovider", str(path)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_documented_plugin_test_file_passes() -> None:
    done = _pytest(ROOT / "examples" / "plugin_tests", ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout


def test_the_fixtures_in_a_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_plugin.py").write_text(textwrap.dedent(f"""
        def test_fixtures(kiproxy_load, kiproxy_run, make_batch, make_record):
            plugin = kiproxy_load("mask_card_numbers:MaskCardNumbers",
                                  plugins_dir={str(ROOT / "plugins")!r})
            batch = make_batch("card 4111 1111 1111 1111", make_record("none"))
            outcome = kiproxy_run(plugin, batch)
            assert outcome.kind == "transformed"
            assert outcome.values == [b"card ****-****-****-1111", b"none"]
    """))
    done = _pytest(tmp_path / "test_plugin.py", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_fetch_side_fixtures_in_a_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_hook.py").write_text(textwrap.dedent(f"""
        def test_fetch_fixtures(kiproxy_load, kiproxy_consume, make_batch,
                                make_consumed_batch):
            plugin = kiproxy_load("tp_fetch:UpperOnConsume",
                                  plugins_dir={str(ROOT / "tests" / "plugins")!r})
            fetched = kiproxy_consume(plugin, make_consumed_batch(make_batch("abc"),
                                                                  base_offset=40))
            assert [r.value for r in fetched.records] == [b"ABC"]
            assert fetched.base_offset == 40
    """))
    done = _pytest(tmp_path / "test_hook.py", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_run_consume_given_a_produce_batch_says_so_and_blames_no_plugin() -> None:
    """A test that hands ``run_consume`` a ``RecordBatch`` (what ``make_batch`` builds)
    is told how to make a fetched batch of it, instead of the plugin being refused for
    giving that batch back."""

    class Identity(FetchResponseInterceptor):
        def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
            return batch

    with pytest.raises(TypeError, match=r"run_consume takes a ConsumedBatch, not RecordBatch"
                                        r"; make_consumed_batch\(batch\) makes one"):
        run_consume(Identity(), make_batch("a"))  # type: ignore[arg-type]
    assert run_consume(Identity(), make_consumed_batch(make_batch("a"))).records[0].value \
        == b"a"  # type: ignore[union-attr]


@pytest.mark.parametrize("topic, expected", [
    ("b-t", "cba"), ("b-whole-odd", "cba"),  # one block: index 0, answered
    ("b-whole-raise", "raised RuntimeError: the whole partition broke"),
    ("b-whole-count", "returned 0 answers for 1 blocks")])
def test_run_consume_hands_on_consume_blocks_the_one_batch_as_the_proxy_would(
        topic: str, expected: str) -> None:
    from kiproxy.interceptors.consume_verdict import ConsumeRefusal

    plugin = load("tp_fetch:BlocksReverse", plugins_dir=ROOT / "tests" / "plugins")
    calls = type(plugin.interceptor).calls
    calls.clear()
    out = plugin.consume(make_consumed_batch(make_batch("abc", "def", topic=topic)))
    if isinstance(out, ConsumeRefusal):
        assert expected in out.message and "tp_fetch:BlocksReverse" in out.message
    else:
        assert [r.value for r in out.records] == [expected.encode(), b"fed"]
    assert calls == [[2]]


FIRST_ONLY = """
from kiproxy.interceptors import FetchResponseInterceptor


class FirstOnly(FetchResponseInterceptor):
    def on_consume_blocks(self, blocks, ctx):
        return (b.data for b in blocks[:1])  # a generator, and one answer too few

    def on_consume(self, batch, ctx):
        return batch
"""


def test_run_consume_blocks_shows_what_only_a_partition_of_several_batches_shows(
        tmp_path: Path) -> None:
    from kiproxy.interceptors.consume_verdict import ConsumeRefusal
    from kiproxy.interceptors.testing import run_consume_blocks

    (tmp_path / "first_only.py").write_text(FIRST_ONLY)
    plugin = load("first_only:FirstOnly", plugins_dir=tmp_path)
    one = make_consumed_batch(make_batch("a"))
    assert plugin.consume(one) == one  # alone, the batch is answered
    out = run_consume_blocks(plugin, [one, make_consumed_batch(make_batch("b"),
                                                               base_offset=1)])
    assert isinstance(out, ConsumeRefusal) and out.reason == "bad_return"
    assert out.message == "first_only:FirstOnly returned 1 answers for 2 blocks"
    # a partition of the built-in test plugin: every batch's own answer, in order
    blocks = load("tp_fetch:BlocksReverse", plugins_dir=ROOT / "tests" / "plugins")
    batches = [make_consumed_batch(make_batch("ab", "cd", topic="b-whole-refuse"),
                                   base_offset=o) for o in (0, 2, 4)]
    got = blocks.consume_blocks(batches)
    assert not isinstance(got, ConsumeRefusal)
    assert [g.records[0].value if isinstance(g, ConsumedBatch) else g.reason
            for g in got] == [b"ba", "refused", b"ba"]


def test_decode_block_and_encode_block_read_and_write_a_block_hooks_records() -> None:
    from kiproxy.interceptors import ConsumedBlock
    from kiproxy.interceptors.sealing import CorruptBatch, decode_block, encode_block
    from kiproxy.protocol.records import encode_records

    records = make_batch("a", "b", "c").records
    data = encode_records(records, records[0].timestamp, False)[0]
    block = ConsumedBlock(topic="t", partition=0, base_offset=0,
                          base_timestamp=records[0].timestamp, record_count=3,
                          data=memoryview(data))
    assert decode_block(block) == records
    upper = [r.with_value((r.value or b"").upper()) for r in decode_block(block)]
    assert decode_block(ConsumedBlock(**{**{f: getattr(block, f) for f in (
        "topic", "partition", "base_offset", "base_timestamp", "record_count")},
        "data": memoryview(encode_block(block, upper))})) == tuple(upper)
    with pytest.raises(CorruptBatch):
        decode_block(ConsumedBlock(topic="t", partition=0, base_offset=0, base_timestamp=0,
                                   record_count=3, data=memoryview(b"\x07no")))


ODD_ANSWERS = """
import time
from kiproxy.interceptors import FetchResponseInterceptor, RefuseFetch


class OddAnswers(FetchResponseInterceptor):
    def on_consume_blocks(self, blocks, ctx):
        kind = blocks[0].topic
        if kind == "set":
            return {b.data for b in blocks}
        return self._each(kind, blocks)

    def _each(self, kind, blocks):
        for i, block in enumerate(blocks):
            if i and kind == "refuse":
                raise RefuseFetch("not the second", "POLICY_VIOLATION")
            if i and kind == "slow":
                time.sleep(0.3)
            yield block.data

    def on_consume(self, batch, ctx):
        return batch
"""


@pytest.mark.parametrize("topic, code, reason, message", [
    ("refuse", 44, "refused", "refused it: not the second"),
    ("slow", -1, "timeout", "did not answer within 200 ms"),
    ("set", -1, "bad_return", "returned set, not a sequence with an answer per block")])
def test_a_generators_answers_are_the_call_itself_its_refusals_and_time_included(
        tmp_path: Path, topic: str, code: int, reason: str, message: str) -> None:
    from kiproxy.interceptors.consume_verdict import ConsumeRefusal
    from kiproxy.interceptors.testing import run_consume_blocks

    (tmp_path / "odd_answers.py").write_text(ODD_ANSWERS)
    plugin = load("odd_answers:OddAnswers", plugins_dir=tmp_path)
    batches = [make_consumed_batch(make_batch("a", topic=topic), base_offset=o)
               for o in (0, 1)]
    out = run_consume_blocks(plugin, batches, timeout_ms=200)
    assert isinstance(out, ConsumeRefusal)
    assert (out.code, out.reason) == (code, reason) and message in out.message


def test_a_fetch_side_hook_may_return_any_awaitable() -> None:
    """What the produce side awaits, the fetch side awaits too: an object with
    ``__await__`` (as a compiled ``async def`` may return), not only a coroutine."""

    class Later:
        def __init__(self, batch: ConsumedBatch) -> None:
            self.batch = batch

        def __await__(self) -> Any:
            yield from asyncio.sleep(0).__await__()
            return self.batch.with_records(r.with_value(b"later") for r in self.batch.records)

    class Awaits(FetchResponseInterceptor):
        def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> Any:
            return Later(batch)

    out = run_consume(Awaits(), make_consumed_batch(make_batch("a")))
    assert isinstance(out, ConsumedBatch) and out.records[0].value == b"later"
