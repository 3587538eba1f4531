"""Hot reload with a real broker and real clients: nothing lost, no connection dropped.

A steady idempotent stream goes through the proxy while its plugin file is
rewritten and reloaded, alternating two behaviours, by each trigger (SIGHUP,
``POST /reload`` and the file watch). Every record must be stored exactly once,
in order per partition, with one of the two suffixes, and the proxy's own
counters must show that no client connection was opened or closed meanwhile.
Bad reloads must leave the running behaviour in force and say why.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, launch_proxy
from prometheus_client.parser import text_string_to_metric_families

from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import EmbeddedBroker, free_port

PLUGIN = '''
from kiproxy.interceptors import ProduceRequestInterceptor

SUFFIX = {suffix!r}


class Suffix(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(r.with_value(r.value + SUFFIX) for r in batch.records)
'''


def _write_plugin(plugins: Path, suffix: bytes, body: str | None = None) -> None:
    target = plugins / "suffix.py"
    tmp = plugins / ".suffix.py.tmp"
    tmp.write_text(body if body is not None else PLUGIN.format(suffix=suffix))
    tmp.replace(target)  # atomic, as an editor or a ConfigMap update does it


def _config(path: Path, bootstrap: str, plugins: Path, metrics: str,
            **extra: Any) -> Path:
    lines = [f"upstream: [{bootstrap}]", f"plugins_dir: {plugins}",
             f"metrics_listen: {metrics}", "interceptor:", "  class: suffix:Suffix"]
    for key, value in extra.items():
        lines.append(f"{key}: {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _http(method: str, url: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            body = answer.read()
            status = answer.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    ctype_json = body.strip().startswith((b"{", b"["))
    return status, json.loads(body) if ctype_json else body.decode()


def _metric(metrics: str, name: str, **labels: str) -> float:
    _, text = _http("GET", f"http://{metrics}/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _generation(metrics: str) -> int:
    _, view = _http("GET", f"http://{metrics}/config")
    return int(view["generation"])


def _wait_generation(metrics: str, at_least: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = _generation(metrics)
        if current >= at_least:
            return current
        time.sleep(0.05)
    raise AssertionError(f"configuration generation never reached {at_least}")


def _free_pair() -> int:
    """A port P below the ephemeral range with P and P + 1 free (one per worker)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20_000, 30_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free ports in a row")


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(30)


def _start(tmp_path: Path, broker: EmbeddedBroker | KafkaCluster, *extra: str,
           **settings: Any) -> tuple[ProxyProcess, Path, Path, str]:
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    _write_plugin(plugins, b"-A")
    metrics = f"127.0.0.1:{free_port()}"
    config = _config(tmp_path / "proxy.yaml", broker.bootstrap, plugins, metrics, **settings)
    node_ids = tuple(broker.broker_ids) if isinstance(broker, KafkaCluster) else (111,)
    proxy = launch_proxy(broker.bootstrap, *extra, config_file=config, node_ids=node_ids)
    return proxy, plugins, config, metrics


def _produce_one(bootstrap: str, topic: str, value: bytes) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, value=value, partition=0)
    assert producer.flush(30) == 0


def _last_value(bootstrap: str, topic: str, count: int) -> bytes:
    records = consume(bootstrap, topic, count)
    assert len(records) == count
    return bytes(records[-1].value())


def test_a_stream_survives_twenty_reloads_by_every_trigger(tmp_path: Path,
                                                           broker: EmbeddedBroker) -> None:
    _stream_through_reloads(tmp_path, broker, total=50_000, min_reloads=21)


def test_the_same_in_front_of_apache_kafka(tmp_path: Path, apache_kafka: KafkaCluster) -> None:
    # Smaller than on Tansu: Apache Kafka's own sequence checks judge exactness here.
    _stream_through_reloads(tmp_path, apache_kafka, total=20_000, min_reloads=9)


