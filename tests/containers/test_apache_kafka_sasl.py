"""SASL through kiproxy against Apache Kafka itself: SCRAM-SHA-512 and PLAIN, end to end.

tests/integration/test_sasl.py runs these scenarios against Tansu behind a
stand-in for a Kafka broker's authentication layer (Tansu cannot hold SCRAM
users or offer PLAIN). Here the broker is the real thing: the official
``apache/kafka`` image in KRaft mode, with a ``SASL_PLAINTEXT`` listener that
enables PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512, started by testcontainers the
way tests/containers/test_apache_kafka.py starts it. The checks:

* with the right password, records produced through the proxy are stored by
  Kafka and read back through the proxy, and the proxy logs the principal;
* with a wrong password, the client fails through the proxy with the same
  librdkafka error as against Kafka directly, and nothing is stored;
* a client without SASL gets no metadata through the proxy.

Broker set-up (one combined broker and controller, node id 1):

* listeners ``SASL_PLAINTEXT`` (published; what the proxy and the tests use),
  ``BROKER`` (PLAINTEXT, inter-broker, inside the container only) and
  ``CONTROLLER``; ``sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512``.
* JAAS: ``KAFKA_OPTS=-Djava.security.auth.login.config=...`` pointing at a
  ``KafkaServer`` section with PlainLoginModule (its ``user_<name>`` entries are
  the PLAIN users) and ScramLoginModule.
* SCRAM users are written into the metadata log when the storage is formatted
  (``kafka-storage format --add-scram``, KIP-900): the start script formats the
  log directory itself, with a properties file made from the same ``KAFKA_*``
  variables, before the image's own start-up, which then finds it "already
  formatted" and carries on. Should that not have happened (a changed image),
  the users are added through ``kafka-configs --alter`` on the inside listener.

Every test runs on two brokers (the ``kafka`` fixture's ids): ``jvm``, the
session's 1-node Apache Kafka cluster of JVMs on loopback, whose SASL_PLAINTEXT
listener is set up the same way (tests/support/apache_kafka.py: SCRAM users from
``kafka-storage format --add-scram``, PLAIN users in the listener's JAAS
setting); and ``docker``, the container above, which needs a Docker engine
(where none answers, skipped with the reason "no Docker engine: ...").
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import ProxyProcess, high_watermark, launch_proxy
from hardening.sasl_gateway import kafka_failure_message
from integration.test_sasl import (
    USERS,
    _consume,
    _expected,
    _failed_attempts,
    _produce,
    _records,
    _sasl,
)
from support.apache_kafka import SASL_LISTENER, SASL_USERS

from containers.test_apache_kafka import KAFKA_IMAGE, ApacheKafkaContainer, docker_engine
from kiproxy_dev.tansu import free_port

try:
    from testcontainers.community.kafka import KafkaContainer
except ImportError:  # testcontainers before its "community" package layout
    from testcontainers.kafka import KafkaContainer

__all__ = ["docker_engine"]  # the fixture, imported so that this module can use it

pytestmark = [
    pytest.mark.timeout(600),  # the first test also pulls and starts the image
    pytest.mark.filterwarnings("ignore:(read|open)_text is deprecated:DeprecationWarning"),
]

LISTENER = "SASL_PLAINTEXT"
MECHANISMS = "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"
JAAS_PATH = "/tmp/kiproxy_kafka_server_jaas.conf"
FORMAT_TEMPLATE = "/tmp/kiproxy-format.properties"
RECORDS = 100
_AUTHENTICATION = -169
_MSG_TIMED_OUT = -192

# Environment variables the image does not turn into server properties
# (KafkaDockerWrapper's ExcludeServerPropsEnv).
_NOT_PROPERTIES = {
    "KAFKA_VERSION", "KAFKA_HEAP_OPT", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
    "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL",
    "KAFKA_LOG4J_LOGGERS", "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME",
    "KAFKA_ADVERTISED_LISTENERS",  # known only in the start script
}


def server_property(env_name: str) -> str:
    """The server property the image makes of a ``KAFKA_*`` variable (``_`` -> ``.``,
    ``__`` -> ``_``, ``___`` -> ``-``), as KafkaDockerWrapper does."""
    return (env_name.removeprefix("KAFKA_").lower().replace("_", ".")
            .replace("...", "-").replace("..", "_"))


def jaas_config(users: dict[str, str]) -> str:
    """The broker's JAAS file: PLAIN users inline, SCRAM users from the metadata log."""
    plain_users = "\n".join(f'    user_{name}="{password}"' for name, password in users.items())
    return ("KafkaServer {\n"
            "    org.apache.kafka.common.security.plain.PlainLoginModule required\n"
            f"{plain_users};\n"
            "    org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
            "};\n")


