"""``kiproxy dev``: a local broker (Tansu, or Apache Kafka in KRaft mode) with the proxy
in front of it, with ``--registry`` a local Apicurio Registry beside them, and with
``--kms`` a local stand-in for AWS KMS (:mod:`kiproxy_dev.kms`).

``add_parsers`` adds the subcommand to the ``kiproxy`` parser (:mod:`kiproxy.cli`)
with the proxy's own flags (:func:`kiproxy.proxy.cli.add_flags`: the config model's,
without the upstream ones) and the broker's (the fields of :class:`DevSettings`,
declared once like the config model's); ``run`` starts the broker, serves the
proxy in front of it until SIGINT/SIGTERM, then stops the broker, and returns the
exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiproxy.interceptors.flags import Flag, FlagError, add_model_flags, model_from_flags
from kiproxy.proxy import cli as proxy_cli
from kiproxy.proxy.config.clients import parse_host_port
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.serve import serve_until_stopped
from kiproxy_dev.apicurio import ApicurioRegistry, RegistryLaunchError, find_registry_jar
from kiproxy_dev.kafka_cluster import KafkaCluster, KafkaClusterError, find_kafka_home
from kiproxy_dev.kms import KmsLaunchError, LocalKms, export_credentials
from kiproxy_dev.processes import bind_problem
from kiproxy_dev.tansu import BrokerBinaryMissing, BrokerPortTaken, EmbeddedBroker

log = logging.getLogger("kiproxy")

__all__ = ["COMMANDS", "DevSettings", "add_parsers", "run"]

COMMANDS = ("dev",)


class DevSettings(BaseModel):
    """``kiproxy dev``'s own settings (the broker beside the proxy), declared once: each
    field's :class:`~kiproxy.interceptors.flags.Flag` makes its command-line option."""

    # The docstring under a field is its description: the flag's help.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    broker: Annotated[Literal["tansu", "kafka"], Flag()] = "tansu"
    """tansu (starts in a second, no JVM) or kafka (Apache Kafka in KRaft mode, JVMs on
    127.0.0.1, from --kafka-home)."""
    broker_port: Annotated[int | None, Flag(metavar="PORT")] = Field(default=None, ge=1,
                                                                     le=65535)
    """The broker's own port on 127.0.0.1, for clients that bypass the proxy (default: a
    free one); with --broker kafka the first broker's, node N on PORT + N - 1 (the
    controller on a free port)."""
    kafka_home: Annotated[Path | None, Flag(metavar="DIR")] = None
    """With --broker kafka: an unpacked Apache Kafka 4 distribution, or the folder `make
    kafka` prints (when not given: $KIPROXY_KAFKA_HOME, then the newest `make kafka`
    folder)."""
    kafka_nodes: Annotated[int, Flag(metavar="N")] = Field(default=1, gt=0)
    """With --broker kafka: brokers (node ids 1..N; plus one controller)."""
    registry: Annotated[bool, Flag(set_to=True)] = False
    """Also start a schema registry (Apicurio Registry, in memory, the Confluent API at
    http://127.0.0.1:PORT/apis/ccompat/v7; built by `make registry`, needs Java 17+)."""
    registry_port: Annotated[int, Flag(metavar="PORT")] = Field(default=8081, ge=0, le=65535)
    """With --registry: its port on 127.0.0.1."""
    registry_jar: Annotated[Path | None, Flag(metavar="JAR")] = None
    """With --registry: the quarkus-run.jar `make registry` prints (when not given:
    $KIPROXY_REGISTRY_JAR, then the `make registry` cache)."""

    kms: Annotated[bool, Flag(set_to=True)] = False
    """Also start a stand-in for AWS KMS (moto's server, in memory) at
    http://127.0.0.1:PORT, region us-east-1, for record_encryption; needs `pip install
    './dev[kms]'`."""
    kms_port: Annotated[int, Flag(metavar="PORT")] = Field(default=4566, ge=0, le=65535)
    """With --kms: its port on 127.0.0.1."""
    kms_key: Annotated[list[str], Flag(metavar="ALIAS", repeat=True)] = []
    """With --kms: create a key under this alias (alias/KEK_orders); repeatable."""

    @model_validator(mode="after")
    def _paired(self) -> DevSettings:
        given = self.model_fields_set
        if not self.kms and given & {"kms_port", "kms_key"}:
            raise ValueError("--kms-port and --kms-key need --kms")
        if not self.registry and given & {"registry_jar", "registry_port"}:
            raise ValueError("--registry-jar and --registry-port need --registry")
        if self.broker != "kafka" and given & {"kafka_home", "kafka_nodes"}:
            raise ValueError("--kafka-home and --kafka-nodes need --broker kafka")
        if self.broker == "kafka" and (self.broker_port or 0) + self.kafka_nodes - 1 > 65535:
            raise ValueError(f"--broker-port {self.broker_port} leaves no port for node "
                             f"{self.kafka_nodes} (PORT + N - 1 is at most 65535)")
        return self


