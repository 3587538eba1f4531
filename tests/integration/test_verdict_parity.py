"""The proxy, replay and the plugin test kit give the same verdict on the same batch.

One plugin (``tests/plugins/tp_parity.py``) answers by topic: unchanged,
transformed (sync and ``async def``, values or only offset deltas), rejected by
policy with record errors, the record-count rule broken, an exception, a wrong
return type, a missed deadline. Each batch goes through a ``kiproxy run``
process in front of a real broker (Tansu), sent as a Produce v9 request from a
socket so that the answer's ``error_message`` and ``record_errors`` can be
read, through replay's :class:`~kiproxy.pipelines.apply.InterceptorRunner` and
through the test kit's :func:`~kiproxy.interceptors.testing.run_interceptor`.
All three must agree on the kind (the proxy's from its ``kiproxy_produce_batches``
metric), the error code, the message, the record errors and the records stored.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, launch_proxy
from prometheus_client.parser import text_string_to_metric_families

from kiproxy.interceptors import RecordBatch
from kiproxy.interceptors.testing import Plugin, load, run_interceptor
from kiproxy.interceptors.verdict import Outcome
from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec
from kiproxy.pipelines.sources import SourceBatch
from kiproxy.protocol.records import Record, build_batch, decode_batches
from kiproxy_dev.tansu import EmbeddedBroker, free_port

from .test_interception import RawClient, _create_topics

pytestmark = pytest.mark.timeout(120)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
SPEC = "tp_parity:Parity"
TIMEOUT_MS = 300
STAMP = 1_763_848_800_000
CASES = ["same", "copy", "upper", "offsets", "reject", "shrink", "raise", "none", "async",
         "slow", "bytes", "surrogate"]
EXPECTED_KIND = {"same": "unchanged", "copy": "unchanged", "upper": "transformed",
                 "offsets": "transformed", "async": "transformed"}


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker) -> Iterator[tuple[ProxyProcess, str]]:
    metrics = f"127.0.0.1:{free_port()}"
    p = launch_proxy(broker.bootstrap, "--interceptor-timeout-ms", str(TIMEOUT_MS),
                     "--metrics-listen", metrics, interceptor=SPEC, plugins_dir=PLUGINS)
    yield p, metrics
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


@pytest.fixture(scope="module")
def runner() -> Iterator[InterceptorRunner]:
    r = InterceptorRunner(InterceptorSpec(SPEC, plugins_dir=str(PLUGINS), timeout_ms=TIMEOUT_MS))
    yield r
    r.close()


@pytest.fixture(scope="module")
def kit_plugin() -> Iterator[Plugin]:
    with load(SPEC, plugins_dir=PLUGINS) as plugin:
        yield plugin


def _records() -> list[Record]:
    return [Record(key=b"k%d" % i, value=b"value %d" % i,
                   headers=[("h", b"1"), ("h", None), ("n", b"%d" % i)], timestamp=STAMP + i)
            for i in range(3)]


def _outcome_kind(metrics: str, topic: str) -> str:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    kinds = {s.labels["outcome"] for f in text_string_to_metric_families(text)
             for s in f.samples
             if s.name == "kiproxy_produce_batches_total" and s.labels.get("topic") == topic}
    assert len(kinds) == 1, kinds
    return {"forwarded": "unchanged"}.get(kinds.pop(), "transformed")


def _through_proxy(proxy: ProxyProcess, metrics: str, topic: str,
                   data: bytes) -> dict[str, Any]:
    _create_topics(proxy.bootstrap, topic)
    with RawClient(proxy.bootstrap) as client:
        client.send(RawClient.produce(9, [(topic, data)]))
        _, response = client.read_produce(9)
    [part] = [p for t in response.responses for p in t.partition_responses]
    code = int(part.error_code)
    if code:
        return {"kind": "rejected", "code": code, "message": part.error_message,
                "record_errors": tuple((int(e.batch_index), e.batch_index_error_message)
                                       for e in part.record_errors)}
    stored = consume(proxy.bootstrap, topic, 3)
    return {"kind": _outcome_kind(metrics, topic),
            "stored": [(m.key(), m.value(), [(k, None if v is None else bytes(v))
                                              for k, v in m.headers() or []],
                        m.timestamp()[1]) for m in stored]}


def _seen(outcome: Outcome) -> dict[str, Any]:
    """What a producer would see of an outcome: the rejection, or the records stored."""
    if outcome.kind == "rejected":
        return {"kind": "rejected", "code": outcome.code, "message": outcome.message,
                "record_errors": outcome.record_errors}
    return {"kind": outcome.kind,
            "stored": [(r.key, r.value, [(h.key, h.value) for h in r.headers], r.timestamp)
                       for r in outcome.records]}


def _through_replay(runner: InterceptorRunner, topic: str, data: bytes) -> dict[str, Any]:
    [decoded] = decode_batches(data)
    return _seen(runner.apply(SourceBatch(
        topic=topic, partition=0, offsets=(0, 1, 2), records=decoded.records, stored=True)))


def _through_test_kit(plugin: Plugin, topic: str, data: bytes) -> dict[str, Any]:
    [decoded] = decode_batches(data)
    return _seen(run_interceptor(plugin, RecordBatch(topic=topic, partition=0,
                                                     records=decoded.records),
                                 timeout_ms=TIMEOUT_MS))


@pytest.mark.parametrize("case", CASES)
def test_proxy_replay_and_test_kit_agree(proxy: tuple[ProxyProcess, str],
                                         runner: InterceptorRunner, kit_plugin: Plugin,
                                         case: str) -> None:
    p, metrics = proxy
    topic = f"{case}-{uuid.uuid4().hex[:8]}"
    data = build_batch(_records())

    inline = _through_proxy(p, metrics, topic, data)
    replayed = _through_replay(runner, topic, data)
    kit = _through_test_kit(kit_plugin, topic, data)

    assert inline == replayed
    assert inline == kit
    assert inline["kind"] == EXPECTED_KIND.get(case, "rejected")
    expected_rejection = {
        "reject": (44, "reject-* is closed", ((1, "the second record"),)),
        "shrink": (87, f"interceptor {SPEC} broke the record-count rule: returned 2 records "
                       "for a batch of 3", ()),
        "raise": (87, f"interceptor {SPEC} failed: ValueError: cannot handle {topic}", ()),
        "none": (87, f"interceptor {SPEC} returned NoneType, not a RecordBatch", ()),
        "slow": (7, f"interceptor {SPEC} did not finish within {TIMEOUT_MS} ms", ()),
        "bytes": (87, f"interceptor {SPEC} returned records that cannot be encoded: "
                      "TypeError: record 0 is a bytes, not a Record", ()),
        "surrogate": (87, f"interceptor {SPEC} returned records that cannot be encoded: "
                          "UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' "
                          "in position 0: surrogates not allowed", ()),
    }
    if case in expected_rejection:
        assert (inline["code"], inline["message"], inline["record_errors"]) == \
            expected_rejection[case]
