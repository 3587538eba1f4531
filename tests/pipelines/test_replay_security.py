"""Replay and report against secured clusters: TLS, mTLS, SASL (PLAIN, SCRAM), real clients.

The secured clusters are the session's Tansu broker behind kiproxy's own TLS
listener (a CA made here with ``cryptography``, with and without client
certificates), behind the project's SASL gateway (tests/hardening/sasl_gateway.py,
real PLAIN and SCRAM server side), or behind both (SASL_SSL). Replays run
in-process on local Spark (the package's one session), and on a Spark
standalone cluster on loopback (a master and one worker started here) where
executors are separate processes that get the plugin and the settings only
through what the driver ships. Bad input runs the real ``kiproxy`` command and
must fail before any Spark job: its event log directory stays empty.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, ProxyProcess, consume, launch_proxy, wait_for_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID
from hardening.sasl_gateway import SaslGateway
from support.processes import runtime_env

from kiproxy.cli import main as kiproxy_main
from kiproxy.pipelines.client_security import load_client_security
from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.fetch_client import FetchClient
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]

PLUGINS = Path(__file__).parent / "plugins"
USERS = {"alice": "alice-Pa55-7f3e9c", "bob": "bob-Pa55-41d2aa"}
PASSWORD = USERS["alice"]


# ---------------------------------------------------------------------------- certificates


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    client_pem_keystore: Path
    client_p12: Path
    other_ca: Path


def _cert(cn: str, key: Any, issuer: x509.Name | None, issuer_key: Any, *, ca: bool,
          san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer or subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: Any) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("replay test CA", ca_key, None, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert("localhost", server_key, ca.subject, ca_key, ca=False, san=[
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert("replayer", client_key, ca.subject, ca_key, ca=False)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert("someone else", other_key, None, other_key, ca=True)
    files = {"ca.pem": _pem(ca), "server.pem": _pem(server), "server.key": _key_pem(server_key),
             "client.pem": _pem(client), "client.key": _key_pem(client_key),
             "client-keystore.pem": _key_pem(client_key) + _pem(client),
             "client.p12": pkcs12.serialize_key_and_certificates(
                 b"replayer", client_key, client, [ca],
                 serialization.BestAvailableEncryption(b"store-pass")),
             "other-ca.pem": _pem(other)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return Pki(*(d / name for name in ("ca.pem", "server.pem", "server.key", "client.pem",
                                       "client.key", "client-keystore.pem", "client.p12",
                                       "other-ca.pem")))


# ---------------------------------------------------------------------------- clusters


@pytest.fixture(scope="module")
def tls_proxy(pki: Pki, broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    """The broker behind kiproxy's TLS listener (server certificate only)."""
    p = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                     "--tls-key", str(pki.server_key))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def mtls_proxy(pki: Pki, broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    """The broker behind kiproxy's TLS listener that requires a client certificate."""
    p = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                     "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def gateway(broker: EmbeddedBroker) -> Iterator[SaslGateway]:
    """The broker behind a SASL gateway (PLAIN, SCRAM-SHA-256/512)."""
    gw = SaslGateway(broker.bootstrap, USERS).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def sasl_ssl_proxy(pki: Pki, gateway: SaslGateway) -> Iterator[ProxyProcess]:
    """SASL_SSL with mTLS: kiproxy's TLS listener (client certificate required) in front
    of the SASL gateway, which authenticates the SASL exchange the proxy passes on."""
    p = launch_proxy(gateway.address, "--tls-cert", str(pki.server_cert),
                     "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca))
    yield p
    p.stop()


def write_config(path: Path, **props: str) -> Path:
    """A client.properties file (keys with dots given as ``security_protocol=...``)."""
    path.write_text("# written by the test\n" + "".join(
        f"{k.replace('_', '.')}={v}\n" for k, v in props.items()))
    return path


def create_topic(bootstrap: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"sec-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions,
                                  replication_factor=1)])[name].result(15)
    return name


