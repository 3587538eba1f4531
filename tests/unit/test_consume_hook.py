"""The fetch-side hook's rules, without a broker: the judge, the test kit, loading,
route selection and the ApiVersions cut while a hook is configured.

End to end (real brokers and clients) it is tests/integration/test_fetch_hook.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    FetchResponseInterceptor,
    ProduceRequestInterceptor,
    RefuseFetch,
)
from kiproxy.interceptors.consume_verdict import ConsumeRefusal
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor
from kiproxy.interceptors.testing import (
    load,
    make_batch,
    make_consumed_batch,
    run_consume,
    run_interceptor,
)
from kiproxy.protocol.framing import encode_response_header
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.proxy.brokers.api_versions import cut_api_versions_frame
from kiproxy.proxy.config.model import load_config
from kiproxy.proxy.routes.runtime import load_routes

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


class Hooks(FetchResponseInterceptor):
    """Does what the batch's topic names."""

    async def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> Any:
        kind = batch.topic
        if kind == "refuse":
            raise RefuseFetch("not for you", error="TOPIC_AUTHORIZATION_FAILED")
        if kind == "reset":  # a code on which consumers reset their offset
            raise RefuseFetch("skip ahead", error=1)
        if kind == "verbose":
            raise RefuseFetch("z" * 5000)
        if kind == "raise":
            raise ValueError("broken")
        if kind == "type":
            return batch.records
        if kind == "grow":
            return batch.with_records((*batch.records, batch.records[0]))
        if kind == "tuples":
            return batch.with_records([("k", "v")] * len(batch.records))
        if kind == "surrogate":
            return batch.with_records(r.with_header("\ud800x", b"v") for r in batch.records)
        if kind == "move":
            return batch.with_records(r.with_timestamp(r.timestamp + 1) for r in batch.records)
        if kind == "slow":
            await asyncio.sleep(2)
        if kind == "stubborn":  # swallows its cancellation at the deadline and runs on
            with contextlib.suppress(BaseException):
                await asyncio.Event().wait()
            for _ in range(5):
                await asyncio.sleep(0)
        if kind == "upper":
            return batch.with_records(r.with_value((r.value or b"").upper())
                                      for r in batch.records)
        if kind in ("rebase", "rebase-same"):  # the batch moved, its records upper-cased
            records = (batch.records if kind == "rebase-same" else
                       tuple(r.with_value((r.value or b"").upper()) for r in batch.records))
            return dataclasses.replace(batch, base_offset=batch.base_offset + 100,
                                       records=records)
        if kind == "elsewhere":  # upper-cased, and said to be of another topic-partition
            return dataclasses.replace(
                batch.with_records(r.with_value((r.value or b"").upper())
                                   for r in batch.records), topic="other", partition=7)
        return batch


@pytest.mark.parametrize(("topic", "code", "reason"), [
    ("refuse", 29, "refused"),
    ("raise", -1, "plugin_error"),
    ("reset", -1, "plugin_error"),
    ("type", -1, "bad_return"),
    ("tuples", -1, "bad_return"),
    ("surrogate", -1, "bad_return"),
    ("grow", -1, "record_count"),
    ("move", -1, "shape_changed"),
    ("rebase", -1, "shape_changed"),
    ("rebase-same", -1, "shape_changed"),
    ("slow", -1, "timeout"),
    ("stubborn", -1, "timeout"),
])
def test_what_the_judge_refuses(topic: str, code: int, reason: str) -> None:
    batch = make_consumed_batch(make_batch(b"a", b"b", topic=topic), base_offset=10)
    verdict = run_consume(Hooks(), batch, timeout_ms=200)
    assert isinstance(verdict, ConsumeRefusal)
    assert (verdict.code, verdict.reason) == (code, reason)
    assert "Hooks" in verdict.message


async def test_a_hook_returning_more_than_the_output_limits_is_refused() -> None:
    from kiproxy.interceptors.consume_verdict import judge_consume
    from kiproxy.interceptors.verdict import OutputLimits

    class Inflate(FetchResponseInterceptor):
        def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
            return batch.with_records(r.with_value((r.value or b"") * 100)
                                      for r in batch.records)

    batch = make_consumed_batch(make_batch(b"a" * 50, b"b" * 50), base_offset=10)
    ctx = ConsumeContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                         api_version=12, deadline=time.monotonic() + 5)
    verdict = await judge_consume(Inflate(), batch, ctx, name="inflate", timeout=None,
                                  limits=OutputLimits(max_bytes=5000, max_ratio=0))
    assert isinstance(verdict, ConsumeRefusal) and verdict.reason == "output_size"
    assert verdict.message.startswith("inflate returned 10")
    assert "the limit is max_plugin_output_bytes (5000)" in verdict.message
    fits = await judge_consume(Inflate(), batch, ctx, name="inflate", timeout=None,
                               limits=OutputLimits(max_bytes=50_000, max_ratio=0))
    assert isinstance(fits, ConsumedBatch)