def add_scram_arguments(users: dict[str, str]) -> list[str]:
    """``kafka-storage format`` arguments that create every user for both SCRAM hashes."""
    out = []
    for name, password in users.items():
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            out += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
    return out


class SaslKafkaContainer(ApacheKafkaContainer):
    """``apache/kafka`` (KRaft) whose published listener requires SASL (see module doc)."""

    def __init__(self, users: dict[str, str], image: str = KAFKA_IMAGE) -> None:
        # The published listener is named for its protocol; BROKER stays PLAINTEXT.
        KafkaContainer.__init__(self, image, listener_name=LISTENER,
                                security_protocol="SASL_PLAINTEXT")
        self.users = dict(users)

    def configure(self) -> None:
        super().configure()
        self.with_env("KAFKA_SASL_ENABLED_MECHANISMS", MECHANISMS)
        self.with_env("KAFKA_OPTS", f"-Djava.security.auth.login.config={JAAS_PATH}")
        self.with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "true")

    def format_properties(self) -> str:
        """The server properties of the ``KAFKA_*`` environment, for formatting the storage."""
        lines = [f"{server_property(name)}={value}" for name, value in sorted(self.env.items())
                 if name.startswith("KAFKA_") and name not in _NOT_PROPERTIES]
        return "\n".join(lines) + "\n"

    def tc_start(self) -> None:
        """Write the JAAS file and a start script that formats with the SCRAM users first."""
        host = self.get_container_host_ip()
        port = self.get_exposed_port(self.port)
        self.create_file(jaas_config(self.users).encode(), JAAS_PATH)
        self.create_file(self.format_properties().encode(), FORMAT_TEMPLATE)
        scram = " ".join(f"'{arg}'" for arg in add_scram_arguments(self.users))
        script = (
            "#!/bin/sh\n"
            f"export KAFKA_ADVERTISED_LISTENERS={LISTENER}://{host}:{port},"
            "BROKER://$(hostname):9092\n"
            f"cat {FORMAT_TEMPLATE} > /tmp/format.properties\n"
            'echo "advertised.listeners=$KAFKA_ADVERTISED_LISTENERS" >> /tmp/format.properties\n'
            f"/opt/kafka/bin/kafka-storage.sh format --cluster-id={self.cluster_id} "
            f"-c /tmp/format.properties {scram} "
            "|| echo 'kiproxy: formatting with SCRAM users failed; adding them after start'\n"
            "exec /etc/kafka/docker/run\n"
        )
        self.create_file(script.encode(), self.TC_START_SCRIPT)

    def ensure_scram_users(self, timeout: float = 60) -> None:
        """Make sure every user has SCRAM credentials (added over the inside listener
        if formatting did not add them)."""
        tool = "/opt/kafka/bin/kafka-configs.sh"
        for name, password in self.users.items():
            described = self.exec([tool, "--bootstrap-server", "localhost:9092", "--describe",
                                   "--entity-type", "users", "--entity-name", name])
            text = described.output.decode(errors="replace")
            if "SCRAM-SHA-512" in text and "SCRAM-SHA-256" in text:
                continue
            altered = self.exec([tool, "--bootstrap-server", "localhost:9092", "--alter",
                                 "--add-config",
                                 f"SCRAM-SHA-256=[password={password}],"
                                 f"SCRAM-SHA-512=[password={password}]",
                                 "--entity-type", "users", "--entity-name", name])
            assert altered.exit_code == 0, altered.output.decode(errors="replace")


@dataclass(frozen=True)
class KafkaCluster:
    """The SASL listener as seen from this machine, and the broker's node ids."""

    bootstrap: str
    node_ids: tuple[int, ...]