def produce_values(bootstrap: str, topic: str, partitions: int, per_partition: int,
                   **conf: Any) -> None:
    """``per_partition`` records into each partition: ``lower:`` values to transform, every
    97th a ``bad`` value (its stored batch is rejected), the rest plain; with headers."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50,
                         "batch.num.messages": 1000, "queue.buffering.max.messages": 500_000,
                         **conf})
    for p in range(partitions):
        for i in range(per_partition):
            value = b"bad %d" % i if i % 97 == 5 else b"lower:%d-%d" % (p, i) if i % 3 == 0 \
                else b"v%d" % i
            while True:
                try:
                    producer.produce(topic, value=value, key=b"k%d" % (i % 50), partition=p,
                                     timestamp=1_763_800_000_000 + i,
                                     headers=[("n", b"%d" % i)] if i % 2 else None)
                    break
                except BufferError:
                    producer.poll(0.05)
    assert producer.flush(60) == 0


@dataclass
class Truth:
    records: int = 0
    batches: int = 0
    rejected_records: int = 0
    rejected_batches: int = 0
    transformed_records: int = 0
    written: list[tuple[int, bytes | None, bytes | None, int]] | None = None


def truth_of(bootstrap: str, topic: str, partitions: int) -> Truth:
    """What a replay of replay_rules:RejectBad must report, from the stored batches."""
    t = Truth(written=[])
    with FetchClient(bootstrap) as client:
        for p in range(partitions):
            offset = 0
            end = client.high_watermark(topic, p, 0)
            while offset < end:
                batches = client.fetch(topic, p, offset).batches
                for b in batches:
                    values = [r.value or b"" for r in b.records]
                    t.records += len(values)
                    t.batches += 1
                    if any(v.startswith(b"bad") for v in values):
                        t.rejected_records += len(values)
                        t.rejected_batches += 1
                    else:
                        lowered = [v.startswith(b"lower:") for v in values]
                        t.transformed_records += sum(lowered)
                        assert t.written is not None
                        t.written += [(p, r.key, r.value.upper() if low else r.value,
                                       r.timestamp) for r, low in zip(b.records, lowered,
                                                                       strict=True)]
                    offset = b.header.base_offset + b.header.last_offset_delta + 1
    return t


def read_back(topic: str, broker: EmbeddedBroker, count: int,
              partitions: int) -> list[tuple[int, bytes | None, bytes | None, int]]:
    got = consume(broker.bootstrap, topic, count, partitions, timeout=30)
    with FetchClient(broker.bootstrap) as client:  # and nothing more than that was written
        assert sum(client.high_watermark(topic, p, 0) for p in range(partitions)) == count
    return sorted(((m.partition(), m.key(), m.value(), m.timestamp()[1]) for m in got),
                  key=lambda r: (r[0], r[3], r[2] or b""))


def kiproxy(*args: str) -> int:
    """``kiproxy ARGS`` in this process (reusing the package's SparkSession)."""
    return kiproxy_main([*args, "--no-progress"])


def assert_replay(report: Path, truth: Truth) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    assert (summary["records"], summary["batches"]) == (truth.records, truth.batches)
    assert (summary["rejected_records"], summary["rejected_batches"]) == \
        (truth.rejected_records, truth.rejected_batches)
    assert summary["transformed_records"] == truth.transformed_records
    return summary


# ---------------------------------------------------------------------------- settings


def test_client_properties_as_kafka_tools_take_them(pki: Pki, tmp_path: Path) -> None:
    jaas = write_config(
        tmp_path / "jaas.properties", security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512", ssl_truststore_location=str(pki.ca),
        ssl_truststore_type="PEM")
    with jaas.open("a") as f:  # a continued line, as client.properties files often have
        f.write('sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule \\\n'
                f'    required username="alice" password="{PASSWORD}";\n')
    s = load_client_security(jaas)
    assert (s.protocol, s.sasl_mechanism, s.sasl_username, s.sasl_password) == \
        ("SASL_SSL", "SCRAM-SHA-512", "alice", PASSWORD)
    assert s.ca_pem == pki.ca.read_text() and s.certificate_pem is None
    assert PASSWORD not in repr(s) and PASSWORD not in s.describe()
    assert s.describe() == "SASL_SSL, no client certificate, SCRAM-SHA-512 as alice"
    librdkafka = s.librdkafka()
    assert librdkafka["sasl.password"] == PASSWORD and librdkafka["ssl.ca.pem"] == s.ca_pem

    # --consumer-property overrides the file; a PKCS12 keystore is read with its password.
    s = load_client_security(jaas, [
        "security.protocol=SSL", "sasl.mechanism=", "sasl.jaas.config=",
        f"ssl.keystore.location={pki.client_p12}", "ssl.keystore.type=PKCS12",
        "ssl.keystore.password=store-pass", "ssl.endpoint.identification.algorithm="])
    assert s.protocol == "SSL" and not s.check_hostname
    assert s.certificate_pem and pki.client_cert.read_text().strip() in s.certificate_pem
    assert s.key_pem and "PRIVATE KEY" in s.key_pem and "PRIVATE KEY" not in repr(s)
    # The PEM keystore of Kafka (key and chain in one file), and librdkafka's two files.
    one = load_client_security(None, ["security.protocol=SSL",
                                      f"ssl.keystore.location={pki.client_pem_keystore}"])
    two = load_client_security(None, ["security.protocol=SSL",
                                      f"ssl.certificate.location={pki.client_cert}",
                                      f"ssl.key.location={pki.client_key}"])
    assert one.certificate_pem == two.certificate_pem == pki.client_cert.read_text()
    assert one.key_pem == two.key_pem == pki.client_key.read_text()


@pytest.mark.parametrize(("props", "message"), [
    (["security.protocol=SSL", "ssl.truststore.location=JKS"],
     r"is a JKS store, which Python cannot read\. Convert it to PKCS12 with `keytool"),
    (["request.timeout.ms=100"], r"--consumer-property: request\.timeout\.ms is not "
                                 r"understood by kiproxy; the understood keys are "),
    (["sasl.login.callback.handler.class=x"], r"OAUTHBEARER is not supported yet"),
    (["security.protocol=SASL_SSL", "sasl.mechanism=OAUTHBEARER"],
     r"OAUTHBEARER is not supported by kiproxy replay yet"),
    (["security.protocol=SASL_SSL", "sasl.mechanism=GSSAPI"], r"Kerberos \(GSSAPI\)"),
    (["security.protocol=SSL", "sasl.mechanism=PLAIN"],
     r"sasl\.mechanism is set but security\.protocol is SSL; use SASL_SSL"),
    (["security.protocol=SASL_PLAINTEXT", "sasl.mechanism=PLAIN", "sasl.username=alice"],
     r"needs a user name and password"),
    (["security.protocol=SASL_PLAINTEXT", "sasl.mechanism=SCRAM-SHA-256",
      "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required "
      f'username="alice" password="{PASSWORD}";'],
     r"PlainLoginModule does not do sasl\.mechanism SCRAM-SHA-256"),
    (["security.protocol=TLS"], r"security\.protocol TLS: use one of PLAINTEXT, SSL"),
    (["security.protocol=SSL", "ssl.keystore.location=P12", "ssl.keystore.password=nope"],
     r"cannot open it as PKCS12 \(wrong ssl\.keystore\.password"),
    ([f"sasl.password{PASSWORD}"], r"--consumer-property: expected KEY=VALUE, got no '='"),
])
def test_settings_that_cannot_work_are_refused_naming_the_key(
        pki: Pki, tmp_path: Path, props: list[str], message: str) -> None:
    jks = tmp_path / "truststore.jks"
    jks.write_bytes(b"\xfe\xed\xfe\xed\x00\x00\x00\x02" + b"\x00" * 40)
    props = [p.replace("=JKS", f"={jks}").replace("=P12", f"={pki.client_p12}")
             for p in props]
    with pytest.raises(PipelineError, match=message) as info:
        load_client_security(None, props)
    assert PASSWORD not in str(info.value)


def test_spark_kafka_source_never_gets_a_secret(pki: Pki) -> None:
    from kiproxy.pipelines.sources import choose_reader

    sasl = load_client_security(None, ["security.protocol=SASL_SSL", "sasl.mechanism=PLAIN",
                                       "sasl.username=alice", f"sasl.password={PASSWORD}",
                                       f"ssl.ca.location={pki.ca}"])
    assert choose_reader("auto", spark_kafka=True, security=sasl) == "fetch"
    with pytest.raises(PipelineError, match="appear in the query plan"):
        choose_reader("spark-kafka", spark_kafka=True, security=sasl)
    tls = load_client_security(None, ["security.protocol=SSL", f"ssl.ca.location={pki.ca}"])
    assert choose_reader("auto", spark_kafka=True, security=tls) == "spark-kafka"
    assert tls.spark_kafka_options() == {
        "kafka.security.protocol": "SSL", "kafka.ssl.endpoint.identification.algorithm": "https",
        "kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.certificates": tls.ca_pem}


def test_fetch_client_reauthenticates_before_the_sasl_session_ends(
        broker: EmbeddedBroker, small_topic: tuple[str, Truth]) -> None:
    """A broker-set session lifetime (KIP-368): the client reconnects and authenticates
    again instead of having its connection closed under it."""
    topic = small_topic[0]
    with SaslGateway(broker.bootstrap, USERS, session_lifetime_ms=1500) as gw:
        security = load_client_security(None, [
            "security.protocol=SASL_PLAINTEXT", "sasl.mechanism=SCRAM-SHA-512",
            "sasl.username=alice", f"sasl.password={PASSWORD}"])
        with FetchClient(gw.address, security=security) as client:
            first = client.fetch(topic, 0, 0).batches
            time.sleep(1.6)
            assert [b.header for b in client.fetch(topic, 0, 0).batches] == \
                [b.header for b in first]
        assert gw.stats.authenticated.count(("SCRAM-SHA-512", "alice")) >= 2
        assert not gw.stats.refused


# ---------------------------------------------------------------------------- local Spark


@pytest.fixture(scope="module")
def small_topic(broker: EmbeddedBroker) -> tuple[str, Truth]:
    """Three partitions of 400 records, produced by a real client, and what replay must say."""
    topic = create_topic(broker.bootstrap, 3)
    produce_values(broker.bootstrap, topic, 3, 400, **{"linger.ms": 5,
                                                        "batch.num.messages": 37})
    return topic, truth_of(broker.bootstrap, topic, 3)


def replay_and_backfill(bootstrap: str, config: Path, topic: str, truth: Truth,
                        broker: EmbeddedBroker, tmp_path: Path, *extra: str) -> dict[str, Any]:
    """A dry run and a backfill to a new topic through ``bootstrap``; both checked exactly."""
    common = ("--bootstrap", bootstrap, "--topic", topic, "--command-config", str(config),
              "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS), *extra)
    assert kiproxy("replay", *common, "--report", str(tmp_path / "dry")) == 0
    summary = assert_replay(tmp_path / "dry", truth)
    out = f"{topic}-out-{uuid.uuid4().hex[:6]}"
    assert kiproxy("replay", *common, "--report", str(tmp_path / "fill"),
                   "--output-topic", out) == 0
    filled = assert_replay(tmp_path / "fill", truth)
    assert truth.written is not None and filled["written_records"] == len(truth.written)
    assert read_back(out, broker, len(truth.written), 3) == \
        sorted(truth.written, key=lambda r: (r[0], r[3], r[2] or b""))
    return summary


def test_dry_run_and_backfill_through_kiproxy_tls_listener(
        pki: Pki, tls_proxy: ProxyProcess, broker: EmbeddedBroker, spark: Any,
        small_topic: tuple[str, Truth], tmp_path: Path) -> None:
    topic, truth = small_topic
    config = write_config(tmp_path / "client.properties", security_protocol="SSL",
                          ssl_truststore_location=str(pki.ca), ssl_truststore_type="PEM")
    summary = replay_and_backfill(tls_proxy.bootstrap, config, topic, truth, broker, tmp_path)
    assert summary["reader"] == "fetch"
    assert summary["security"] == "SSL, no client certificate"


def test_dry_run_and_backfill_with_a_client_certificate(
        pki: Pki, mtls_proxy: ProxyProcess, broker: EmbeddedBroker, spark: Any,
        small_topic: tuple[str, Truth], tmp_path: Path) -> None:
    """mTLS, with librdkafka's key names; the consumer reader (one record per chunk) and the
    backfill producer present the certificate too."""
    topic, truth = small_topic
    config = write_config(tmp_path / "client.properties", security_protocol="SSL",
                          ssl_ca_location=str(pki.ca),
                          ssl_certificate_location=str(pki.client_cert),
                          ssl_key_location=str(pki.client_key))
    summary = replay_and_backfill(mtls_proxy.bootstrap, config, topic, truth, broker,
                                  tmp_path)
    assert summary["security"] == "SSL, client certificate"
    report = tmp_path / "consumer"
    assert kiproxy("replay", "--bootstrap", mtls_proxy.bootstrap, "--topic", topic,
                   "--command-config", str(config), "--interceptor", "replay_rules:RejectBad",
                   "--plugins-dir", str(PLUGINS), "--reader", "consumer", "--chunk-records",
                   "1", "--report", str(report)) == 0
    chunked = json.loads((report / "summary.json").read_text())
    assert (chunked["reader"], chunked["records"]) == ("consumer", truth.records)
    assert chunked["rejected_records"] == 3 * len([i for i in range(400) if i % 97 == 5])
    assert chunked["transformed_records"] == 3 * len([i for i in range(0, 400, 3)
                                                      if i % 97 != 5])


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "PLAIN"])
def test_dry_run_and_backfill_through_sasl(
        mechanism: str, gateway: SaslGateway, broker: EmbeddedBroker, spark: Any,
        small_topic: tuple[str, Truth], tmp_path: Path) -> None:
    topic, truth = small_topic
    before = len(gateway.stats.authenticated)
    if mechanism == "PLAIN":  # librdkafka's names
        config = write_config(tmp_path / "client.properties",
                              security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                              sasl_username="alice", sasl_password=PASSWORD)
    else:  # the JAAS line of Kafka's Java tools
        config = write_config(tmp_path / "client.properties",
                              security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism)
        with config.open("a") as f:
            f.write("sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule "
                    f'required username="alice" password="{PASSWORD}";\n')
    summary = replay_and_backfill(gateway.address, config, topic, truth, broker, tmp_path)
    assert summary["security"] == f"SASL_PLAINTEXT, {mechanism} as alice"
    # The driver, the executors' Fetch clients and the librdkafka clients all authenticated.
    assert set(gateway.stats.authenticated[before:]) == {(mechanism, "alice")}
    for found in tmp_path.rglob("*"):
        if found.is_file() and found.name != "client.properties":
            assert PASSWORD.encode() not in found.read_bytes(), found


