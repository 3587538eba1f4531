"""``record_encryption`` against the AWS KMS API (moto's server on loopback), through
``kiproxy run`` in front of Tansu, with confluent-kafka clients.

* The issue's first try, exactly: ``--interceptor record_encryption`` with
  ``{"kms": {"type": "aws", "endpoint": ..., "region": "us-east-1"}, "key":
  "alias/KEK_${topic}"}`` and the credentials in the environment, as AWS SDKs read
  them. A topic whose alias exists is stored sealed (a consumer straight to the broker
  sees the marker header and no plaintext) and read back as produced through the proxy;
  a topic without a key is stored as it came (``unresolved_key: pass``).
* The KMS going away (a relay in front of moto, closed and opened again on the same
  port): a producer to an encrypted topic that needs a new data key gets a retriable
  error and nothing reaches the broker, a topic outside ``topics:`` is served all the
  while, a topic whose data key is cached keeps working, and once the KMS answers
  again the waiting records are sealed and delivered.
* A reload to a key template whose own text makes an alias name AWS refuses
  (``alias/KEK.${topic}``), which would store every topic in clear under
  ``unresolved_key: pass``, is refused; the running configuration stays.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from conftest import high_watermark, launch_proxy
from hardening.fault_relay import FaultRelay
from moto.server import ThreadedMotoServer
from support.confluent import confluent_producer

from integration.test_fetch_hook import _create, _produce, _read
from integration.test_record_encryption_e2e import _reload, _write_config
from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(240)

REGION = "us-east-1"


@pytest.fixture(scope="module")
def kms() -> Iterator[tuple[str, Any]]:
    """moto's KMS on loopback and a boto3 client of it; the proxy's environment holds
    the credentials a user exports."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="AKIAKIPROXYTEST",
                      AWS_SECRET_ACCESS_KEY="kiproxy-test-secret",
                      AWS_EC2_METADATA_DISABLED="true")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    yield endpoint, boto3.client("kms", endpoint_url=endpoint, region_name=REGION)
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _kek(admin: Any, alias: str) -> None:
    key = admin.create_key(Description="kiproxy test KEK")["KeyMetadata"]["KeyId"]
    admin.create_alias(AliasName=alias, TargetKeyId=key)


def test_the_first_try_interface(broker: EmbeddedBroker, kms: tuple[str, Any]) -> None:
    endpoint, admin = kms
    orders = f"orders-{uuid.uuid4().hex[:6]}"
    other = f"other-{uuid.uuid4().hex[:6]}"
    _kek(admin, f"alias/KEK_{orders}")
    _create(broker.bootstrap, orders, other)
    proxy = launch_proxy(broker.bootstrap, interceptor="record_encryption",
                         interceptor_config={"kms": {"type": "aws", "endpoint": endpoint,
                                                     "region": REGION},
                                             "key": "alias/KEK_${topic}"})
    try:
        values = [f"card 4111-{i:04d}".encode() for i in range(30)]
        _produce(proxy.bootstrap, orders, values, **{"compression.type": "zstd"})
        _produce(proxy.bootstrap, other, values[:3])
        assert [m.value() for m in _read(proxy.bootstrap, [orders], 30)] == values
        stored = _read(broker.bootstrap, [orders], 30)
        assert len(stored) == 30
        assert all(m.value() not in values and (m.headers() or [])[-1][0] == MARKER_HEADER
                   for m in stored)
        assert [m.value() for m in _read(broker.bootstrap, [other], 3)] == values[:3]
    finally:
        proxy.stop()


