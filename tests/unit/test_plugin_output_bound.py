"""The verdict's bound on what a plugin returns (``max_plugin_output_bytes`` and
``max_plugin_output_ratio``), judged alike by the proxy, its isolation workers, replay and
the test kit behind ``kiproxy check``; and :class:`PluginFault`, a host's crash."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import InterceptContext, Record, RecordBatch
from kiproxy.interceptors import verdict as verdict_module
from kiproxy.interceptors.testing import make_batch, run_interceptor
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    PluginFault,
    Rejected,
    Transformed,
    Unchanged,
    judge,
    judge_sync,
)
from kiproxy.protocol.records import encode_records, records_size

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"
MiB = 2**20


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 5)


class Grow:
    """Every value replaced by one shared value of ``size`` bytes."""

    def __init__(self, size: int) -> None:
        self.value = b"x" * size

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value(self.value) for r in batch.records)


def _batch(*values: bytes) -> RecordBatch:
    return RecordBatch(topic="t", partition=0, records=tuple(
        Record(value=v, timestamp=0, offset_delta=0) for v in values))


def test_records_size_is_the_encoded_size() -> None:
    records = (Record(key=b"k", value=b"v" * 300, headers=[("h", b"1"), ("n", None)]),
               Record(value=None), Record(key=b"", value=b"\x00"))
    assert records_size(records) == len(encode_records(records, 0, False)[0])
    assert records_size(()) == 0


def test_ten_records_of_20_mb_are_refused_naming_the_plugin_sizes_and_setting() -> None:
    batch = _batch(*(b"small" for _ in range(10)))
    verdict = asyncio.run(judge(Grow(20 * MiB), batch, _ctx(), name="balloon", timeout=5))
    assert isinstance(verdict, Rejected)
    assert (verdict.code, verdict.fault) == (87, "output_size")
    size = records_size(tuple(Record(value=b"x" * 20 * MiB) for _ in range(10)))
    assert verdict.message == (
        f"interceptor balloon returned {size} bytes of records for "
        f"{records_size(batch.records)} bytes received; the limit is "
        f"max_plugin_output_bytes ({32 * MiB})")


def test_every_runtime_judges_the_bound_alike() -> None:
    batch, grow = _batch(b"small"), Grow(40 * MiB)
    proxy = asyncio.run(judge(grow, batch, _ctx(), name="p", timeout=5))
    worker = judge_sync(grow, batch, _ctx(), name="p", timeout=None, run=lambda a, t: None)
    kit = run_interceptor(grow, make_batch(b"small"), name="p")  # kiproxy check's verdict
    assert isinstance(proxy, Rejected) and isinstance(worker, Rejected)
    assert proxy.fault == worker.fault == kit.fault == "output_size"


def test_the_ratio_is_checked_past_4_mib_only() -> None:
    limits = OutputLimits(max_bytes=64 * MiB, max_ratio=16)
    grown = asyncio.run(judge(Grow(MiB), _batch(b"tiny"), _ctx(), name="p", timeout=5,
                              limits=limits))
    assert isinstance(grown, Transformed), "a small batch may grow freely"
    one_mib = _batch(b"x" * MiB)
    ok = asyncio.run(judge(Grow(15 * MiB), one_mib, _ctx(), name="p", timeout=5, limits=limits))
    assert isinstance(ok, Transformed)
    over = asyncio.run(judge(Grow(17 * MiB), one_mib, _ctx(), name="p", timeout=5,
                             limits=limits))
    assert isinstance(over, Rejected) and over.fault == "output_size"
    assert "more than max_plugin_output_ratio (16) times as many" in over.message
    off = OutputLimits(max_bytes=64 * MiB, max_ratio=0)
    assert isinstance(asyncio.run(judge(Grow(17 * MiB), one_mib, _ctx(), name="p", timeout=5,
                                        limits=off)), Transformed)


def test_an_unchanged_batch_is_never_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(records: Any) -> int:
        raise AssertionError("measured")

    monkeypatch.setattr(verdict_module, "records_size", boom)

    class Same:
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch

    class Copy:
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch.with_records(list(batch.records))

    for plugin in (Same(), Copy()):
        verdict = asyncio.run(judge(plugin, _batch(b"a", b"b"), _ctx(), name="p", timeout=5))
        assert isinstance(verdict, Unchanged)


def test_a_plugin_fault_is_a_fault_not_a_policy_rejection() -> None:
    class Crash:
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            raise PluginFault("wasm module m.wasm trapped", [(0, "trapped")])

    verdict = asyncio.run(judge(Crash(), _batch(b"a"), _ctx(), name="p", timeout=5))
    assert verdict == Rejected(code=87, message="wasm module m.wasm trapped",
                               record_errors=((0, "trapped"),), fault="crashed")


async def test_an_isolated_plugin_is_refused_in_its_worker() -> None:
    from kiproxy.proxy.isolation.pool import IsolatedInterceptor

    pool = IsolatedInterceptor("tp_balloon:Balloon", PLUGINS, {"bytes_per_batch": 40 * MiB},
                               workers=1, limits=DEFAULT_OUTPUT_LIMITS)
    await asyncio.to_thread(pool.start)
    try:
        verdict = await judge(pool, _batch(b"a", b"b"), _ctx(), name="tp_balloon:Balloon",
                              timeout=10)
    finally:
        await pool.close()
    assert isinstance(verdict, Rejected) and verdict.fault == "output_size"
    assert "interceptor tp_balloon:Balloon returned" in verdict.message
    assert "max_plugin_output_bytes" in verdict.message


class ListOfRecords:
    """Builds its answer with a list of records, not a tuple (``dataclasses.replace``)."""

    def __init__(self, size: int) -> None:
        self.value = b"x" * size

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        import dataclasses
        return dataclasses.replace(
            batch, records=[r.with_value(self.value) for r in batch.records])  # type: ignore[arg-type]


def test_an_answer_holding_a_list_of_records_is_measured_like_a_tuple() -> None:
    small = asyncio.run(judge(ListOfRecords(3), _batch(b"a", b"b"), _ctx(), name="p",
                             timeout=5))
    assert isinstance(small, Transformed)
    big = asyncio.run(judge(ListOfRecords(40 * MiB), _batch(b"a"), _ctx(), name="p",
                           timeout=5))
    assert isinstance(big, Rejected) and big.fault == "output_size"


def test_a_header_key_that_cannot_be_encoded_is_left_to_the_encoder() -> None:
    class BadKey:
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch.with_records(r.with_headers([("\ud800", b"v")]) for r in batch.records)

    verdict = asyncio.run(judge(BadKey(), _batch(b"a"), _ctx(), name="p", timeout=5))
    assert isinstance(verdict, Transformed)  # not a crash: encoding refuses it, naming it