def test_report_reads_the_audit_topic_through_sasl(
        pki: Pki, sasl_ssl_proxy: ProxyProcess, broker: EmbeddedBroker, spark: Any,
        tmp_path: Path) -> None:
    """``kiproxy report --audit-topic`` over SASL_SSL with mTLS (driver and executors)."""
    from confluent_kafka import Producer

    audit_topic = create_topic(broker.bootstrap, 2)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(10):
        event = {"event": "produce", "ts": 1_763_800_000_000 + i * 60_000, "client_id": "c",
                 "client_address": "127.0.0.1:5000", "principal": "User:alice",
                 "api_version": 11, "correlation_id": i, "topic": "orders", "partition": 0,
                 "batches": 1, "records": 10 + i, "bytes": 100, "outcome": "forwarded",
                 "error_code": 0, "error_message": None, "base_offset": i, "latency_ms": 1.0}
        producer.produce(audit_topic, value=json.dumps(event).encode(), partition=i % 2)
    assert producer.flush(30) == 0
    config = write_config(tmp_path / "client.properties", security_protocol="SASL_SSL",
                          sasl_mechanism="SCRAM-SHA-512", sasl_username="alice",
                          sasl_password=PASSWORD, ssl_truststore_location=str(pki.ca),
                          ssl_keystore_location=str(pki.client_p12),
                          ssl_keystore_type="PKCS12", ssl_keystore_password="store-pass")
    out = tmp_path / "out"
    assert kiproxy("report", "--audit-topic", audit_topic, "--bootstrap",
                   sasl_ssl_proxy.bootstrap, "--command-config", str(config),
                   "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == sum(10 + i for i in range(10))
    assert not [f for f in out.rglob("*") if f.is_file()
                and PASSWORD.encode() in f.read_bytes()]


def test_transactional_topic_control_batches_are_skipped_across_offset_gaps(
        broker: EmbeddedBroker, spark: Any, tmp_path: Path) -> None:
    """Committed and aborted transactions on Tansu: the transaction markers (control
    batches) take offsets but hold no records; replay skips them, tasks cut through the
    gaps, and every data record is read once. Tansu reports no aborted transactions in
    Fetch (docs: PROTOCOL.md), so even read_committed (the default) replays the aborted
    records, as a read_uncommitted consumer sees them; read_committed filtering is tested
    on Apache Kafka (test_replay_apache_kafka.py)."""
    from confluent_kafka import Producer

    topic = create_topic(broker.bootstrap, 1)
    producer = Producer({"bootstrap.servers": broker.bootstrap,
                         "transactional.id": f"replay-{uuid.uuid4().hex[:6]}"})
    producer.init_transactions(30)
    for n, commit in ((30, True), (20, False), (10, True)):
        producer.begin_transaction()
        for i in range(n):
            producer.produce(topic, value=b"lower:%d" % i if commit else b"aborted %d" % i,
                             partition=0)
        producer.flush(30)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    with FetchClient(broker.bootstrap) as client:
        end = client.high_watermark(topic, 0, 0)
        stored = client.fetch(topic, 0, 0, max_bytes=1 << 20).batches
    control = [b for b in stored if b.header.is_control]
    data = [b for b in stored if not b.header.is_control]
    assert len(control) == 3 and sum(len(b.records) for b in data) == 60
    assert end == 63  # the markers' offsets are gaps between the records
    report = tmp_path / "report"
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                   "--max-records-per-task", "7", "--report", str(report)) == 0
    summary = json.loads((report / "summary.json").read_text())
    assert (summary["records"], summary["batches"]) == (60, len(data))
    assert summary["transformed_records"] == 40 and summary["rejected_records"] == 0
    assert (summary["control_batches_skipped"], summary["aborted_records_skipped"]) == (3, 0)


