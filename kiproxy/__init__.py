"""kiproxy: a Kafka proxy that hands every produced record batch to an interceptor.

The installed distribution ``kafka-interceptor-proxy`` is this one namespace:

- :mod:`kiproxy.protocol`: sans-IO Kafka wire code (framing, messages, record batches);
- :mod:`kiproxy.interceptors`: the public plugin API, the loader and the built-ins;
- :mod:`kiproxy.proxy`: the asyncio runtime (``kiproxy run``);
- :mod:`kiproxy.pipelines`: PySpark jobs (``kiproxy replay`` and ``kiproxy report``);
- :mod:`kiproxy.cli`: the ``kiproxy`` command above the runtime and the pipelines.

Importing ``kiproxy`` imports none of them. ``kiproxy dev`` and the local brokers
(Tansu, Apache Kafka, Apicurio Registry) are not in it: they are ``kiproxy_dev``, the
distribution ``kafka-interceptor-proxy-dev`` in the checkout's ``dev/`` folder.
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
