"""The one chain runner (``kiproxy.interceptors.chain``) as the ``chain`` built-in drives it:
:func:`run_links` answers at once while no link awaits, and awaited after one does."""

from __future__ import annotations

import asyncio
import time

from kiproxy.interceptors import InterceptContext, Record, RecordBatch
from kiproxy.interceptors.chain import ChainResult, LoadedLink, run_links
from kiproxy.interceptors.verdict import Rejected, Transformed, Verdict


class Upper:
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value((r.value or b"").upper()) for r in batch.records)


class Exclaim:
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value((r.value or b"") + b"!") for r in batch.records)


LINKS = (LoadedLink("upper", Upper(), 5.0), LoadedLink("exclaim", Exclaim(), 5.0))
BATCH = RecordBatch(topic="orders", partition=0, records=(Record(value=b"ab"),))


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="app", client_address="10.0.0.1:1", principal=None,
                            api_version=9, acks=1, transactional_id=None,
                            deadline=time.monotonic() + 5)


def _now(index: int, link: LoadedLink, given: RecordBatch, ctx: InterceptContext) -> Verdict:
    return Transformed(link.interceptor.intercept(given, ctx))


async def _later(index: int, link: LoadedLink, given: RecordBatch,
                 ctx: InterceptContext) -> Verdict:
    return _now(index, link, given, ctx)


def test_links_that_answer_at_once_give_the_result_at_once() -> None:
    result = run_links("chain", LINKS, BATCH, _ctx(), _now)
    assert isinstance(result, ChainResult)
    assert result.batch.records[0].value == b"AB!"


def test_a_link_that_awaits_makes_the_chain_awaited_in_order() -> None:
    pending = run_links("chain", LINKS, BATCH, _ctx(), _later)
    assert not isinstance(pending, ChainResult)
    result = asyncio.run(pending)  # type: ignore[arg-type]
    assert result.batch.records[0].value == b"AB!"


def test_a_rejection_stops_the_chain_and_names_the_link() -> None:
    def refuse_second(index: int, link: LoadedLink, given: RecordBatch,
                      ctx: InterceptContext) -> Verdict:
        if index == 1:
            return Rejected(code=44, message=f"{link.name}: no")
        return _now(index, link, given, ctx)

    result = run_links("chain", LINKS, BATCH, _ctx(), refuse_second)
    assert isinstance(result, ChainResult)
    assert result.rejected_by == 1 and result.rejection is not None
    assert result.rejection.message == "exclaim: no"
    assert result.batch.records[0].value == b"AB", "the batch the refusing link was given"