# ---------------------------------------------------------------------------- bad input


def run_cli(*args: str, event_log: Path) -> subprocess.CompletedProcess[str]:
    """The real ``kiproxy`` command, with Spark's event log on: a started Spark application
    leaves a file in ``event_log``."""
    event_log.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "kiproxy", *args, "--no-progress", "--master", "local[1]",
         "--spark-conf", "spark.eventLog.enabled=true",
         "--spark-conf", f"spark.eventLog.dir={event_log.as_uri()}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=runtime_env(PYTHONPATH=str(ROOT)))


@pytest.fixture(scope="module")
def scram_only_gateway(broker: EmbeddedBroker) -> Iterator[SaslGateway]:
    gw = SaslGateway(broker.bootstrap, USERS, mechanisms=("SCRAM-SHA-256",)).start()
    yield gw
    gw.stop()


@pytest.mark.parametrize(("case", "message"), [
    ("wrong password", r"SASL: authentication as 'alice' with SCRAM-SHA-256 failed at broker "
                       r"\S+: Authentication failed during authentication due to invalid "
                       r"credentials with SASL mechanism SCRAM-SHA-256; check sasl\.username"),
    ("mechanism not enabled", r"SASL: broker \S+ does not enable mechanism PLAIN \(it enables: "
                              r"SCRAM-SHA-256\); set sasl\.mechanism to one of them"),
    ("untrusted certificate", r"TLS: the certificate of broker \S+ is not trusted "
                              r"\(.*\); set ssl\.truststore\.location"),
    ("plaintext to a TLS port", r"broker \S+ (answered with TLS: the port speaks TLS|closed the "
                                r"connection without answering; if the port speaks TLS), set "
                                r"security\.protocol=SSL"),
    ("TLS to a plaintext port", r"TLS: broker \S+ does not speak TLS on this port.*set "
                                r"security\.protocol=PLAINTEXT"),
    ("no client certificate", r"(TLS: broker \S+ requires a client certificate|broker \S+ "
                              r"closed the connection after the TLS handshake without "
                              r"answering: it may require a client certificate \(set "
                              r"ssl\.keystore\.location)"),
])
def test_bad_input_fails_on_the_driver_before_any_spark_job(
        case: str, message: str, pki: Pki, broker: EmbeddedBroker, gateway: SaslGateway,
        scram_only_gateway: SaslGateway, tls_proxy: ProxyProcess, mtls_proxy: ProxyProcess,
        small_topic: tuple[str, Truth], tmp_path: Path) -> None:
    tls = {"security_protocol": "SSL", "ssl_ca_location": str(pki.ca)}
    bootstrap, props = {
        "wrong password": (gateway.address, {
            "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_username": "alice", "sasl_password": USERS["bob"]}),
        "mechanism not enabled": (scram_only_gateway.address, {
            "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
            "sasl_username": "alice", "sasl_password": PASSWORD}),
        "untrusted certificate": (tls_proxy.bootstrap, {**tls,
                                                        "ssl_ca_location": str(pki.other_ca)}),
        "plaintext to a TLS port": (tls_proxy.bootstrap, {"security_protocol": "PLAINTEXT"}),
        "TLS to a plaintext port": (broker.bootstrap, tls),
        "no client certificate": (mtls_proxy.bootstrap, tls),
    }[case]
    config = write_config(tmp_path / "client.properties", **props)
    events = tmp_path / "events"
    done = run_cli("replay", "--bootstrap", bootstrap, "--topic", small_topic[0],
                   "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                   "--command-config", str(config), "--report", str(tmp_path / "report"),
                   event_log=events)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("kiproxy replay: cannot read metadata from --bootstrap "), line
    import re

    assert re.search(message, line), line
    assert USERS["bob"] not in line and PASSWORD not in line
    assert list(events.iterdir()) == []  # no Spark application was started
    assert not (tmp_path / "report").exists()