def _stream_through_reloads(tmp_path: Path, broker: EmbeddedBroker | KafkaCluster, *,
                            total: int, min_reloads: int) -> None:
    from confluent_kafka import Producer

    proxy, plugins, _, metrics = _start(
        tmp_path, broker, reload={"watch": True, "watch_interval_ms": 100, "debounce_ms": 200})
    topic = f"reload-{uuid.uuid4().hex[:8]}"
    partitions = 4
    try:
        _create_topic(proxy.bootstrap, topic, partitions)
        producer = Producer({"bootstrap.servers": proxy.bootstrap, "enable.idempotence": True,
                             "acks": "all", "linger.ms": 5, "client.id": "steady"})
        errors: list[Any] = []
        delivered = [0]

        def report(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)
            else:
                delivered[0] += 1

        warm = 500
        for i in range(warm):
            producer.produce(topic, key=b"%d" % (i % 64), value=b"%07d" % i, on_delivery=report)
        assert producer.flush(60) == 0
        opened_before = _metric(metrics, "kiproxy_connections_total")
        active_before = _metric(metrics, "kiproxy_active_connections")

        done = threading.Event()

        def stream() -> None:
            for i in range(warm, total):
                while True:
                    try:
                        producer.produce(topic, key=b"%d" % (i % 64), value=b"%07d" % i,
                                         on_delivery=report)
                        break
                    except BufferError:
                        producer.poll(0.05)
                producer.poll(0)
                if i % 2000 == 0:
                    time.sleep(0.02)  # spread the stream over the reloads
            done.set()

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        generation = _generation(metrics)
        triggers = ["signal", "http", "watch"]
        reloads = 0
        while reloads < min_reloads or not done.is_set():
            if reloads >= 60:
                break
            suffix = b"-B" if reloads % 2 == 0 else b"-A"
            _write_plugin(plugins, suffix)
            trigger = triggers[reloads % 3]
            if trigger == "signal":
                proxy.process.send_signal(signal.SIGHUP)
            elif trigger == "http":
                status, answer = _http("POST", f"http://{metrics}/reload")
                assert status == 200 and answer["ok"] is True, answer
            generation = _wait_generation(metrics, generation + 1)
            reloads += 1
            time.sleep(0.1)
        streamer.join(120)
        assert producer.flush(120) == 0
        assert errors == [] and delivered[0] == total

        assert _metric(metrics, "kiproxy_connections_total") == opened_before
        assert _metric(metrics, "kiproxy_active_connections") == active_before
        assert _metric(metrics, "kiproxy_config_reloads_total", result="ok") >= min_reloads
        assert _metric(metrics, "kiproxy_config_reloads_total", result="failed") == 0

        records = consume(proxy.bootstrap, topic, total, partitions=partitions, timeout=120)
        assert len(records) == total
        seen: dict[int, list[int]] = defaultdict(list)
        suffixes = set()
        for record in records:
            value = bytes(record.value())
            number, suffix = value[:-2], value[-2:]
            assert suffix in (b"-A", b"-B"), value
            suffixes.add(suffix)
            seen[record.partition()].append(int(number))
        assert suffixes == {b"-A", b"-B"}
        everything = sorted(n for numbers in seen.values() for n in numbers)
        assert everything == list(range(total))  # each once
        by_key: dict[int, list[int]] = defaultdict(list)
        for numbers in seen.values():
            for n in numbers:
                by_key[n % 64].append(n)
        assert all(v == sorted(v) for v in by_key.values())  # order per key, so per partition
        assert proxy.alive()
    finally:
        assert proxy.stop() == 0
    assert "Traceback" not in proxy.log


def test_the_watch_reloads_a_file_put_back_after_a_reload_by_signal(
        tmp_path: Path, broker: EmbeddedBroker) -> None:
    # The watch waits 3 s for files to settle; -B is reloaded by SIGHUP well before
    # that, and the file put back to the -A the proxy started with. The proxy runs
    # -B, the file says -A: the watch must reload it, and must not reload -B again.
    proxy, plugins, _, metrics = _start(
        tmp_path, broker, reload={"watch": True, "watch_interval_ms": 100,
                                  "debounce_ms": 3000})
    topic = f"putback-{uuid.uuid4().hex[:8]}"
    try:
        _create_topic(proxy.bootstrap, topic, 1)
        start = _generation(metrics)
        _write_plugin(plugins, b"-B")
        proxy.process.send_signal(signal.SIGHUP)
        assert _wait_generation(metrics, start + 1) == start + 1
        _write_plugin(plugins, b"-A")
        assert _wait_generation(metrics, start + 2, timeout=20) == start + 2
        time.sleep(4)  # past another debounce: no reload of -B from the watch
        assert _generation(metrics) == start + 2
        _produce_one(proxy.bootstrap, topic, b"x")
        assert _last_value(proxy.bootstrap, topic, 1) == b"x-A"
    finally:
        assert proxy.stop() == 0
    assert "reload (signal) applied" in proxy.log and "reload (watch) applied" in proxy.log


BAD_PLUGINS = {
    "syntax error": ("class Suffix(:\n", "SyntaxError"),
    "missing class": ("X = 1\n", "has no class 'Suffix'"),
    "configure raises": (PLUGIN.format(suffix=b"-X") + '''
    def configure(self, config):
        raise ValueError("refusing this config")
''', "refusing this config"),
    "missing package": ("import no_such_package_kiproxy\n", "no_such_package_kiproxy"),
}


