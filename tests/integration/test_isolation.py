"""Plugin isolation end to end: ``--interceptor-isolation process``, a real broker, real producers.

The plugin ``iso_plugins:SpinOrUpper`` (``tests/isolation_plugins``) runs
``while True: pass`` on topics whose names start with ``spin`` and upper-cases
values elsewhere. With the interceptor in worker processes, the spinning batch
costs its producer one REQUEST_TIMED_OUT at the deadline and one worker (killed
and replaced); a producer on another topic, at the same time, loses nothing.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import consume, high_watermark, launch_proxy
from support.dev_mode import DevMode

from kiproxy_dev.tansu import EmbeddedBroker

PLUGINS = Path(__file__).resolve().parents[1] / "isolation_plugins"
REQUEST_TIMED_OUT = 7

pytestmark = pytest.mark.timeout(180)


def _create_topics(bootstrap: str, *topics: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(t, 1, 1) for t in topics]).values():
        future.result(30)


def _producer(bootstrap: str, client_id: str, **conf: Any) -> Any:
    from confluent_kafka import Producer

    # retries=0: any rejection, timeout included, surfaces as a delivery error.
    return Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                     "retries": 0, **conf})


def _produce_spin(bootstrap: str, topic: str, n: int) -> list[Any]:
    """Produce ``n`` records to a spin topic in one batch; return the delivery errors."""
    producer = _producer(bootstrap, "spinner", **{"linger.ms": 100})
    errors: list[Any] = []
    for i in range(n):
        producer.produce(topic, value=b"spin-%d" % i,
                         on_delivery=lambda err, msg: errors.append(err))
    assert producer.flush(60) == 0
    return errors


def test_a_spinning_plugin_costs_one_batch_and_other_producers_keep_flowing(
        broker: EmbeddedBroker) -> None:
    suffix = uuid.uuid4().hex[:8]
    spin, other, later = f"spin-{suffix}", f"up-{suffix}", f"later-{suffix}"
    proxy = launch_proxy(broker.bootstrap, "--interceptor-isolation", "process",
                         "--interceptor-timeout-ms", "1000", plugins_dir=PLUGINS,
                         interceptor="iso_plugins:SpinOrUpper")
    try:
        assert "interceptor iso_plugins:SpinOrUpper loaded in 2 worker processes" in proxy.log
        _create_topics(proxy.bootstrap, spin, other, later)

        spin_errors: list[Any] = []
        spinner = threading.Thread(
            target=lambda: spin_errors.extend(_produce_spin(proxy.bootstrap, spin, 5)))
        spinner.start()

        # Meanwhile another producer sends one record per request, on another topic.
        producer = _producer(proxy.bootstrap, "steady", **{"linger.ms": 0})
        delivered: list[Any] = []
        while_spinning = 0
        sent = 0
        while spinner.is_alive() or sent < 40 + while_spinning:
            producer.produce(other, value=b"steady-%04d" % sent,
                             on_delivery=lambda err, msg: delivered.append(err))
            assert producer.flush(30) == 0
            sent += 1
            if spinner.is_alive():
                while_spinning += 1
        spinner.join()

        assert [e.code() for e in spin_errors] == [REQUEST_TIMED_OUT] * 5
        assert delivered == [None] * sent
        assert while_spinning > 1  # records went through while the spin batch was stuck
        got = consume(proxy.bootstrap, other, sent)
        assert [m.value() for m in got] == [b"STEADY-%04d" % i for i in range(sent)]

        # The proxy keeps serving: a new producer, and the spin topic fails the same way.
        _, errors = _produce_later(proxy.bootstrap, later)
        assert errors == []
        assert [m.value() for m in consume(proxy.bootstrap, later, 10)] == [
            b"LATER-%d" % i for i in range(10)]
        assert [e.code() for e in _produce_spin(proxy.bootstrap, spin, 2)] == [
            REQUEST_TIMED_OUT] * 2
        until = time.monotonic() + 30
        while proxy.log.count("started, replacing pid") < 2 and time.monotonic() < until:
            time.sleep(0.05)
        assert proxy.alive()
    finally:
        assert proxy.stop() == 0
    log = proxy.log
    # Plugin faults are WARNINGs rate-limited per plugin and fault (one per 10 s): the
    # first of the two missed deadlines is always logged, the second only if 10 s apart.
    missed = [line for line in proxy.lines if f"rejected {spin}[0] from" in line
              and "interceptor iso_plugins:SpinOrUpper did not finish within 1000 ms" in line]
    assert 1 <= len(missed) <= 2 and all("level=WARNING" in line for line in missed)
    assert log.count(f"still busy at the deadline of {spin}[0]; starting a replacement") == 2
    assert log.count("started, replacing pid") == 2
    assert high_watermark(broker.bootstrap, spin) == 0  # nothing of it was stored


def _produce_later(bootstrap: str, topic: str) -> tuple[list[Any], list[Any]]:
    producer = _producer(bootstrap, "later", **{"linger.ms": 5})
    results: list[Any] = []
    for i in range(10):
        producer.produce(topic, value=b"later-%d" % i,
                         on_delivery=lambda err, msg: results.append(err))
    assert producer.flush(30) == 0
    return results, [e for e in results if e is not None]


def test_a_spinning_worker_does_not_outlive_a_killed_proxy(broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap, "--interceptor-isolation", "process",
                         "--interceptor-timeout-ms", "60000", plugins_dir=PLUGINS,
                         interceptor="iso_plugins:SpinOrUpper")
    try:
        workers = [p for p in psutil.Process(proxy.process.pid).children(recursive=True)
                   if p.pid in _worker_pids(proxy.log)]
        assert len(workers) == 2
        producer = _producer(proxy.bootstrap, "spinner")
        producer.produce(f"spin-{uuid.uuid4().hex[:8]}", value=b"x")
        producer.poll(0)
        until = time.monotonic() + 30
        while max(w.cpu_times().user for w in workers) < 0.5 and time.monotonic() < until:
            time.sleep(0.1)  # until one worker is seen spinning
        producer.purge()
        del producer
    finally:
        proxy.process.kill()  # no shutdown: the proxy just vanishes
        proxy.process.wait(10)
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == []


def _worker_pids(log: str) -> set[int]:
    match = re.search(r"loaded in \d+ worker processes \(pids ([\d, ]+)\)", log)
    assert match is not None, log
    return {int(pid) for pid in match.group(1).split(", ")}


def test_a_plugin_that_cannot_load_in_a_worker_stops_the_proxy_at_start(
        broker: EmbeddedBroker) -> None:
    with pytest.raises(RuntimeError) as caught:
        launch_proxy(broker.bootstrap, "--interceptor-isolation", "process",
                     plugins_dir=PLUGINS, interceptor="iso_plugins:BadConfigure")
    assert ("kiproxy: plugin error: iso_plugins:BadConfigure.configure() failed: "
            "ValueError: setting 'url' is required") in str(caught.value)


def test_workers_import_the_installed_package_whatever_the_working_directory_holds(
        tmp_path: Path) -> None:
    # `kiproxy dev` started where a directory is named ``kiproxy`` (a clone of the
    # repository, say): the fork server's ``python -c`` would put that directory first
    # on sys.path and every worker would import it as an empty namespace package.
    import subprocess
    import sys

    from kiproxy_dev.tansu import free_port

    (tmp_path / "kiproxy").mkdir()
    command = [str(Path(sys.executable).with_name("kiproxy")), "dev",
               "--listen", f"127.0.0.1:{free_port()}", "--plugins-dir", str(PLUGINS),
               "--interceptor", "iso_plugins:Same", "--interceptor-isolation", "process",
               "--interceptor-workers", "1"]
    dev = DevMode(subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True))
    try:
        dev.wait_bootstrap(120)
    finally:
        dev.kill()
    assert any("loaded in 1 worker process" in line for line in dev.lines), dev.output
