"""Local brokers for ``kiproxy dev``, the tests and the benches (Tansu, Apache Kafka in
KRaft mode, their process registry and metadata probe); may import the proxy, never
imported by it."""
