"""End-to-end proxy benchmark: a real producer through kiproxy, against direct and haproxy.

Run from the repository root with the project's virtualenv::

    python -m bench.proxy              # full matrix, 3 interleaved rounds; writes bench/RESULTS.md
    python -m bench.proxy --quick      # 1 KiB uncompressed only, fewer records: under 5 minutes
    python -m bench.proxy --profile uppercase   # one run under py-spy, prints the hot spots

Every run starts a fresh embedded broker (Tansu, memory storage) and, for the
proxied scenarios, a fresh proxy process in front of it, then drives it with a
real producer (confluent-kafka / librdkafka) in a subprocess of its own:

* **direct**: the producer talks to the broker (the baseline of every ratio).
* **haproxy**: ``haproxy`` in TCP mode (one thread) as a plain L4 hop, the floor
  for any proxy. Kafka clients reconnect to the addresses the broker advertises,
  so for this scenario the broker advertises haproxy's port.
* **passthrough**: ``kiproxy run`` with no interceptor.
* **identity**: ``bench/plugins/identity.py``: every batch decoded, returned unchanged.
* **uppercase**: ``kiproxy.interceptors.builtin.uppercase:Uppercase``: decode, transform, re-encode.
* **validator**: ``kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator`` with a small
  schema (the values are JSON objects that satisfy it).

Each run has two phases after a warm-up. *Throughput*: ``--records`` records are
produced as fast as the producer can queue them, timed from the first
``produce()`` to the end of ``flush()``. *Latency*: a paced producer offers a
fixed load (``--load-fraction`` of the direct scenario's throughput for that
record size and codec, measured in the first round) for ``--latency-seconds``;
every record's latency (or a random 1 in ``--latency-sample`` records') is
librdkafka's own produce-to-acknowledgement time (``Message.latency()`` in the
delivery callback; ``bench/proxy/paced.py``). ``--others-nice`` runs the broker and
the producer below the hop's priority. The proxy's CPU is read from
``/proc/<pid>/stat`` (utime + stime of the proxy process and its children) at
the phase boundaries.

Scenarios run in rounds (every scenario once for every record size and codec,
then again), rotated each round, and the table reports medians: the machine is
shared, and interleaving makes drift hit every scenario alike. Ratios and added
latency are medians of per-round pairs (a scenario against direct in the same
round).

The package, one module per job: ``scenarios`` (what runs: scenarios, record
sizes, codecs, paths), ``run`` (one run: broker, hop, producer processes),
``paced`` (the paced latency phase), ``cpu`` (CPU and memory from ``/proc``),
``stats`` (medians, ratios, targets), ``render`` (the tables for RESULTS.md) and
``matrix`` (the command line and the rounds). ``python -m bench.proxy`` runs
``matrix.main``.
"""