# ---------------------------------------------------------------------------- Spark cluster


@dataclass
class SparkCluster:
    """A Spark standalone master and one worker on loopback."""

    url: str
    ui: str
    home: Path

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=10) as response:
            state: dict[str, Any] = json.load(response)
        return state


def _stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a process started in its own session and everything it started (executors)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    import pyspark

    home = tmp_path_factory.mktemp("spark-cluster")
    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    port, ui, worker_ui = free_port(), free_port(), free_port()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": "256m",
           "SPARK_LOG_DIR": str(home), "SPARK_WORKER_DIR": str(home / "work"),
           # The executors' Python imports kiproxy from here; the plugin is not on it.
           "PYTHONPATH": str(ROOT), "PYSPARK_PYTHON": sys.executable}
    started = []
    try:
        for name, cmd in (
            ("master", [spark_class, "org.apache.spark.deploy.master.Master", "--host",
                        "127.0.0.1", "--port", str(port), "--webui-port", str(ui)]),
            ("worker", [spark_class, "org.apache.spark.deploy.worker.Worker", "--host",
                        "127.0.0.1", "--cores", "1", "--memory", "1g", "--webui-port",
                        str(worker_ui), "--work-dir", str(home / "work"),
                        f"spark://127.0.0.1:{port}"]),
        ):
            with open(home / f"{name}.log", "w") as log:
                started.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True))
            if name == "master":
                wait_for_port("127.0.0.1", port, 90)
                wait_for_port("127.0.0.1", ui, 90)
        cluster = SparkCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui}", home)
        deadline = time.monotonic() + 90
        while True:
            try:
                if cluster.state().get("aliveworkers", 0) >= 1:
                    break
            except (OSError, ValueError):  # the web UI is still starting: refused, or an
                pass                            # empty or partial page while Jetty comes up
            assert time.monotonic() < deadline, (home / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        yield cluster
    finally:
        for proc in reversed(started):
            _stop_group(proc)
        for proc in started:  # nothing of the cluster is left running
            with pytest.raises(ProcessLookupError):
                os.killpg(proc.pid, 0)


CLUSTER_PLUGIN = '''
"""Exists only in the plugins dir given to the driver: executors load it from the archive."""
from kiproxy.interceptors import ProduceRequestInterceptor, RejectBatch


class RejectBad(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        bad = [(i, "value starts with bad") for i, r in enumerate(batch.records)
               if r.value is not None and r.value.startswith(b"bad")]
        if bad:
            raise RejectBatch(f"bad records in {batch.topic}", error="POLICY_VIOLATION",
                              record_errors=bad)
        return batch.with_records(
            r.with_value(r.value.upper()) if r.value is not None
            and r.value.startswith(b"lower:") else r for r in batch.records)
'''


def cluster_replay(cluster: SparkCluster, bootstrap: str, config: Path, topic: str,
                   plugins: Path, module: str, report: Path, events: Path,
                   *extra: str) -> subprocess.CompletedProcess[str]:
    """``kiproxy replay --master spark://...`` as its own driver process."""
    events.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "kiproxy", "replay", "--bootstrap", bootstrap, "--topic", topic,
         "--command-config", str(config), "--interceptor", f"{module}:RejectBad",
         "--plugins-dir", str(plugins), "--report", str(report), "--no-progress",
         "--master", cluster.url,
         "--spark-conf", "spark.driver.host=127.0.0.1",
         "--spark-conf", "spark.driver.bindAddress=127.0.0.1",
         "--spark-conf", "spark.driver.memory=512m",
         "--spark-conf", "spark.executor.memory=512m",
         "--spark-conf", "spark.cores.max=1",
         "--spark-conf", f"spark.pyspark.python={sys.executable}",
         "--spark-conf", "spark.eventLog.enabled=true",
         "--spark-conf", f"spark.eventLog.dir={events.as_uri()}",
         "--spark-conf", "spark.eventLog.compress=false",  # plain JSON, so a grep means it
         *extra],
        capture_output=True, text=True, timeout=280, cwd=cluster.home,
        env=runtime_env(SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(ROOT),
                        PYSPARK_PYTHON=sys.executable))


