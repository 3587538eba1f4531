"""``kiproxy dev --kms``: the dev mode with a stand-in for AWS KMS (moto's server) beside
the broker. It creates the keys ``--kms-key`` names, prints the endpoint, region and
credentials, the proxy it runs encrypts with ``record_encryption`` as the first-try
configuration reads, and Ctrl-C stops the stand-in too. KMS flags without ``--kms`` are
one line.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from support.dev_mode import popen_dev, running_dev

from kiproxy_dev.processes import port_free
from kiproxy_dev.tansu import free_port

pytestmark = pytest.mark.timeout(180)


def test_dev_with_a_kms_creates_its_keys_and_the_proxy_encrypts_with_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka import KafkaConsumer, KafkaProducer
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)  # as a new user's shell: dev --kms supplies credentials
    listen, kms_port = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{kms_port}"
    config = {"kms": {"type": "aws", "endpoint": endpoint, "region": "us-east-1"},
              "key": "alias/KEK_${topic}"}
    with running_dev("--kms", "--kms-port", str(kms_port), "--kms-key", "alias/KEK_orders",
                     "--listen", f"127.0.0.1:{listen}", "--interceptor", "record_encryption",
                     "--interceptor-config", json.dumps(config)) as dev:
        bootstrap = dev.wait_bootstrap(120)
        assert (f"kiproxy: KMS stand-in (AWS KMS API, moto, in memory) at {endpoint}, "
                "region us-east-1") in dev.lines
        assert any(re.fullmatch(r"kiproxy: KMS key alias/KEK_orders \(arn:aws:kms:.*\)", line)
                   for line in dev.lines), dev.output
        assert ("kiproxy: the proxy uses these credentials; a client of the stand-in needs "
                "them too: export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test "
                "AWS_DEFAULT_REGION=us-east-1") in dev.lines
        assert "kms.endpoint" not in dev.output  # the proxy calls the stand-in: no warning

        producer = KafkaProducer(bootstrap_servers=bootstrap)
        producer.send("orders", b"card 4111", key=b"o1").get(timeout=30)
        producer.send("clicks", b"page 7", key=b"c1").get(timeout=30)  # no key: stored as is
        producer.close()
        broker = re.search(r"embedded broker \(Tansu, memory storage\) on (\S+?)\"",
                           dev.output)
        assert broker is not None, dev.output
        seen = {}
        for topic in ("orders", "clicks"):
            consumer = KafkaConsumer(topic, bootstrap_servers=broker.group(1),
                                     auto_offset_reset="earliest", consumer_timeout_ms=10_000)
            m = next(consumer)  # each topic holds one record
            seen[topic] = (m.key, m.value, [h[0] for h in m.headers])
            consumer.close()
        key, value, headers = seen["orders"]
        assert key == b"o1" and b"4111" not in value and headers == ["kiproxy.encryption"]
        assert seen["clicks"] == (b"c1", b"page 7", [])

        dev.interrupt()
        assert dev.process.wait(60) == 0, dev.output
        assert port_free(kms_port), "the KMS stand-in still listens after Ctrl-C"
        assert "Traceback" not in dev.output


def test_kms_flags_without_kms_are_one_line() -> None:
    proc = popen_dev("--kms-key", "alias/KEK_orders")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1] == (
        "kiproxy: config error: --kms-port and --kms-key need --kms")


def test_a_broker_port_leaving_no_room_for_the_kafka_nodes_is_one_line() -> None:
    proc = popen_dev("--broker", "kafka", "--kafka-nodes", "3", "--broker-port", "65534")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1] == (
        "kiproxy: config error: --broker-port 65534 leaves no port for node 3 (PORT + N - 1 "
        "is at most 65535)")


def test_kms_without_moto_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kiproxy_dev.kms import KmsLaunchError, LocalKms

    monkeypatch.setitem(sys.modules, "moto.server", None)  # as if moto were not installed
    with pytest.raises(KmsLaunchError, match=r"pip install './dev\[kms\]' from a kiproxy "
                                             "checkout"):
        LocalKms(0).start()
