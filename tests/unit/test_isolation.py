"""Plugin isolation: the interceptor in a pool of worker processes (``proxy.isolation``).

The pool is driven directly, as the produce pipeline drives it (``await
pool.intercept(batch, ctx)``), with the misbehaving plugins of
``tests/isolation_plugins``. What must hold: every field of a batch and its
context crosses to the worker and back unchanged in meaning (the result equals
what the same plugin returns inline); rejections and exceptions read as they do
inline; a plugin that loops forever is killed at the deadline and one that
crashes is reported with its exit code, and both are replaced while other
batches keep being served; a plugin that cannot load stops the pool at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kiproxy.interceptors import InterceptContext, Record, RecordBatch, RejectBatch
from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor
from kiproxy.interceptors.verdict import Judged, Rejected
from kiproxy.proxy.isolation.pool import IsolatedInterceptor, PluginRaised, WorkerCrashed
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.produce.pipeline import INVALID_RECORD, REQUEST_TIMED_OUT, ProducePipeline

PLUGINS = Path(__file__).resolve().parents[1] / "isolation_plugins"

pytestmark = pytest.mark.timeout(60)


def _records(n: int = 3) -> tuple[Record, ...]:
    return tuple(
        Record(key=None if i == 1 else b"key-%d" % i, value=None if i == 2 else b"value-%d" % i,
               headers=[("h", b"1"), ("h", None), ("trace", b"t-%d" % i), ("h", b"2")],
               timestamp=1_763_848_800_123 + i, offset_delta=i)
        for i in range(n)
    )


def _batch(topic: str = "orders", n: int = 3) -> RecordBatch:
    return RecordBatch(topic=topic, partition=3, records=_records(n), producer_id=4711,
                       producer_epoch=2, base_sequence=100, transactional=True,
                       compression="zstd")


IDENTITY = ClientIdentity(
    client_host="203.0.113.9", client_port=40001, peer_host="10.0.0.7", peer_port=53412,
    via_proxy_protocol=True, listener="external", tls_subject="CN=orders,O=Example",
    tls_sans=(("DNS", "orders.example"), ("URI", "spiffe://example/orders")),
    sasl_mechanism="SCRAM-SHA-512", principal="alice", client_id="orders-svc")


def _ctx(seconds: float = 10.0, **fields: Any) -> InterceptContext:
    values: dict[str, Any] = dict(
        client_id="orders-svc", client_address="10.0.0.7:53412", principal="alice",
        api_version=11, acks=-1, transactional_id="tx-1",
        deadline=time.monotonic() + seconds, received_at_ms=1_763_848_800_000,
        proxy_host="proxy-1", extra={"note": "kept"}, identity=IDENTITY)
    values.update(fields)
    return InterceptContext(**values)


@pytest.fixture
async def make_pool() -> AsyncIterator[Any]:
    """Factory for started pools; every pool is closed after the test."""
    pools: list[IsolatedInterceptor] = []

    def make(cls: str, workers: int = 1, **config: Any) -> IsolatedInterceptor:
        pool = IsolatedInterceptor(f"iso_plugins:{cls}", PLUGINS, config, workers=workers)
        pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()


@pytest.fixture
def inline_plugin() -> Iterator[Any]:
    """Load a test plugin into this process (undoing the loader's sys.path/modules edits)."""
    path, modules = list(sys.path), set(sys.modules)
    yield lambda cls, **config: load_interceptor(f"iso_plugins:{cls}", PLUGINS, config)
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


async def _eventually(condition: Any, timeout: float = 10.0) -> None:
    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, "condition not reached"
        await asyncio.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _exit_known(pool: IsolatedInterceptor, pid: int) -> bool:
    """Whether the pool's handle on worker ``pid`` has its exit code."""
    return any(w.pid == pid and w.exitcode is not None for w in pool._workers)


def _fork_server_pid(pool: IsolatedInterceptor) -> int:
    """The fork server the pool's workers come from (the test is skipped without one)."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if pid is None or not any(psutil.Process(w.pid).ppid() == pid for w in pool._workers):
        pytest.skip("the workers do not come from a fork server here")
    return int(pid)


def _forkserver_children() -> list[int]:
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if pid is None:
        return []
    return [p.pid for p in psutil.Process(pid).children() if not _gone(p.pid)]


# ------------------------------------------------------------------ round trip


async def test_every_field_crosses_to_the_worker_and_back(make_pool: Any,
                                                          inline_plugin: Any) -> None:
    pool = make_pool("Reveal", tag="isolated")
    batch, ctx = _batch(), _ctx()

    result = await pool.intercept(batch, ctx)

    expected = inline_plugin("Reveal", tag="isolated").intercept(batch, ctx)
    assert result.records == expected.records
    assert (result.topic, result.partition, result.producer_id, result.producer_epoch,
            result.base_sequence, result.transactional, result.compression) == (
        "orders", 3, 4711, 2, 100, True, "zstd")
    first, second, third = result.records
    # Null keys, values and header values, and repeated headers in order, survive.
    assert (first.key, second.key, third.value) == (b"0-yek", None, None)
    assert [(h.key, h.value) for h in first.headers[:4]] == [
        ("h", b"1"), ("h", None), ("trace", b"t-0"), ("h", b"2")]
    assert first.header_values("seen-null") == [None]
    assert [(r.timestamp, r.offset_delta) for r in result.records] == [
        (1_763_848_800_123, 0), (1_763_848_800_124, 1), (1_763_848_800_125, 2)]
    seen_batch = json.loads(first.header_values("seen-batch")[0] or b"")
    assert seen_batch == {"topic": "orders", "partition": 3, "producer_id": 4711,
                          "producer_epoch": 2, "base_sequence": 100, "transactional": True,
                          "compression": "zstd", "tag": "isolated"}
    seen_ctx = json.loads(first.header_values("seen-ctx")[0] or b"")
    assert seen_ctx == {"client_id": "orders-svc", "client_address": "10.0.0.7:53412",
                        "principal": "alice", "api_version": 11, "acks": -1,
                        "transactional_id": "tx-1", "deadline": ctx.deadline,
                        "received_at_ms": 1_763_848_800_000, "proxy_host": "proxy-1",
                        "extra": {"note": "kept"}, "identity": {
                            "client_host": "203.0.113.9", "client_port": 40001,
                            "peer_host": "10.0.0.7", "peer_port": 53412,
                            "via_proxy_protocol": True, "listener": "external",
                            "tls_subject": "CN=orders,O=Example",
                            "tls_sans": [["DNS", "orders.example"],
                                         ["URI", "spiffe://example/orders"]],
                            "sasl_mechanism": "SCRAM-SHA-512", "principal": "alice",
                            "client_id": "orders-svc"}}


async def test_nullable_context_fields_and_empty_batches_cross_too(make_pool: Any) -> None:
    pool = make_pool("Reveal")
    ctx = _ctx(client_id=None, principal=None, transactional_id=None, extra={})
    result = await pool.intercept(_batch(n=1), ctx)
    seen = json.loads(result.records[0].header_values("seen-ctx")[0] or b"")
    assert (seen["client_id"], seen["principal"], seen["transactional_id"]) == (None,) * 3
    empty = RecordBatch(topic="orders", partition=0, records=())
    assert await pool.intercept(empty, ctx) is empty


async def test_an_unchanged_batch_comes_back_as_the_same_object(make_pool: Any) -> None:
    # The pipeline then forwards the original bytes without re-encoding.
    pool = make_pool("Same")
    batch = _batch()
    assert await pool.intercept(batch, _ctx()) is batch


async def test_an_async_intercept_runs_in_the_worker(make_pool: Any) -> None:
    pool = make_pool("AsyncUpper")
    result = await pool.intercept(_batch(), _ctx())
    assert [r.value for r in result.records] == [b"VALUE-0", b"VALUE-1", None]


# ------------------------------------------------------------------ rejections and errors


async def test_reject_batch_keeps_its_code_message_and_record_errors(make_pool: Any) -> None:
    pool = make_pool("Reject")
    with pytest.raises(RejectBatch) as caught:
        await pool.intercept(_batch("payments"), _ctx())
    assert caught.value.error_code == 44  # POLICY_VIOLATION
    assert caught.value.message == "no writes to payments"
    assert caught.value.record_errors == ((0, "first record is bad"), (1, None))
    assert pool.restarts == 0


async def test_an_exception_keeps_its_class_name_and_the_workers_traceback(
        make_pool: Any) -> None:
    pool = make_pool("Raise")
    pid = pool.pids
    with pytest.raises(PluginRaised) as caught:
        await pool.intercept(_batch("payments"), _ctx())
    assert type(caught.value).__name__ == "ValueError"
    assert str(caught.value) == "cannot handle payments"
    cause = str(caught.value.__cause__)
    assert "iso_plugins.py" in cause and 'raise ValueError(f"cannot handle' in cause
    # The worker is fine: it keeps serving.
    with pytest.raises(PluginRaised):
        await pool.intercept(_batch("again"), _ctx())
    assert (pool.pids, pool.restarts) == (pid, 0)


async def test_returning_something_other_than_a_batch_is_an_error(make_pool: Any) -> None:
    pool = make_pool("ReturnsNone")
    with pytest.raises(Judged) as caught:
        await pool.intercept(_batch(), _ctx())
    # The same rejection as inline (the verdict is judged in the worker).
    assert caught.value.verdict == Rejected(
        code=87, message="interceptor iso_plugins:ReturnsNone returned NoneType, not a "
        "RecordBatch", fault="return_type")


# ------------------------------------------------------------------ deadlines


async def test_an_endless_loop_is_killed_at_the_deadline_and_replaced(make_pool: Any) -> None:
    pool = make_pool("SpinOrUpper", workers=1)
    [spinning] = pool.pids

    with pytest.raises(TimeoutError):
        await pool.intercept(_batch("spin-1"), _ctx(0.5))

    assert pool.restarts == 1
    await _eventually(lambda: _gone(spinning))
    # The next batch waits for the replacement (the only worker) and is served by it.
    result = await pool.intercept(_batch("orders"), _ctx(30))
    assert [r.value for r in result.records] == [b"VALUE-0", b"VALUE-1", None]
    assert len(pool.pids) == 1 and pool.pids != [spinning]


async def test_a_wedged_worker_does_not_stall_batches_of_other_topics(make_pool: Any) -> None:
    pool = make_pool("SpinOrUpper", workers=2)
    spin = asyncio.create_task(pool.intercept(_batch("spin-1"), _ctx(5)))
    await asyncio.sleep(0.05)

    for i in range(20):
        result = await pool.intercept(_batch(f"orders-{i}"), _ctx(5))
        assert result.records[0].value == b"VALUE-0"
    assert not spin.done()  # all of the above was served while the spin batch was stuck

    with pytest.raises(TimeoutError):
        await spin
    assert pool.restarts == 1


async def test_a_batch_waits_for_a_free_worker_only_until_its_own_deadline(
        make_pool: Any) -> None:
    pool = make_pool("SpinOrUpper", workers=1)
    spin = asyncio.create_task(pool.intercept(_batch("spin-1"), _ctx(1.5)))
    await asyncio.sleep(0.05)

    with pytest.raises(TimeoutError):
        await pool.intercept(_batch("orders"), _ctx(0.3))
    assert pool.restarts == 0  # waiting kills nothing: the busy worker is another batch's

    patient = asyncio.create_task(pool.intercept(_batch("orders"), _ctx(30)))
    with pytest.raises(TimeoutError):
        await spin
    result = await patient  # served by the replacement
    assert result.records[0].value == b"VALUE-0"
    assert pool.restarts == 1


async def test_a_batch_that_is_late_already_costs_no_worker(make_pool: Any) -> None:
    pool = make_pool("Same", workers=1)
    pids = pool.pids
    with pytest.raises(TimeoutError):
        await pool.intercept(_batch(), _ctx(-1))
    assert (pool.pids, pool.restarts) == (pids, 0)


async def test_a_caller_that_gives_up_early_leaves_a_worker_that_answers_in_time(
        make_pool: Any) -> None:
    # The pipeline's asyncio.wait_for (or a closing connection) cancels intercept.
    pool = make_pool("Sleep", workers=1, sleep_ms=300)
    pids = pool.pids
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pool.intercept(_batch("slow"), _ctx(10)), 0.05)
    result = await pool.intercept(_batch("orders"), _ctx(10))
    assert result.records[0].value == b"VALUE-0"
    assert (pool.pids, pool.restarts) == (pids, 0)


async def test_a_caller_that_gives_up_early_still_gets_a_spinning_worker_killed(
        make_pool: Any) -> None:
    pool = make_pool("SpinOrUpper", workers=1)
    [spinning] = pool.pids
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pool.intercept(_batch("spin"), _ctx(0.4)), 0.05)
    await _eventually(lambda: _gone(spinning))
    assert pool.restarts == 1
    result = await pool.intercept(_batch("orders"), _ctx(30))
    assert result.records[0].value == b"VALUE-0"


# ------------------------------------------------------------------ crashes


@pytest.mark.parametrize(("topic", "exit_text"), [
    ("crash", "exit code 3"),
    ("segv", "exit code -11 (SIGSEGV)"),
])
async def test_a_worker_that_dies_rejects_its_batch_and_is_replaced(
        make_pool: Any, topic: str, exit_text: str) -> None:
    pool = make_pool("Crash", workers=1, code=3)
    [pid] = pool.pids

    with pytest.raises(WorkerCrashed) as caught:
        await pool.intercept(_batch(topic), _ctx())

    assert str(caught.value) == (
        f"the worker process running iso_plugins:Crash (pid {pid}) died with {exit_text} "
        "while handling this batch; it is being replaced")
    assert pool.restarts == 1
    result = await pool.intercept(_batch("orders"), _ctx(30))
    assert result.records[0].value == b"VALUE-0"
    assert pool.pids != [pid]


async def test_a_worker_that_died_while_idle_is_replaced_without_failing_a_batch(
        make_pool: Any) -> None:
    pool = make_pool("Same", workers=1)
    [pid] = pool.pids
    os.kill(pid, signal.SIGKILL)
    # Dead (its sockets closed by the kernel), whether or not the fork server has told
    # multiprocessing yet: the pool must see it either way and not hand it the batch.
    await _eventually(lambda: _gone(pid))
    batch = _batch()
    assert await pool.intercept(batch, _ctx(30)) is batch
    assert pool.restarts == 1 and pool.pids != [pid]


async def test_a_dead_idle_worker_is_seen_before_its_exit_is_reported(make_pool: Any) -> None:
    pool = make_pool("Same", workers=2)
    server = _fork_server_pid(pool)
    dead = pool._idle[-1]  # the worker the next batch would be handed
    os.kill(server, signal.SIGSTOP)  # no exit is reported while it is stopped
    try:
        os.kill(dead.pid, signal.SIGKILL)
        await _eventually(lambda: _gone(dead.pid))
        assert not _exit_known(pool, dead.pid)
        assert dead.peer_closed()
        assert not pool._idle[0].peer_closed()
        batch = _batch()
        assert await pool.intercept(batch, _ctx(30)) is batch  # on the live worker
        assert pool.restarts == 1
    finally:
        os.kill(server, signal.SIGCONT)


# ------------------------------------------------------------------ the pipeline's view


async def test_the_pipeline_rejects_a_spinning_batch_with_request_timed_out(
        make_pool: Any) -> None:
    pool = make_pool("SpinOrUpper", workers=1)
    pipeline = ProducePipeline(pool, name="iso_plugins:SpinOrUpper", timeout_ms=400)
    ctx = _ctx(0.4)
    assert pipeline.routes is not None and pipeline.routes.single is not None
    decided = await pipeline.partitions._run(pipeline.routes.single, _batch("spin"), ctx)
    rejection = decided.rejection
    assert rejection is not None and rejection.code == REQUEST_TIMED_OUT
    assert "did not finish within 400 ms" in rejection.message
    await _eventually(lambda: pool.restarts == 1)


async def test_the_pipeline_rejects_a_crashed_batch_with_invalid_record(
        make_pool: Any) -> None:
    pool = make_pool("Crash", workers=1, code=9)
    metrics = Metrics()
    pipeline = ProducePipeline(pool, name="iso_plugins:Crash", timeout_ms=5000,
                               metrics=metrics)
    assert pipeline.routes is not None and pipeline.routes.single is not None
    decided = await pipeline.partitions._run(pipeline.routes.single, _batch("crash"), _ctx(5))
    rejection = decided.rejection
    assert rejection is not None and rejection.code == INVALID_RECORD
    assert rejection.fault == "crashed"  # the worker died; the plugin raised nothing
    message = rejection.message
    assert message.startswith("the worker process running iso_plugins:Crash (pid ")
    assert "died with exit code 9" in message
    errors = "kiproxy_interceptor_errors_total"
    assert metrics.registry.get_sample_value(
        errors, {"reason": "crashed", "route": "default"}) == 1
    assert metrics.registry.get_sample_value(
        errors, {"reason": "raised", "route": "default"}) is None
    assert pipeline.routes.single.hooks == ()  # on_acknowledgement is not forwarded


# ------------------------------------------------------------------ start and stop


@pytest.mark.parametrize(("cls", "message"), [
    ("Nope", "module 'iso_plugins' "),
    ("BadConfigure",
     "iso_plugins:BadConfigure.configure() failed: ValueError: setting 'url' is required"),
    ("ExitOnConfigure", "died with exit code 5 while loading it"),
])
def test_a_plugin_that_cannot_load_stops_the_pool_at_start(cls: str, message: str) -> None:
    pool = IsolatedInterceptor(f"iso_plugins:{cls}", PLUGINS, workers=2)
    with pytest.raises(PluginLoadError) as caught:
        pool.start()
    assert message in str(caught.value)
    if cls == "Nope":
        assert "has no class 'Nope'; it defines: " in str(caught.value)
    assert pool.pids == []
    assert _forkserver_children() == []  # no worker left behind


def test_a_missing_module_is_reported_as_inline() -> None:
    pool = IsolatedInterceptor("no_such_plugin_module:X", PLUGINS)
    with pytest.raises(PluginLoadError, match="interceptor module 'no_such_plugin_module' "
                                              "not found"):
        pool.start()


async def test_on_acknowledgement_is_not_called_and_the_pool_says_so(
        make_pool: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kiproxy.isolation"):
        pool = make_pool("Acked", workers=2)
    assert [r.getMessage() for r in caplog.records] == [
        "interceptor iso_plugins:Acked defines on_acknowledgement, which is not called with "
        "interceptor.isolation: process"]
    assert not hasattr(pool, "on_acknowledgement")


@pytest.fixture
async def pool_to_close() -> AsyncIterator[IsolatedInterceptor]:
    pool = IsolatedInterceptor("iso_plugins:SpinOrUpper", PLUGINS, workers=2)
    pool.start()
    yield pool
    await pool.close()


async def test_close_stops_idle_and_busy_workers(pool_to_close: IsolatedInterceptor) -> None:
    pool = pool_to_close
    pids = pool.pids
    spin = asyncio.create_task(pool.intercept(_batch("spin"), _ctx(60)))
    await asyncio.sleep(0.1)
    await pool.close()
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(WorkerCrashed):
        await spin
    with pytest.raises(RuntimeError, match="the worker pool is closed"):
        await pool.intercept(_batch(), _ctx())



async def test_a_worker_leaves_the_fork_servers_safe_path_out_of_its_environment(
        make_pool: Any) -> None:
    # The fork server is started with PYTHONSAFEPATH (kiproxy's value); a process a
    # plugin starts must see the proxy's environment, where it is unset.
    import os

    assert "PYTHONSAFEPATH" not in os.environ
    pool = make_pool("Environ", name="PYTHONSAFEPATH")
    result = await pool.intercept(_batch(n=1), _ctx())
    assert [r.value for r in result.records] == [b"-"]
    assert "PYTHONSAFEPATH" not in os.environ