def _wait_authenticated(bootstrap: str, timeout: float = 60) -> None:
    """Until a SCRAM-SHA-512 client can read metadata (users reach the broker)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout
    while True:
        try:
            AdminClient({"bootstrap.servers": bootstrap, **_sasl("SCRAM-SHA-512")}) \
                .list_topics(timeout=5)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.fixture(scope="module", params=["jvm", "docker"])
def kafka(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    """Apache Kafka (KRaft) that requires SASL on the listener the proxy uses."""
    if request.param == "jvm":
        assert SASL_USERS == USERS, "the shared cluster's SASL users differ from test_sasl's"
        jvm = request.getfixturevalue("apache_kafka")
        cluster = KafkaCluster(jvm.listener_bootstrap(SASL_LISTENER), tuple(jvm.broker_ids))
        _wait_authenticated(cluster.bootstrap)
        yield cluster
        return
    container = SaslKafkaContainer(USERS, request.getfixturevalue("docker_engine"))
    container.start(timeout=180)
    try:
        container.ensure_scram_users()
        cluster = KafkaCluster(container.get_bootstrap_server(), (1,))
        _wait_authenticated(cluster.bootstrap)
        yield cluster
    finally:
        container.stop()


@pytest.fixture(scope="module")
def proxy(kafka: KafkaCluster) -> Iterator[ProxyProcess]:
    """kiproxy in front of the SASL listener (no interceptor: SASL is what is tested)."""
    pins = [arg for node in kafka.node_ids for arg in ("--node-port", f"{node}={free_port()}")]
    p = launch_proxy(kafka.bootstrap, *pins)
    yield p
    assert p.alive(), f"proxy died during the module:\n{p.log}"
    p.stop()


def _create_topic(bootstrap: str, conf: dict[str, Any]) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"sasl-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, **conf})
    futures = admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)],
                                  operation_timeout=20)
    futures[name].result(timeout=30)
    return name


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_records_pass_through_to_apache_kafka(proxy: ProxyProcess, kafka: KafkaCluster,
                                              mechanism: str) -> None:
    client_id = f"sasl-{mechanism}-{uuid.uuid4().hex[:6]}"
    conf = {**_sasl(mechanism), "client.id": client_id}
    topic = _create_topic(proxy.bootstrap, conf)
    assert _produce(proxy.bootstrap, topic, RECORDS, **conf) == [None] * RECORDS
    # Read back through the proxy, and from Kafka directly.
    for bootstrap in (proxy.bootstrap, kafka.bootstrap):
        got = _consume(bootstrap, topic, RECORDS, timeout=60, **conf)
        assert _records(got) == _expected(RECORDS)
    lines = [line for line in proxy.lines if f"(client_id '{client_id}')" in line]
    assert any(f"authenticated as 'alice' (SASL {mechanism})" in line for line in lines), \
        proxy.log
    assert not any("failed" in line for line in lines), proxy.log


@pytest.mark.parametrize(("mechanism", "message"), [
    ("SCRAM-SHA-512", kafka_failure_message("SCRAM-SHA-512")),
    ("PLAIN", "Authentication failed: Invalid username or password"),
])
def test_wrong_password_fails_as_it_does_without_the_proxy(
        proxy: ProxyProcess, kafka: KafkaCluster, mechanism: str, message: str) -> None:
    topic = _create_topic(kafka.bootstrap, _sasl("SCRAM-SHA-512"))
    client_id = f"wrong-{mechanism}-{uuid.uuid4().hex[:6]}"
    conf = {**_sasl(mechanism, password="not-the-password"), "client.id": client_id}
    direct, through = _failed_attempts(kafka.bootstrap, proxy.bootstrap, topic, conf)
    expected = (_AUTHENTICATION, f"SASL authentication error: {message}")
    assert direct["first"] == expected, direct
    assert through["first"] == direct["first"], (through, direct)
    assert direct["deliveries"] == through["deliveries"] == [_MSG_TIMED_OUT] * 3
    assert high_watermark(kafka.bootstrap, topic, **_sasl("SCRAM-SHA-512")) == 0, (
        "a record reached the topic")
    lines = [line for line in proxy.lines if f"(client_id '{client_id}')" in line]
    assert any(f"as 'alice' failed: error_code 58 (SASL_AUTHENTICATION_FAILED): {message}"
               in line for line in lines), proxy.log
    assert not any("authenticated as" in line for line in lines), proxy.log


def test_a_client_without_sasl_gets_no_metadata(proxy: ProxyProcess) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": proxy.bootstrap}).list_topics(timeout=5)