def test_a_failed_reload_keeps_the_running_behaviour_and_says_why(
        tmp_path: Path, broker: EmbeddedBroker) -> None:
    proxy, plugins, config, metrics = _start(tmp_path, broker)
    topic = f"badreload-{uuid.uuid4().hex[:8]}"
    good = config.read_text()
    produced = 0
    try:
        _produce_one(proxy.bootstrap, topic, b"v")
        produced += 1
        cases: list[tuple[str, str]] = []
        for name, (body, expected) in BAD_PLUGINS.items():
            _write_plugin(plugins, b"", body=body)
            cases.append((name, expected))
            status, answer = _http("POST", f"http://{metrics}/reload")
            assert status == 500 and answer["ok"] is False, (name, answer)
            assert expected in answer["message"], (name, answer)
            assert answer["generation"] == 1
            _produce_one(proxy.bootstrap, topic, b"v")
            produced += 1
            assert _last_value(proxy.bootstrap, topic, produced) == b"v-A", name
        _write_plugin(plugins, b"-A")
        for text, expected, status_expected in (
                (good + "interceptor_timeout: 5\n", "interceptor_timeout", 500),
                (good + "advertised_host: proxy.example.com\n",
                 "advertised_host changed: a restart is needed", 409),
                ("upstream: [unclosed\n", "not valid YAML", 500)):
            config.write_text(text)
            status, answer = _http("POST", f"http://{metrics}/reload")
            assert status == status_expected and expected in answer["message"], answer
            assert _generation(metrics) == 1
        config.write_text(good)
        _write_plugin(plugins, b"-B")
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 200 and answer == {**answer, "ok": True, "generation": 2}
        _produce_one(proxy.bootstrap, topic, b"v")
        produced += 1
        assert _last_value(proxy.bootstrap, topic, produced) == b"v-B"
        assert _metric(metrics, "kiproxy_config_reloads_total", result="failed") == 7
        proxy.wait_for_line("reload (http) failed, the running configuration is unchanged")
    finally:
        assert proxy.stop() == 0