def test_a_kms_that_goes_away_stores_nothing_in_clear_and_recovers(
        broker: EmbeddedBroker, kms: tuple[str, Any]) -> None:
    endpoint, admin = kms
    _kek(admin, "alias/KEK_faults")
    target = tuple(endpoint.removeprefix("http://").split(":"))
    port = free_port()
    relay = FaultRelay((target[0], int(target[1])), port).start()
    config = {"kms": {"type": "aws", "endpoint": f"http://127.0.0.1:{port}",
                      "region": REGION},
              "key": "alias/KEK_faults", "topics": ["enc-.*"]}
    cached, fresh, plain = (f"{p}-{uuid.uuid4().hex[:6]}" for p in ("enc-a", "enc-b", "plain"))
    _create(broker.bootstrap, cached, fresh, plain)
    proxy = launch_proxy(broker.bootstrap, "--interceptor-timeout-ms", "3000",
                         interceptor="record_encryption", interceptor_config=config)
    try:
        _produce(proxy.bootstrap, cached, [b"before"])
        assert [m.value() for m in _read(proxy.bootstrap, [cached], 1)] == [b"before"]
        relay.close()  # the KMS is unreachable from here on

        failed: list[str] = []
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                       "message.timeout.ms": 3000})
        producer.produce(fresh, value=b"secret while down", partition=0,
                         on_delivery=lambda err, msg: failed.append(str(err)) if err else None)
        producer.flush(20)
        assert failed, "a record was delivered to an encrypted topic while the KMS was down"
        assert high_watermark(broker.bootstrap, fresh) == 0  # nothing stored

        _produce(proxy.bootstrap, plain, [b"plain while down"])  # not encrypted: served
        _produce(proxy.bootstrap, cached, [b"cached key"])  # its data key is in memory
        assert [m.value() for m in _read(proxy.bootstrap, [cached], 2)] == [b"before",
                                                                            b"cached key"]

        relay = FaultRelay((target[0], int(target[1])), port).start()  # the KMS is back
        _produce(proxy.bootstrap, fresh, [b"secret after"])
        assert [m.value() for m in _read(proxy.bootstrap, [fresh], 1)] == [b"secret after"]
        assert _read(broker.bootstrap, [fresh], 1)[0].value() != b"secret after"
        assert proxy.alive()
        log = proxy.log
        assert "Traceback" not in log, log
        assert any("KMS" in line or "kms" in line for line in proxy.lines), log
    finally:
        proxy.stop()
        relay.close()


def test_a_kms_that_hangs_costs_only_the_topics_that_need_it(
        broker: EmbeddedBroker, kms: tuple[str, Any]) -> None:
    """A KMS that accepts and never answers (a relay holding its answers): a producer to
    an encrypted topic that needs a data key gets a retriable error within the
    interceptor's deadline and nothing is stored; a topic outside ``topics:`` is served
    meanwhile, and the proxy stays up."""
    endpoint, admin = kms
    _kek(admin, "alias/KEK_hangs")
    target = tuple(endpoint.removeprefix("http://").split(":"))
    relay = FaultRelay((target[0], int(target[1])), response_delay=60).start()
    fresh, plain = (f"{p}-{uuid.uuid4().hex[:6]}" for p in ("enc-h", "plain-h"))
    _create(broker.bootstrap, fresh, plain)
    proxy = launch_proxy(broker.bootstrap, "--interceptor-timeout-ms", "1500",
                         interceptor="record_encryption", interceptor_config={
                             "kms": {"type": "aws", "endpoint": f"http://{relay.address}",
                                     "region": REGION},
                             "key": "alias/KEK_hangs", "topics": ["enc-.*"]})
    try:
        failed: list[str] = []
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                       "message.timeout.ms": 3500})
        producer.produce(fresh, value=b"secret while hanging", partition=0,
                         on_delivery=lambda err, msg: failed.append(str(err)) if err else None)
        _produce(proxy.bootstrap, plain, [b"plain while hanging"])
        producer.flush(20)
        assert failed, "a record was delivered to an encrypted topic while the KMS hung"
        assert high_watermark(broker.bootstrap, fresh) == 0
        assert [m.value() for m in _read(proxy.bootstrap, [plain], 1)] == [
            b"plain while hanging"]
        assert proxy.alive() and "Traceback" not in proxy.log, proxy.log
    finally:
        proxy.stop()
        relay.close()


def test_a_reload_to_a_template_no_topic_has_an_alias_for_is_refused(
        broker: EmbeddedBroker, kms: tuple[str, Any], tmp_path: Any) -> None:
    endpoint, admin = kms
    topic = f"tmpl-{uuid.uuid4().hex[:6]}"
    _kek(admin, f"alias/KEK_{topic}")
    _create(broker.bootstrap, topic)
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "proxy.yaml"

    def write(key: str) -> None:
        _write_config(config, broker.bootstrap, metrics,
                      {"kms": {"type": "aws", "endpoint": endpoint, "region": REGION},
                       "key": key})

    write("alias/KEK_${topic}")
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        _produce(proxy.bootstrap, topic, [b"before the reload"])
        write("alias/KEK.${topic}")
        status, answer = _reload(metrics)
        assert status == 500 and answer["ok"] is False, answer
        assert ("key: 'alias/KEK.${topic}' names no usable key for any topic (for a topic t: "
                "'alias/KEK.t' is not a valid AWS KMS alias name: '.' is not allowed"
                ) in answer["message"], answer
        _produce(proxy.bootstrap, topic, [b"after the reload"])
        stored = _read(broker.bootstrap, [topic], 2)
        assert len(stored) == 2 and all(
            b"reload" not in m.value() and (m.headers() or [])[-1][0] == MARKER_HEADER
            for m in stored)
        assert [m.value() for m in _read(proxy.bootstrap, [topic], 2)] == [
            b"before the reload", b"after the reload"]
    finally:
        proxy.stop()
