"""``kiproxy dev --broker kafka``: the dev mode with Apache Kafka instead of Tansu.

It prints the same bootstrap line, serves clients through the proxy, and ends
every JVM it started, whether it stops on Ctrl-C or fails. Bad input is one line.
The bad-input tests need no Kafka jars (they stop before any JVM starts).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, consume
from support.apache_kafka import kafka_home_or_skip
from support.dev_mode import DevMode, popen_dev, running_dev

from kiproxy_dev.tansu import free_port

pytestmark = pytest.mark.timeout(180)


def _jvms_of(workdir: str) -> list[psutil.Process]:
    """Running processes whose command line names the cluster's data folder."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(workdir in arg for arg in p.info["cmdline"] or []):
                found.append(p)
    return found


def _workdir(lines: list[str]) -> str:
    for line in lines:
        match = re.search(r"data in (\S+?)\)", line)
        if match:
            return match.group(1)
    raise AssertionError("no 'data in' line:\n" + "\n".join(lines))


def test_dev_with_apache_kafka_serves_transforms_and_stops_every_jvm_on_ctrl_c() -> None:
    home = kafka_home_or_skip()
    listen, direct = free_port(), free_port()
    with running_dev("--broker", "kafka", "--kafka-home", str(home), "--listen",
                     f"127.0.0.1:{listen}", "--broker-port", str(direct),
                     "--interceptor", "uppercase") as dev:
        dev.wait_bootstrap(150)
        assert [ln for ln in dev.lines if "bootstrap address" in ln] == [
            f"kiproxy: bootstrap address 127.0.0.1:{listen}"]
        workdir = _workdir(dev.lines)
        jvms = _jvms_of(workdir)
        assert len(jvms) == 2, "expected one broker and one controller"

        from confluent_kafka import Producer

        topic = f"dev-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": f"127.0.0.1:{listen}"})
        producer.produce(topic, key=b"k", value=b"through kafka", partition=0)
        assert producer.flush(30) == 0
        got = consume(f"127.0.0.1:{listen}", topic, 1)
        assert [(m.key(), m.value()) for m in got] == [(b"k", b"THROUGH KAFKA")]
        # --broker-port pins the broker's own port: read there, past the proxy.
        got = consume(f"127.0.0.1:{direct}", topic, 1)
        assert [m.value() for m in got] == [b"THROUGH KAFKA"]

        dev.interrupt()  # Ctrl-C in a terminal
        assert dev.process.wait(60) == 0, dev.output
        _gone, alive = psutil.wait_procs(jvms, timeout=20)
        assert not alive, f"JVMs still running: {alive}"
        assert not Path(workdir).exists()
        assert "Traceback" not in dev.output


def test_make_run_broker_kafka_serves_the_example_plugin() -> None:
    """docs/apache-kafka.md's ``make run BROKER=kafka`` as written: the checkout's .venv,
    the example plugin, the default address 127.0.0.1:9192."""
    kafka_home_or_skip()
    if not (ROOT / ".venv" / "bin" / "kiproxy").exists():
        pytest.skip("make run uses the checkout's .venv, which `make install` creates")
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 9192)) == 0:
            pytest.fail("127.0.0.1:9192 is taken: `make run` listens there; stop what holds it")
    dev = DevMode(subprocess.Popen(
        ["make", "run", "BROKER=kafka"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    try:
        assert dev.wait_bootstrap(150) == "127.0.0.1:9192"
        jvms = _jvms_of(_workdir(dev.lines))
        assert len(jvms) == 2, "expected one broker and one controller"
        from confluent_kafka import Producer

        topic = f"make-run-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": "127.0.0.1:9192"})
        producer.produce(topic, value=b"card 4111 1111 1111 1111 paid", partition=0)
        assert producer.flush(30) == 0
        got = consume("127.0.0.1:9192", topic, 1)
        assert [m.value() for m in got] == [b"card ****-****-****-1111 paid"]

        dev.interrupt()  # Ctrl-C in a terminal: make and kiproxy get it
        dev.process.wait(60)
        _gone, alive = psutil.wait_procs(jvms, timeout=20)
        assert not alive, f"JVMs still running: {alive}"
        assert "Traceback" not in dev.output
    finally:
        dev.kill()


def test_a_taken_listen_port_is_one_line_before_any_jvm_starts() -> None:
    home = kafka_home_or_skip()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = popen_dev("--broker", "kafka", "--kafka-nodes", "3", "--kafka-home", str(home),
                         "--listen", f"127.0.0.1:{port}")
        out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 1, out
    # Said at once: no broker, registry or KMS was started only to be stopped again.
    assert out.splitlines() == [
        f"kiproxy: cannot listen on 127.0.0.1:{port} (--listen): Address already in use; "
        "nothing was started"], out


def _one_error_line(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = popen_dev(*args, env=env)
    out, _ = proc.communicate(timeout=60)
    assert len(out.splitlines()) == 1, out
    return proc.returncode, out.strip()


def test_a_folder_without_kafka_jars_is_one_line(tmp_path: Path) -> None:
    code, line = _one_error_line("--broker", "kafka", "--kafka-home", str(tmp_path))
    assert code == 1
    assert line == (f"kiproxy: {tmp_path} is not an Apache Kafka distribution: there is no "
                    "libs/kafka_2.13-*.jar; run `make kafka` and pass the folder it prints "
                    "(or set KIPROXY_KAFKA_HOME)")


def test_a_java_too_old_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "kafka_2.13-4.4.0.jar").write_bytes(b"")
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\necho 'openjdk version \"11.0.22\" 2024-01-16' >&2\n")
    java.chmod(0o755)
    code, line = _one_error_line("--broker", "kafka", "--kafka-home", str(tmp_path),
                                 env={"JAVA_HOME": str(tmp_path / "jdk")})
    assert code == 1
    assert line == (f"kiproxy: {java} is Java 11, too old: Apache Kafka 4 brokers need Java 17 "
                    "or newer; set JAVA_HOME to a newer one")


def test_kafka_flags_without_broker_kafka_are_refused(tmp_path: Path) -> None:
    code, line = _one_error_line("--kafka-home", str(tmp_path))
    assert code == 2
    assert line == "kiproxy: config error: --kafka-home and --kafka-nodes need --broker kafka"
