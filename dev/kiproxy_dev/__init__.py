"""Local brokers for ``kiproxy dev``, the tests and the benches: Tansu (:mod:`.tansu`),
Apache Kafka in KRaft mode (:mod:`.kafka_cluster`, :mod:`.kafka_distribution`,
:mod:`.metadata_probe`), Apicurio Registry (:mod:`.apicurio`), the registry of the
processes they start and the one way to stop one (:mod:`.processes`), and the ``kiproxy
dev`` command itself (:mod:`.cli`).

Contract: this package may import the proxy; the proxy never imports it
(tests/unit/test_import_graph.py). It is a distribution of its own,
``kafka-interceptor-proxy-dev`` in the checkout's ``dev/`` folder, not part of the runtime
wheel nor of the image: an extra of ``kafka-interceptor-proxy`` could add dependencies but
not packages, and the runtime should not ship launchers of JVMs and test brokers.
``kiproxy`` finds ``dev`` through the ``kiproxy.commands`` entry point this distribution
declares; without it, ``kiproxy dev`` says what to install. ``make run`` and ``make
install`` install both (``pip install -e . -e ./dev``).
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
