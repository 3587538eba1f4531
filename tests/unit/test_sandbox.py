"""The Wasm hosts' shared backoff (``interceptors/builtin/sandbox.py``), on a fake clock, and
their worker threads."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from kiproxy.interceptors.builtin.sandbox import Backoff, SandboxHost, mib
from kiproxy.interceptors.testing import make_batch


def test_backoff_starts_at_the_third_crash_doubles_and_is_capped() -> None:
    now = [100.0]
    backoff = Backoff(clock=lambda: now[0])
    backoff.crashed("first")
    backoff.crashed("second")
    assert backoff.refusal() is None, "one or two crashes are a bad record's cost"
    for i, period in enumerate([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]):
        start = now[0]
        backoff.crashed(f"crash {i}")
        refusal = backoff.refusal()
        assert refusal is not None and refusal.startswith(f"crash {i} (it crashed {i + 3} "
                                                          "times in a row;")
        now[0] = start + period - 0.01
        assert backoff.refusal() is not None
        now[0] = start + period + 0.01
        assert backoff.refusal() is None, "after the period the plugin is tried again"


def test_an_answer_ends_the_backoff() -> None:
    now = [0.0]
    backoff = Backoff(clock=lambda: now[0])
    for _ in range(4):
        backoff.crashed("trap")
    assert backoff.refusal() is not None
    backoff.answered()
    assert backoff.refusal() is None and backoff.crashes == 0
    backoff.crashed("trap")
    assert backoff.refusal() is None, "the count starts again"


def test_sizes_are_written_as_people_read_them() -> None:
    assert (mib(256 * 2**20), mib(6400 * 1024), mib(100)) == ("256 MiB", "6400 KiB", "100 bytes")


async def test_a_plugin_busy_on_all_its_threads_holds_up_no_other_plugin() -> None:
    """Each plugin has its own worker threads: two batches of a looping plugin, on a host
    of one thread per plugin, leave another plugin's batch to run at once."""
    release = threading.Event()
    class Plugin:
        def close(self) -> None:
            pass

    host: SandboxHost[str, Any] = SandboxHost(lambda spec: Plugin(), 1, thread_name="t")
    looping, other = host.load("looping"), host.load("other")
    batch = make_batch(b"v")

    def loop_until_released() -> Any:
        release.wait(10)
        return batch

    deadline = time.monotonic() + 10
    busy = [asyncio.ensure_future(host.call(looping, loop_until_released, deadline))
            for _ in range(2)]
    try:
        answered = host.call(other, lambda: batch, deadline)
        assert not isinstance(answered, type(batch))
        assert await asyncio.wait_for(answered, 5) is batch  # not after the loop ends
        assert not any(task.done() for task in busy)
    finally:
        release.set()
        await asyncio.gather(*busy)
        host.close()
