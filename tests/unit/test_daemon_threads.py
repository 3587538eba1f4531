"""``DaemonThreads``: an executor whose hung calls do not keep a stopping process alive."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from kiproxy.interceptors.builtin._daemon_threads import DaemonThreads


async def test_calls_run_at_most_max_workers_at_once_and_answer_as_any_executor() -> None:
    pool = DaemonThreads(2, "t-pool")
    running, most, lock = [0], [0], threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if i == 3:
            raise ValueError("three")
        return i * 10

    loop = asyncio.get_running_loop()
    results = await asyncio.gather(*(loop.run_in_executor(pool, work, i) for i in range(6)),
                                   return_exceptions=True)
    assert results[:3] == [0, 10, 20] and isinstance(results[3], ValueError)
    assert results[4:] == [40, 50]
    assert most[0] == 2
    names = {t.name for t in threading.enumerate() if t.name.startswith("t-pool_")}
    assert names <= {"t-pool_0", "t-pool_1"} and names
    pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("t-pool_")]
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(work, 0)


def test_shutdown_cancels_what_has_not_started() -> None:
    pool = DaemonThreads(1, "t-cancel")
    started = threading.Event()
    release = threading.Event()

    def block() -> None:
        started.set()
        release.wait(5)

    first = pool.submit(block)
    waiting = pool.submit(block)
    assert started.wait(5)
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled() and not first.cancelled()
    release.set()
    assert first.result(5) is None


def test_a_hung_call_does_not_hold_the_process_at_exit() -> None:
    # The standard library's pool joins its threads at exit: this would take a minute.
    code = (
        "import time\n"
        "from kiproxy.interceptors.builtin._daemon_threads import DaemonThreads\n"
        "pool = DaemonThreads(1, 'hung')\n"
        "pool.submit(time.sleep, 60)\n"
        "time.sleep(0.2)\n"
        "pool.shutdown(wait=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_a_pool_dropped_without_shutdown_lets_its_threads_end() -> None:
    import gc

    pool = DaemonThreads(2, "t-dropped")
    assert [pool.submit(pow, 2, i).result(5) for i in range(4)] == [1, 2, 4, 8]
    threads = [t for t in threading.enumerate() if t.name.startswith("t-dropped_")]
    assert threads
    del pool
    gc.collect()
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)
