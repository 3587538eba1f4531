"""Plugin bugs the proxy must hold against, end to end: Tansu, ``kiproxy run`` as a
subprocess, real producers.

One proxy serves the module, with one route so far:

* ``stubborn-`` topics run ``tp_slow:Stubborn`` with ``timeout_ms: 300``: an
  ``async def intercept`` that swallows its cancellation and sleeps on (two sleeps of
  1.5 s). The producer is answered REQUEST_TIMED_OUT at the deadline, not when the
  plugin ends; nothing is stored, the audit log and ``kiproxy_interceptor_errors``
  say timeout, and once the plugin ends the proxy warns that it ignored its
  cancellation.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, high_watermark, launch_proxy
from hardening.fault_relay import wait_until

from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
REQUEST_TIMED_OUT = 7
STUBBORN = "tp_slow:Stubborn"


class Proxy:
    """The module's proxy and where it writes its audit log and metrics."""

    def __init__(self, process: ProxyProcess, audit: Path, metrics: str) -> None:
        self.process = process
        self.audit = audit
        self.metrics = metrics

    def audited(self, topic: str) -> list[dict[str, Any]]:
        lines = self.audit.read_text().splitlines() if self.audit.exists() else []
        return [e for e in map(json.loads, lines)
                if e.get("event") == "produce" and e.get("topic") == topic]

    def timeouts(self) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kiproxy_interceptor_errors_total{")
                   and 'reason="timeout"' in line)


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    where = tmp_path_factory.mktemp("plugin-bugs")
    metrics = f"127.0.0.1:{free_port()}"
    config = where / "kiproxy.json"
    config.write_text(json.dumps({"routes": [
        {"name": "stubborn", "match": {"topic": "stubborn-.*"},
         "interceptors": [{"class": STUBBORN, "timeout_ms": 300,
                           "config": {"sleep_ms": 1500, "times": 2}}]},
    ]}))
    audit = where / "audit.jsonl"
    p = launch_proxy(broker.bootstrap, "--audit-log", str(audit), "--metrics-listen", metrics,
                     plugins_dir=PLUGINS, config_file=config)
    yield Proxy(p, audit, metrics)
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_a_plugin_that_swallows_its_cancellation_is_timed_out_at_the_deadline(
        proxy: Proxy) -> None:
    from confluent_kafka import KafkaError, Producer
    from kafka import KafkaProducer
    from kafka.errors import RequestTimedOutError

    topic = _name("stubborn")
    before = proxy.timeouts()
    # REQUEST_TIMED_OUT is retriable: retries=0 lets the client report it at once.
    cf = Producer({"bootstrap.servers": proxy.process.bootstrap, "retries": 0,
                   "message.timeout.ms": 20000})
    errors: list[Any] = []
    cf.produce(topic, value=b"late", partition=0, on_delivery=lambda e, _m: errors.append(e))
    cf.flush(20)
    # Had the proxy waited for the plugin to end, the batch would have been stored.
    assert [e.code() if e else None for e in errors] == [KafkaError.REQUEST_TIMED_OUT]

    kp = KafkaProducer(bootstrap_servers=proxy.process.bootstrap, retries=0)
    try:
        with pytest.raises(RequestTimedOutError) as info:
            kp.send(topic, value=b"late too", partition=0).get(timeout=15)
        assert f"interceptor {STUBBORN} did not finish within 300 ms" in str(info.value)
    finally:
        kp.close(timeout=5)

    assert high_watermark(proxy.process.bootstrap, topic) == 0
    assert proxy.timeouts() - before == 2
    proxy.process.wait_for_line("level=WARNING", f"rejected {topic}",
                                "did not finish within 300 ms")
    warning = proxy.process.wait_for_line(f"interceptor {STUBBORN} ignored its cancellation")
    assert "level=WARNING" in warning and "returned, which was dropped" in warning
    assert wait_until(lambda: len(proxy.audited(topic)) == 2, 10), proxy.audited(topic)
    assert [(e["outcome"], e["error_code"]) for e in proxy.audited(topic)] == \
        [("rejected", REQUEST_TIMED_OUT)] * 2
