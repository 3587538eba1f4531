"""NodeRegistry: listeners opened once per node, waited for by every connection that
announces them, and never cancelled by one of those connections going away."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kiproxy.proxy.brokers.nodes import NodeRegistry


def _registry(opened: list[int], delay: float = 0.05, fail: bool = False) -> NodeRegistry:
    async def open_listener(node_id: int, port: int) -> None:
        await asyncio.sleep(delay)
        if fail:
            raise OSError(f"port {port} is taken")
        opened.append(node_id)

    return NodeRegistry(advertised_host="127.0.0.1", broker_port_start=9100, node_ports={},
                        open_listener=open_listener)


async def test_a_cancelled_wait_leaves_the_listener_opening_for_the_others() -> None:
    opened: list[int] = []
    registry = _registry(opened)
    assert registry.seen(1, "10.0.0.1", 9092) == ("127.0.0.1", 9101)
    leaving = asyncio.create_task(registry.settle())  # a connection whose client leaves
    staying = asyncio.create_task(registry.settle())
    await asyncio.sleep(0.01)
    leaving.cancel()
    await staying
    assert opened == [1]  # the other connection was let go only once the listener was open
    assert registry.unopened == {}
    assert not registry.unsettled


async def test_a_listener_that_fails_is_named_and_its_error_counts_as_retrieved(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry([], delay=0.0, fail=True)
    registry.seen(1, "10.0.0.1", 9092)
    waiter = asyncio.create_task(registry.settle())
    await asyncio.sleep(0)
    waiter.cancel()  # nobody is waiting when it fails
    await asyncio.sleep(0.01)
    assert registry.unopened == {1: (9101, "port 9101 is taken")}

    unwatched = _registry([], delay=0.0, fail=True)
    unwatched.seen(1, "10.0.0.1", 9092)  # nobody waits and nobody asks
    await asyncio.sleep(0.01)
    unwatched._opening.clear()  # the failed task is collected
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_stopping_cancels_the_listeners_still_being_opened() -> None:
    """A waiter going away no longer cancels an opening, so the server stopping must: a
    listener opened after the others were closed would outlive the proxy's stop."""
    opened: list[int] = []
    registry = _registry(opened, delay=0.05)
    registry.seen(1, "10.0.0.1", 9092)
    registry.stop_opening()
    await registry.settle()
    await asyncio.sleep(0.1)
    assert opened == []
    assert registry.unopened == {1: (9101, "cancelled")}