async def test_a_block_hook_returning_more_than_the_output_limits_is_refused() -> None:
    from kiproxy.interceptors.consume_verdict import judge_consume_block
    from kiproxy.interceptors.testing import _block_of
    from kiproxy.interceptors.verdict import OutputLimits
    from kiproxy.protocol.records import decode_records, encode_records

    class InflateBlock(FetchResponseInterceptor):
        def on_consume_block(self, block: Any, ctx: ConsumeContext) -> bytes:
            records = decode_records(bytes(block.data), 0, len(block.data),
                                     block.record_count, block.base_timestamp)
            return encode_records(tuple(r.with_value((r.value or b"") * 100) for r in records),
                                  block.base_timestamp, False)[0]

        def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
            return batch

    batch = make_consumed_batch(make_batch(b"a" * 50, b"b" * 50), base_offset=10)
    ctx = ConsumeContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                         api_version=12, deadline=time.monotonic() + 5)
    verdict = await judge_consume_block(InflateBlock(), _block_of(batch), None, ctx,
                                        name="inflate", timeout=None,
                                        limits=OutputLimits(max_bytes=5000, max_ratio=0))
    assert isinstance(verdict, ConsumeRefusal) and verdict.reason == "output_size"
    assert "the limit is max_plugin_output_bytes (5000)" in verdict.message


@pytest.mark.parametrize("error", ["UNKNOWN_SERVER_ERROR", -1, "topic_authorization_failed",
                                   29, 44])
def test_a_fetch_refusal_takes_the_codes_of_the_rejection_table(error: str | int) -> None:
    assert RefuseFetch("no", error=error).error_code in (-1, 29, 44)


@pytest.mark.parametrize("error", [1, 3, 6, 9999, -2, "NOT_LEADER_OR_FOLLOWER",
                                   "offset_out_of_range"])
def test_a_fetch_refusal_with_another_code_is_a_mistake_that_says_why(
        error: int | str) -> None:
    """OFFSET_OUT_OF_RANGE (1) makes librdkafka and kafka-python reset the offset and
    skip the records; other codes move consumers in other ways, or are not Kafka's. The
    message lists what a refusal takes, by name and number, whether the code was given
    by name or by number."""
    with pytest.raises(ValueError, match="skip records") as caught:
        RefuseFetch("no", error=error)
    assert "UNKNOWN_SERVER_ERROR (-1)" in str(caught.value)
    assert "POLICY_VIOLATION (44)" in str(caught.value)
    assert "numeric code" not in str(caught.value)


def test_a_fetch_refusals_reason_is_cut_for_the_log() -> None:
    batch = make_consumed_batch(make_batch(b"a", topic="verbose"))
    verdict = run_consume(Hooks(), batch)
    assert isinstance(verdict, ConsumeRefusal)
    assert verdict.message == "Hooks refused it: " + "z" * 1006 + (
        "... (3,994 more characters cut)")


class SlowPlain(FetchResponseInterceptor):
    """A plain hook that returns the batch, unchanged, after 0.25 s."""

    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        time.sleep(0.25)
        return batch


class SlowPlainBlock(SlowPlain):
    """A plain block hook that returns the block, unchanged, after 0.25 s."""

    def on_consume_block(self, block: ConsumedBlock, ctx: ConsumeContext) -> memoryview:
        time.sleep(0.25)
        return block.data


@pytest.mark.parametrize("hook", [SlowPlain, SlowPlainBlock])
def test_a_plain_hook_that_returns_past_its_deadline_is_refused_as_an_async_one_is(
        hook: type[FetchResponseInterceptor]) -> None:
    """It cannot be stopped, but what it returns late is refused all the same: the
    code, message and reason an ``async def`` hook cancelled at the deadline gets."""
    batch = make_consumed_batch(make_batch(b"a", b"b", topic="slow"), base_offset=10)
    late = run_consume(hook(), batch, timeout_ms=100, name="h")
    cancelled = run_consume(Hooks(), batch, timeout_ms=100, name="h")
    assert isinstance(late, ConsumeRefusal)
    assert late == cancelled
    assert (late.code, late.reason) == (-1, "timeout")
    assert run_consume(hook(), batch, timeout_ms=5000) is batch  # in time: let through


def test_a_raising_hook_keeps_its_exception_on_the_refusal() -> None:
    verdict = run_consume(Hooks(), make_consumed_batch(make_batch(b"a", topic="raise")))
    assert isinstance(verdict, ConsumeRefusal)
    assert isinstance(verdict.exception, ValueError)
    assert verdict.exception.__traceback__ is not None  # what the proxy logs


