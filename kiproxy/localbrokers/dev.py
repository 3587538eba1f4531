"""``kiproxy dev``: a local broker (Tansu, or Apache Kafka in KRaft mode) with the proxy
in front of it, and with ``--registry`` a local Apicurio Registry beside them.

``add_parsers`` adds the subcommand to the ``kiproxy`` parser (:mod:`kiproxy.cli`)
with the proxy's own flags (:func:`kiproxy.proxy.cli.add_flags`: the config model's,
without the upstream ones) and the broker's; ``run`` starts the broker, serves the
proxy in front of it until SIGINT/SIGTERM, then stops the broker, and returns the
exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiproxy.localbrokers.apicurio import ApicurioRegistry, RegistryLaunchError, find_registry_jar
from kiproxy.localbrokers.kafka_cluster import KafkaCluster, KafkaClusterError, find_kafka_home
from kiproxy.localbrokers.tansu import BrokerBinaryMissing, EmbeddedBroker
from kiproxy.proxy import cli as proxy_cli
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.serve import serve_until_stopped

log = logging.getLogger("kiproxy")

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("dev",)


def add_parsers(subparsers: Any) -> None:
    """Add ``dev`` to ``kiproxy``'s subcommands."""
    dev = subparsers.add_parser(
        "dev", help="run an embedded broker with the proxy in front of it",
        description="Start an embedded Kafka-compatible broker (Tansu, memory storage) and "
                    "the proxy in front of it.")
    proxy_cli.add_flags(dev, "dev")
    dev.add_argument("--broker", choices=("tansu", "kafka"), default="tansu",
                     help="tansu (default: starts in a second, no JVM) or kafka (Apache Kafka "
                          "in KRaft mode, JVMs on 127.0.0.1, from --kafka-home)")
    dev.add_argument("--kafka-home", metavar="DIR",
                     help="with --broker kafka: an unpacked Apache Kafka 4 distribution, or "
                          "the folder `make kafka` prints (default: $KIPROXY_KAFKA_HOME, "
                          "then the newest `make kafka` folder)")
    dev.add_argument("--kafka-nodes", metavar="N", type=int, default=1,
                     help="with --broker kafka: brokers (node ids 1..N; plus one controller)")
    dev.add_argument("--registry", action="store_true",
                     help="also start a schema registry (Apicurio Registry, in memory, the "
                          "Confluent API at http://127.0.0.1:PORT/apis/ccompat/v7; built by "
                          "`make registry`, needs Java 17+)")
    dev.add_argument("--registry-port", metavar="PORT", type=int, default=8081,
                     help="with --registry: its port on 127.0.0.1 (default 8081)")
    dev.add_argument("--registry-jar", metavar="JAR", type=Path,
                     help="with --registry: the quarkus-run.jar `make registry` prints "
                          "(default: $KIPROXY_REGISTRY_JAR, then the `make registry` cache)")


def run(args: argparse.Namespace) -> int:
    """Run ``kiproxy dev``; returns the exit code."""
    # The upstream is replaced once the broker is up.
    return proxy_cli.run(args, _dev, upstream=["127.0.0.1:1"])


def _dev(config: ProxyConfig, args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    if not args.registry:
        if args.registry_jar is not None or args.registry_port != 8081:
            print("kiproxy: config error: --registry-jar and --registry-port need --registry",
                  file=sys.stderr)
            return 2
        return _dev_broker(config, args, overrides)
    jar = args.registry_jar if args.registry_jar is not None else find_registry_jar()
    if jar is None:
        print("kiproxy: no Apicurio Registry built: run `make registry` (or pass the jar it "
              "prints with --registry-jar)", file=sys.stderr)
        return 1
    try:
        with _registry(jar, args.registry_port):
            return _dev_broker(config, args, overrides)
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


def _dev_broker(config: ProxyConfig, args: argparse.Namespace,
                overrides: dict[str, Any]) -> int:
    if args.broker == "kafka":
        return _dev_kafka(config, args, overrides)
    if args.kafka_home is not None or args.kafka_nodes != 1:
        print("kiproxy: config error: --kafka-home and --kafka-nodes need --broker kafka",
              file=sys.stderr)
        return 2
    broker = EmbeddedBroker()
    try:
        broker.start()
    except BrokerBinaryMissing as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1
    try:
        log.info("embedded broker (Tansu, memory storage) on %s", broker.bootstrap)
        upstream = [broker.bootstrap]
        config = config.model_copy(update={"upstream": upstream})
        serve_until_stopped(config, args.config, {**overrides, "upstream": upstream})
    finally:
        broker.stop()
    return 0


def _dev_kafka(config: ProxyConfig, args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Apache Kafka (``nodes`` brokers and a controller) with the proxy in front of it.

    Every launcher failure (no jars, Java too old, a port taken, a node that exits
    or never becomes ready) is one line; the launcher has ended its JVMs by then.
    """
    nodes: int = args.kafka_nodes
    home = args.kafka_home if args.kafka_home is not None else find_kafka_home()
    if home is None:
        print("kiproxy: no Apache Kafka found: run `make kafka` and pass the folder it prints "
              "with --kafka-home (or set KIPROXY_KAFKA_HOME)", file=sys.stderr)
        return 1
    try:
        cluster = KafkaCluster(home, nodes=nodes)
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
        serve_until_stopped(config, args.config, {**overrides, "upstream": upstream})
    finally:
        cluster.stop()
    return 0
