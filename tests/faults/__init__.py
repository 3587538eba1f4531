"""Fault suites that stay: what the proxy does when something it depends on misbehaves.

``registry_standin.py`` is a stand-in schema registry on loopback (an aiohttp server on
a thread of its own, speaking the Confluent Schema Registry API paths the proxy's
client uses) that switches per test phase between healthy, hang, HTTP 500, garble (not
JSON), flood (a 50 MB answer, with or without its length), trickle (1 byte a second),
an uncompilable schema and a closed port; it can serve HTTPS and require a bearer
token. ``pki.py`` writes the certificates the TLS faults need (a CA the proxy trusts,
one it does not, a client certificate that has expired).

``test_registry_faults.py`` runs a real proxy (``kiproxy run``, in front of Tansu) with
real confluent-kafka producers through every fault: the checked topic's producer gets a
retriable answer under ``on_registry_unavailable: reject`` and its record stored under
``pass``, another topic's producer is served throughout, the proxy's memory stays
bounded and its log holds no ERROR. ``test_registry_credentials.py`` does the same for
a wrong CA, an expired or untrusted client certificate and a refused token, and shows
that replaced credential files are picked up. ``test_registry_answer_bounds.py`` pins
the client's size bound (by Content-Length, and while streaming) and the parse of large
answers off the event loop. No test asserts a latency;
``bench/registry_faults.py`` measures the other topic's p99 against a producer direct
to the broker.
"""