def test_a_moved_batch_names_the_hook_and_both_offsets() -> None:
    batch = make_consumed_batch(make_batch(b"a", b"b", topic="rebase"), base_offset=40)
    verdict = run_consume(Hooks(), batch, name="h")
    assert isinstance(verdict, ConsumeRefusal)
    assert verdict.message == ("h moved the batch from offset 40 to 140 (its base_offset is "
                               "the log's)")


def test_the_topic_and_partition_of_a_returned_batch_are_the_logs() -> None:
    """As on produce, a hook changes records, not where they are: the batch the
    consumer reads (and the kit reports) keeps its topic-partition."""
    batch = make_consumed_batch(make_batch(b"a", topic="elsewhere", partition=2))
    read = run_consume(Hooks(), batch)
    assert isinstance(read, ConsumedBatch)
    assert (read.topic, read.partition, read.records[0].value) == ("elsewhere", 2, b"A")


def test_what_the_judge_lets_through() -> None:
    batch = make_consumed_batch(make_batch(b"a", b"b", topic="same"))
    assert run_consume(Hooks(), batch) is batch
    upper = run_consume(Hooks(), make_consumed_batch(make_batch(b"a", b"b", topic="upper")))
    assert isinstance(upper, ConsumedBatch)
    assert [r.value for r in upper.records] == [b"A", b"B"]


def test_the_kit_loads_a_plugin_with_both_hooks_and_runs_each() -> None:
    with load("tp_fetch:Reverse", plugins_dir=PLUGINS) as plugin:
        produced = plugin.run(make_batch(b"abc"))
        assert produced.kind == "transformed" and produced.records[0].value == b"cba"
        consumed = plugin.consume(make_consumed_batch(make_batch(b"cba")))
        assert isinstance(consumed, ConsumedBatch) and consumed.records[0].value == b"abc"


def test_the_kit_says_a_fetch_side_only_hook_has_no_produce_side_to_run() -> None:
    """run_interceptor on it is the test's mistake (as a wrong input to run_consume
    is), not a rejection the plugin would get."""
    with pytest.raises(TypeError, match=r"Hooks has no intercept.*run_consume"):
        run_interceptor(Hooks(), make_batch(b"a"))
    with load("tp_fetch:UpperOnConsume", plugins_dir=PLUGINS) as plugin, \
            pytest.raises(TypeError, match="no intercept"):
        plugin.run(make_batch(b"a"))


def test_the_loader_takes_a_fetch_side_only_class_and_names_both_apis_otherwise(
        tmp_path: Path) -> None:
    assert isinstance(load_interceptor("tp_fetch:UpperOnConsume", PLUGINS, {}),
                      FetchResponseInterceptor)
    (tmp_path / "neither.py").write_text("class Neither:\n    pass\n")
    with pytest.raises(PluginLoadError, match=r"neither intercept.*nor on_consume"):
        load_interceptor("neither:Neither", tmp_path, {})


def test_one_class_with_both_hooks_gets_its_settings_once() -> None:
    from kiproxy.interceptors import PluginSettings

    class Settings(PluginSettings):
        word: str = "x"

    class Both(ProduceRequestInterceptor[Settings], FetchResponseInterceptor[Settings]):
        def configure(self, config: Settings) -> None:
            self.word = config.word

        def intercept(self, batch: Any, ctx: Any) -> Any:
            return batch

        def on_consume(self, batch: Any, ctx: Any) -> Any:
            return batch

    both = Both()
    both.configure({"word": "y"})  # type: ignore[arg-type]
    assert both.word == "y"
    with pytest.raises(Exception, match="nope"):
        both.configure({"nope": 1})  # type: ignore[arg-type]


def _routes(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f"plugins_dir: {PLUGINS}\n" + text)
    return load_routes(load_config(path, {}))


def test_routes_split_each_chain_into_produce_links_and_reversed_fetch_side_links(
        tmp_path: Path) -> None:
    from kiproxy.interceptors import ClientIdentity

    routes = _routes(tmp_path, """
routes:
  - match: {topic: "rev-.*", acks: [0]}
    interceptors: [{class: "tp_fetch:Reverse"}, {class: "tp_fetch:UpperOnConsume"},
                   {class: uppercase}]
  - match: {topic: "up-.*"}
    interceptors: [{class: "tp_fetch:UpperOnConsume"}]
""")
    assert routes.intercepts and routes.consumes
    who = ClientIdentity(client_host="127.0.0.1", client_port=1)
    choose = routes.table.for_client(who)
    rev = choose.select_fetch("rev-a")  # acks takes no part in fetch selection
    assert rev is not None and choose.select("rev-a", -1, False) is None
    chain = routes.chain(rev)
    assert [link.name for link in chain.links] == ["tp_fetch:Reverse", "uppercase"]
    assert [link.name for link in chain.consumers] == ["tp_fetch:UpperOnConsume",
                                                       "tp_fetch:Reverse"]
    up = choose.select_fetch("up-b")
    assert up is not None and routes.chain(up).links == ()
    assert choose.select_fetch("other") is None
    asyncio.run(routes.close())