def add_parsers(subparsers: Any) -> None:
    """Add ``dev`` to ``kiproxy``'s subcommands."""
    dev = subparsers.add_parser(
        "dev", help="run an embedded broker with the proxy in front of it",
        description="Start an embedded Kafka-compatible broker (Tansu, memory storage) and "
                    "the proxy in front of it.")
    proxy_cli.add_flags(dev, "dev")
    add_model_flags(dev, DevSettings, "dev")


def run(args: argparse.Namespace) -> int:
    """Run ``kiproxy dev``; returns the exit code."""
    try:
        settings = model_from_flags(args, DevSettings)
    except FlagError as exc:
        print(f"kiproxy: config error: {exc}", file=sys.stderr)
        return 2

    def body(config: ProxyConfig, args: argparse.Namespace, overrides: dict[str, Any]) -> int:
        return _dev(config, args.config, overrides, settings)

    # The upstream is replaced once the broker is up.
    return proxy_cli.run(args, body, upstream=["127.0.0.1:1"])


def _dev(config: ProxyConfig, config_file: str | None, overrides: dict[str, Any],
         settings: DevSettings) -> int:
    host, port = parse_host_port(config.listen, "listen")
    taken = bind_problem(port, host)
    if taken is not None:  # said before the brokers, registry and KMS take their seconds
        print(f"kiproxy: cannot listen on {config.listen} (--listen): {taken}; nothing was "
              "started", file=sys.stderr)
        return 1
    if not settings.kms:
        return _dev_registry(config, config_file, overrides, settings)
    try:
        with _kms(settings.kms_port, settings.kms_key) as kms:
            for problem in kms_endpoint_problems(config, kms.url):
                print(f"kiproxy: warning: {problem}", file=sys.stderr, flush=True)
            return _dev_registry(config, config_file, overrides, settings)
    except KmsLaunchError as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1


def kms_endpoint_problems(config: ProxyConfig, url: str) -> list[str]:
    """Why the interceptors ``config`` loads would not call the KMS stand-in at ``url``:
    an AWS ``kms`` whose ``endpoint`` is another address, or unset (AWS itself)."""
    links = [(config.interceptor.class_name, config.interceptor.config)] + [
        (link.class_name, link.config) for route in config.every_route
        for link in route.interceptors]
    problems = []
    for name, settings in links:
        kms = settings.get("kms") if isinstance(settings, dict) else None
        if not isinstance(kms, dict) or kms.get("type") != "aws":
            continue
        # An unset endpoint is the SDK's: AWS_ENDPOINT_URL_KMS or AWS_ENDPOINT_URL, as
        # every AWS SDK reads them, else AWS itself.
        source, endpoint = f"{name}'s kms.endpoint", kms.get("endpoint")
        for variable in () if endpoint else ("AWS_ENDPOINT_URL_KMS", "AWS_ENDPOINT_URL"):
            if os.environ.get(variable):
                source, endpoint = variable, os.environ[variable]
                break
        if endpoint is None:
            problems.append(f"{source} is unset, so it calls AWS itself, not the stand-in "
                            f"at {url}; set \"endpoint\": \"{url}\"")
        elif _place(str(endpoint)) != _place(url):
            problems.append(f"{source} is {endpoint}, not the stand-in at {url} "
                            "(--kms-port); set one to the other")
    return problems