def test_a_reload_storm_stays_correct(tmp_path: Path, broker: EmbeddedBroker) -> None:
    import psutil

    proxy, plugins, _, metrics = _start(tmp_path, broker)
    topic = f"storm-{uuid.uuid4().hex[:8]}"
    try:
        _produce_one(proxy.bootstrap, topic, b"v")
        process = psutil.Process(proxy.process.pid)
        threads_before = process.num_threads()
        results: list[tuple[int, Any]] = []
        workers = [threading.Thread(target=lambda: results.append(
            _http("POST", f"http://{metrics}/reload"))) for _ in range(100)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert len(results) == 100 and all(s == 200 for s, _ in results)
        # Coalesced: far fewer builds than triggers, and every answer names a generation.
        assert 2 <= _generation(metrics) <= 101
        _write_plugin(plugins, b"-B")
        status, _ = _http("POST", f"http://{metrics}/reload")
        assert status == 200
        _produce_one(proxy.bootstrap, topic, b"v")
        assert _last_value(proxy.bootstrap, topic, 2) == b"v-B"
        time.sleep(1)  # replaced generations close in the background
        assert process.num_threads() <= threads_before + 2
    finally:
        assert proxy.stop() == 0


def test_restart_only_keys_and_the_redacted_config_view(tmp_path: Path,
                                                        broker: EmbeddedBroker) -> None:
    proxy, _, config, metrics = _start(tmp_path, broker)
    try:
        config.write_text(config.read_text().replace(
            "  class: suffix:Suffix", "  class: suffix:Suffix\n  config: {password: hunter2}"))
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 200, answer
        status, view = _http("GET", f"http://{metrics}/config")
        assert status == 200 and view["generation"] == 2
        assert view["config"]["interceptor"]["config"] == {"password": "***"}
        assert "hunter2" not in json.dumps(view)
        config.write_text(config.read_text() + "workers: 2\n")
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 409 and answer["restart_required"] == ["workers"]
        assert answer["message"] == ("workers changed: a restart is needed to apply it; "
                                     "nothing was reloaded")
        assert _generation(metrics) == 2
    finally:
        assert proxy.stop() == 0


@pytest.mark.parametrize("count", [2])
def test_every_worker_reloads(tmp_path: Path, broker: EmbeddedBroker, count: int) -> None:
    base = _free_pair()
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _write_plugin(plugins, b"-A")
    config = _config(tmp_path / "proxy.yaml", broker.bootstrap, plugins, f"127.0.0.1:{base}",
                     workers=count)
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        for i in range(count):
            _wait_generation(f"127.0.0.1:{base + i}", 1)
        _write_plugin(plugins, b"-B")
        status, answer = _http("POST", f"http://127.0.0.1:{base}/reload")
        assert status == 200 and answer["ok"] is True
        assert len(answer["workers"]) == count
        assert all(w["ok"] and w["generation"] == 2 for w in answer["workers"])
        proxy.process.send_signal(signal.SIGHUP)
        for i in range(count):
            _wait_generation(f"127.0.0.1:{base + i}", 3)
    finally:
        assert proxy.stop() == 0, proxy.log


def _pki(d: Path) -> dict[str, Path]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def cert(cn: str, key: Any, ca: bool) -> x509.Certificate:
        return (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name("test CA"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))

    out = {"ca": d / "ca.pem"}
    out["ca"].write_bytes(cert("test CA", ca_key, True).public_bytes(serialization.Encoding.PEM))
    for label in ("a", "b"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[f"{label}.pem"] = d / f"{label}.pem"
        out[f"{label}.pem"].write_bytes(cert(f"server-{label}", key, False).public_bytes(
            serialization.Encoding.PEM))
        out[f"{label}.key"] = d / f"{label}.key"
        out[f"{label}.key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return out


def _api_versions(sock: Any, correlation_id: int) -> int:
    """Send ApiVersions v0 on ``sock``; the correlation id of the answer."""
    import struct

    body = struct.pack(">hhih", 18, 0, correlation_id, 4) + b"test"
    sock.sendall(struct.pack(">i", len(body)) + body)
    size = struct.unpack(">i", _read(sock, 4))[0]
    return int(struct.unpack(">i", _read(sock, size)[:4])[0])


def _read(sock: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def test_a_reloaded_min_version_holds_for_new_handshakes(tmp_path: Path,
                                                         broker: EmbeddedBroker) -> None:
    import shutil
    import socket
    import ssl

    pki = _pki(tmp_path)
    cert, key = tmp_path / "tls.pem", tmp_path / "tls.key"
    shutil.copy(pki["a.pem"], cert)
    shutil.copy(pki["a.key"], key)
    tls = {"cert": str(cert), "key": str(key)}
    proxy, plugins, config, metrics = _start(tmp_path, broker, tls=tls)
    host, port = proxy.bootstrap.rsplit(":", 1)
    tls12 = ssl.create_default_context(cafile=str(pki["ca"]))
    tls12.check_hostname = False
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    try:
        old = tls12.wrap_socket(socket.create_connection((host, int(port)), 10))
        assert old.version() == "TLSv1.2" and _api_versions(old, 1) == 1
        _config(config, broker.bootstrap, plugins, metrics,
                tls={**tls, "min_version": "TLSv1.3"})
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 200 and answer["ok"], answer
        with pytest.raises(ssl.SSLError):
            tls12.wrap_socket(socket.create_connection((host, int(port)), 10)).close()
        assert _api_versions(old, 2) == 2  # the open connection keeps its TLS 1.2
        old.close()
        _config(config, broker.bootstrap, plugins, metrics, tls=tls)
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 200 and answer["ok"], answer
        with tls12.wrap_socket(socket.create_connection((host, int(port)), 10)) as again:
            assert again.version() == "TLSv1.2"
    finally:
        assert proxy.stop() == 0


def test_a_certificate_rotates_by_reload_without_touching_open_connections(
        tmp_path: Path, broker: EmbeddedBroker) -> None:
    import shutil
    import socket
    import ssl

    pki = _pki(tmp_path)
    cert, key = tmp_path / "tls.pem", tmp_path / "tls.key"
    shutil.copy(pki["a.pem"], cert)
    shutil.copy(pki["a.key"], key)
    proxy, _, _, metrics = _start(tmp_path, broker, tls={"cert": str(cert), "key": str(key)})
    host, port = proxy.bootstrap.rsplit(":", 1)
    client = ssl.create_default_context(cafile=str(pki["ca"]))
    client.check_hostname = False

    def subject(sock: ssl.SSLSocket) -> str:
        peer = sock.getpeercert() or {}
        return dict(x[0] for x in peer.get("subject", ()))["commonName"]

    try:
        old = client.wrap_socket(socket.create_connection((host, int(port)), 10))
        assert subject(old) == "server-a" and _api_versions(old, 1) == 1
        shutil.copy(pki["b.pem"], cert)
        shutil.copy(pki["b.key"], key)
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 200 and answer["ok"], answer
        assert _api_versions(old, 2) == 2  # the open connection keeps working
        with client.wrap_socket(socket.create_connection((host, int(port)), 10)) as new:
            assert subject(new) == "server-b" and _api_versions(new, 3) == 3
        cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB")  # caught half-written
        status, answer = _http("POST", f"http://{metrics}/reload")
        assert status == 500 and "tls.cert/tls.key" in answer["message"], answer
        with client.wrap_socket(socket.create_connection((host, int(port)), 10)) as new:
            assert subject(new) == "server-b"
        assert _api_versions(old, 4) == 4
        old.close()
    finally:
        assert proxy.stop() == 0