def test_a_fetch_side_hook_under_process_isolation_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(PluginLoadError, match=r"^route 0, link 1 of 1: interceptor "
                       r"tp_fetch:Reverse has a fetch-side hook \(on_consume\).*isolation: "
                       "process"):
        _routes(tmp_path, """
routes:
  - match: {topic: "rev-.*"}
    interceptors: [{class: "tp_fetch:Reverse", isolation: process}]
""")


def test_the_api_versions_cut_with_a_hook_bounds_fetch_only() -> None:
    response_cls = response_type(ApiKey.API_VERSIONS, 0)
    entry_cls = typing.get_args(typing.get_type_hints(response_cls)["api_keys"])[0]
    offered = {ApiKey.PRODUCE: (0, 13), ApiKey.FETCH: (0, 18), ApiKey.METADATA: (0, 12),
               76: (1, 1), 77: (1, 1), ApiKey.SHARE_FETCH: (1, 1),
               ApiKey.SHARE_ACKNOWLEDGE: (1, 1)}
    message = response_cls(error_code=ErrorCode.none, api_keys=tuple(
        entry_cls(api_key=k, min_version=lo, max_version=hi) for k, (lo, hi) in offered.items()))
    frame = encode_response_header(5, 0) + serialize(message)
    cut = parse_response(ApiKey.API_VERSIONS, 0,
                         cut_api_versions_frame(0, frame, fetch_range=(4, 12)), 4)
    got = {e.api_key: (e.min_version, e.max_version) for e in cut.api_keys}
    assert got[ApiKey.FETCH] == (4, 12)
    assert {k: v for k, v in got.items() if k != ApiKey.FETCH} == {
        k: v for k, v in offered.items() if k != ApiKey.FETCH}
    plain = parse_response(ApiKey.API_VERSIONS, 0, cut_api_versions_frame(0, frame), 4)
    assert {e.api_key for e in plain.api_keys} == set(offered)


@pytest.mark.parametrize(("workers", "highest"), [(1, 18), (2, 12)])
def test_fetch_versions_offered_with_a_hook_follow_the_worker_count(
        tmp_path: Path, workers: int, highest: int) -> None:
    """Fetch v13+ names topics by id, which a worker process learns only from the
    Metadata answers it carries itself: several workers offer names (v12) only."""
    from kiproxy.proxy.generation import build_generation, close_generation

    path = tmp_path / "kiproxy.yaml"
    path.write_text(f"plugins_dir: {PLUGINS}\nworkers: {workers}\nroutes:\n"
                    "  - interceptors: [{class: \"tp_fetch:UpperOnConsume\"}]\n")
    generation = build_generation(load_config(path, {}), 1, metrics=None)
    try:
        assert generation.fetch.hooks and generation.fetch.max_version == highest
        assert not generation.produce.intercepts  # a fetch-side-only hook decodes no produce
    finally:
        asyncio.run(close_generation(generation))


def _zigzag(n: int) -> bytes:
    n, out = (n << 1) ^ (n >> 63), bytearray()
    while True:
        if n < 0x80:
            return bytes(out + bytes([n]))
        out.append(n & 0x7F | 0x80)
        n >>= 7


def _record(offset_delta: int, header_key: bytes) -> bytes:
    """One record of a records block: value b"v", one header whose key is ``header_key``."""
    body = (b"\x00" + _zigzag(0) + _zigzag(offset_delta) + _zigzag(-1) + _zigzag(1) + b"v"
            + _zigzag(1) + _zigzag(len(header_key)) + header_key + _zigzag(-1))
    return _zigzag(len(body)) + body


def test_a_moved_record_in_a_block_with_a_header_key_that_is_not_utf8_refuses_the_batch(
        ) -> None:
    """Brokers store a header key that is not UTF-8. A block hook that moves a record of
    such a batch gets the batch refused, the record named by its offset (the log's own
    block is read, its key as lone surrogates)."""
    from kiproxy.interceptors.consume import ConsumedBlock
    from kiproxy.interceptors.consume_verdict import _judged_block

    original = _record(0, b"\xff\xfe")
    block = ConsumedBlock(topic="t", partition=0, base_offset=40, base_timestamp=0,
                          record_count=1, data=memoryview(original))
    verdict = _judged_block(_record(3, b"ok"), block, None, "mover")  # key mended, moved
    assert isinstance(verdict, ConsumeRefusal)
    assert "mover moved the record at offset 40" in verdict.message