_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def _place(url: str) -> tuple[str, int | None]:
    """Where ``url`` connects: its host (any loopback name as one) and port."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return ("loopback" if host in _LOOPBACK else host), parts.port


@contextlib.contextmanager
def _kms(port: int, aliases: list[str]) -> Iterator[LocalKms]:
    kms = LocalKms(port)
    kms.start()
    try:
        keys = [(alias, kms.create_key(alias)) for alias in aliases]
        added = export_credentials()
        print(f"kiproxy: KMS stand-in (AWS KMS API, moto, in memory) at {kms.url}, region "
              f"{kms.region}", flush=True)
        for alias, arn in keys:
            print(f"kiproxy: KMS key {alias} ({arn})", flush=True)
        if added:
            print("kiproxy: the proxy uses these credentials; a client of the stand-in "
                  "needs them too: export " + " ".join(f"{k}={v}" for k, v in added.items()),
                  flush=True)
        yield kms
    finally:
        kms.stop()


def _dev_registry(config: ProxyConfig, config_file: str | None, overrides: dict[str, Any],
                  settings: DevSettings) -> int:
    if not settings.registry:
        return _dev_broker(config, config_file, overrides, settings)
    jar = settings.registry_jar if settings.registry_jar is not None else find_registry_jar()
    if jar is None:
        print("kiproxy: no Apicurio Registry built: run `make registry` (or pass the jar it "
              "prints with --registry-jar)", file=sys.stderr)
        return 1
    try:
        with _registry(jar, settings.registry_port):
            return _dev_broker(config, config_file, overrides, settings)
    except RegistryLaunchError as exc:
        first, _, detail = str(exc).partition("\n")
        if detail:
            log.debug("%s", detail)
        print(f"kiproxy: {first}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _registry(jar: Path, port: int) -> Iterator[ApicurioRegistry]:
    registry = ApicurioRegistry(jar, port=port)
    log.info("starting the schema registry (Apicurio Registry, in memory) from %s", jar)
    registry.start()
    try:
        print(f"kiproxy: schema registry (Apicurio Registry, in memory) at {registry.url}",
              flush=True)
        yield registry
    finally:
        registry.stop()


def _dev_broker(config: ProxyConfig, config_file: str | None, overrides: dict[str, Any],
                settings: DevSettings) -> int:
    if settings.broker == "kafka":
        return _dev_kafka(config, config_file, overrides, settings)
    broker = EmbeddedBroker(settings.broker_port)
    try:
        broker.start()
    except BrokerPortTaken as exc:
        print(f"kiproxy: {exc} (--broker-port)", file=sys.stderr)
        return 1
    except BrokerBinaryMissing as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1
    try:
        log.info("embedded broker (Tansu, memory storage) on %s", broker.bootstrap)
        upstream = [broker.bootstrap]
        config = config.model_copy(update={"upstream": upstream})
        serve_until_stopped(config, config_file, {**overrides, "upstream": upstream})
    finally:
        broker.stop()
    return 0


def _dev_kafka(config: ProxyConfig, config_file: str | None, overrides: dict[str, Any],
               settings: DevSettings) -> int:
    """Apache Kafka (``nodes`` brokers and a controller) with the proxy in front of it.

    Every launcher failure (no jars, Java too old, a port taken, a node that exits
    or never becomes ready) is one line; the launcher has ended its JVMs by then.
    """
    nodes = settings.kafka_nodes
    home = settings.kafka_home if settings.kafka_home is not None else find_kafka_home()
    if home is None:
        print("kiproxy: no Apache Kafka found: run `make kafka` and pass the folder it prints "
              "with --kafka-home (or set KIPROXY_KAFKA_HOME)", file=sys.stderr)
        return 1
    try:
        port = settings.broker_port
        cluster = KafkaCluster(home, nodes=nodes, broker_ports=None if port is None
                               else [port + i for i in range(nodes)])
        log.info("starting Apache Kafka %s (%d broker(s) and a controller) from %s",
                 cluster.kafka_version, nodes, home)
        cluster.start()
    except KafkaClusterError as exc:
        first, _, detail = str(exc).partition("\n")
        if detail:
            log.debug("%s", detail)
            first += " (--log-level DEBUG prints the end of its log)"
        print(f"kiproxy: {first}", file=sys.stderr)
        return 1
    try:
        log.info("embedded broker (Apache Kafka %s, %d node(s), data in %s) on %s",
                 cluster.kafka_version, nodes, cluster.workdir, cluster.bootstrap)
        upstream = cluster.bootstrap.split(",")
        config = config.model_copy(update={"upstream": upstream})
        serve_until_stopped(config, config_file, {**overrides, "upstream": upstream})
    finally:
        cluster.stop()
    return 0
