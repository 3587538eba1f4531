"""A route's chain: links in order, each judged, the first rejection ends it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kiproxy.interceptors import (
    Header,
    InterceptContext,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.verdict import Unchanged, judge
from kiproxy.proxy.routes.chain import ChainResult, Judge, LoadedLink, run_chain


def _judges() -> list[Judge]:
    return [judge]


class Validate:
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if any(r.value is None for r in batch.records):
            raise RejectBatch("tombstones are not allowed here", error="POLICY_VIOLATION")
        return batch


class Mask:
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value(b"***") for r in batch.records)


class Stamp:
    def __init__(self) -> None:
        self.deadlines: list[float] = []

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        self.deadlines.append(ctx.deadline)
        return batch.with_records(
            r.with_headers((*r.headers, Header("route", b"payments"))) for r in batch.records)


class DropOne:
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(batch.records[1:])


def _batch(*values: bytes | None) -> RecordBatch:
    return RecordBatch(topic="payments", partition=0, records=tuple(
        Record(key=None, value=v, headers=(), timestamp=1, offset_delta=i)
        for i, v in enumerate(values)))


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="app", client_address="10.0.0.1:1", principal=None,
                            api_version=9, acks=1, transactional_id=None, deadline=0.0)


def _run(links: list[Any], batch: RecordBatch, judge: Judge) -> ChainResult:
    loaded = [LoadedLink(type(link).__name__, link, 5.0) for link in links]
    return asyncio.run(run_chain("payments", loaded, batch, _ctx(), judge))


@pytest.mark.parametrize("judge", _judges())
def test_three_links_apply_in_order(judge: Judge) -> None:
    stamp = Stamp()
    before = time.monotonic()
    result = _run([Validate(), Mask(), stamp], _batch(b"4111", b"5500"), judge)
    assert result.changed and result.rejection is None and result.route == "payments"
    assert [(r.value, r.headers) for r in result.batch.records] == \
        [(b"***", (Header("route", b"payments"),))] * 2
    assert stamp.deadlines[0] >= before + 5.0  # each link's own deadline


@pytest.mark.parametrize("judge", _judges())
def test_a_rejection_stops_the_chain(judge: Judge) -> None:
    stamp = Stamp()
    result = _run([Validate(), stamp], _batch(b"a", None), judge)
    assert result.rejected_by == 0 and stamp.deadlines == []
    assert result.rejection is not None and result.rejection.code == 44


@pytest.mark.parametrize("judge", _judges())
def test_the_count_rule_is_checked_after_each_link(judge: Judge) -> None:
    stamp = Stamp()
    result = _run([Mask(), DropOne(), stamp], _batch(b"a", b"b"), judge)
    assert result.rejected_by == 1 and stamp.deadlines == []
    assert result.rejection is not None and "record-count rule" in result.rejection.message
    assert [r.value for r in result.batch.records] == [b"***", b"***"]  # what link 1 got


@pytest.mark.parametrize("judge", _judges())
def test_links_that_change_nothing_leave_the_original(judge: Judge) -> None:
    batch = _batch(b"a")
    result = _run([Validate(), Validate()], batch, judge)
    assert result == ChainResult(route="payments", verdict=Unchanged(batch), given=batch)