@pytest.fixture(scope="module")
def cluster_plugins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    plugins = tmp_path_factory.mktemp("driver-only-plugins")
    module = f"cluster_rules_{uuid.uuid4().hex[:8]}"
    (plugins / f"{module}.py").write_text(CLUSTER_PLUGIN)
    return plugins, module


def sasl_ssl_config(path: Path, pki: Pki) -> Path:
    return write_config(path, security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
                        sasl_username="alice", sasl_password=PASSWORD,
                        ssl_truststore_location=str(pki.ca), ssl_truststore_type="PEM",
                        ssl_keystore_location=str(pki.client_pem_keystore),
                        ssl_keystore_type="PEM")


def test_cluster_replay_of_a_driver_only_plugin_over_100k_records_leaks_no_secret(
        pki: Pki, sasl_ssl_proxy: ProxyProcess, broker: EmbeddedBroker,
        spark_cluster: SparkCluster, cluster_plugins: tuple[Path, str],
        tmp_path: Path) -> None:
    """SASL_SSL with mTLS, executors in their own processes: exact counts; and neither the
    report, the Spark event log, the driver's output nor the cluster's logs hold the password
    or the client key."""
    topic = create_topic(broker.bootstrap, 4)
    produce_values(broker.bootstrap, topic, 4, 25_000)
    truth = truth_of(broker.bootstrap, topic, 4)
    assert truth.records == 100_000 and truth.rejected_batches > 0
    config = sasl_ssl_config(tmp_path / "client.properties", pki)
    plugins, module = cluster_plugins
    apps_before = len(spark_cluster.state()["completedapps"])
    report, events = tmp_path / "report", tmp_path / "events"
    done = cluster_replay(spark_cluster, sasl_ssl_proxy.bootstrap, config, topic, plugins,
                          module, report, events)
    assert done.returncode == 0, done.stderr[-5000:]
    summary = assert_replay(report, truth)
    assert summary["spark_master"] == spark_cluster.url and summary["reader"] == "fetch"
    assert summary["security"] == "SASL_SSL, client certificate, SCRAM-SHA-256 as alice"
    assert {p: v["records"] for p, v in summary["topics"][topic]["partitions"].items()} == \
        {str(p): 25_000 for p in range(4)}
    assert len(spark_cluster.state()["completedapps"]) == apps_before + 1
    [event_log] = list(events.iterdir())  # one application (a directory with rolling files)
    log_text = b"".join(f.read_bytes() for f in sorted(event_log.rglob("*")) if f.is_file())
    assert b'"Event":"SparkListenerExecutorAdded"' in log_text  # a real executor process
    assert b'"Event":"SparkListenerTaskEnd"' in log_text
    assert b'"spark.cores.max":"1"' in log_text  # the settings Spark shows are in it, greppable

    key_line = pki.client_key.read_text().splitlines()[1].encode()
    secrets = [PASSWORD.encode(), key_line]
    searched = [f for f in [*report.rglob("*"), *events.rglob("*"),
                            *spark_cluster.home.rglob("*")] if f.is_file()]
    assert any(f.name == "stderr" for f in searched)  # the executors' own logs
    leaks = [(f, s) for f in searched for s in secrets if s in f.read_bytes()]
    assert leaks == []
    assert not [s for s in secrets if s in (done.stdout + done.stderr).encode()]


def test_cluster_backfill_writes_exactly_the_transformed_records(
        pki: Pki, sasl_ssl_proxy: ProxyProcess, broker: EmbeddedBroker,
        spark_cluster: SparkCluster, cluster_plugins: tuple[Path, str],
        tmp_path: Path) -> None:
    topic = create_topic(broker.bootstrap, 3)
    produce_values(broker.bootstrap, topic, 3, 3_000)
    truth = truth_of(broker.bootstrap, topic, 3)
    config = sasl_ssl_config(tmp_path / "client.properties", pki)
    plugins, module = cluster_plugins
    out = f"{topic}-backfill"
    done = cluster_replay(spark_cluster, sasl_ssl_proxy.bootstrap, config, topic, plugins,
                          module, tmp_path / "report", tmp_path / "events",
                          "--output-topic", out)
    assert done.returncode == 0, done.stderr[-5000:]
    summary = assert_replay(tmp_path / "report", truth)
    assert truth.written is not None and summary["written_records"] == len(truth.written)
    assert read_back(out, broker, len(truth.written), 3) == \
        sorted(truth.written, key=lambda r: (r[0], r[3], r[2] or b""))
