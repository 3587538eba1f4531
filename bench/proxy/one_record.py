"""The one-record-per-request load: many connections, each waiting for every ack.

:func:`one_record_load` (run in a process of its own, ``python -m bench.ab
--worker-one-record SPEC``) starts ``connections`` confluent-kafka producers,
each on a thread and a connection of its own, ``linger.ms`` 0, that produce one
``value_size``-byte record, wait for its acknowledgement (``flush``), and
produce the next, for ``seconds``. Every Produce request then carries exactly
one record, so the proxy's CPU over the phase divided by the requests acked in
it is its cost per request: what framing, dispatch, the upstream write and the
response's way back cost, with no batching to spread it over.

The CPU of the processes in ``spec["pids"]`` is read at the start and at the
end of the timed phase (:class:`~bench.proxy.cpu.CpuSampler`: process CPU
seconds from ``/proc``, which a shared machine disturbs far less than wall
time), and the requests counted between the same two instants.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from bench.proxy.cpu import CpuSampler
from bench.proxy.run import create_topic
from bench.proxy.stats import json_values

WARMUP = 20
"""Records each connection sends (one per request) before the timed phase."""


def one_record_load(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Run the load of the module docstring; requests acked and CPU seconds by process."""
    from confluent_kafka import Producer

    bootstrap, topic = spec["bootstrap"], spec["topic"]
    connections = int(spec["connections"])
    create_topic(bootstrap, topic, connections)
    value = json_values(int(spec["value_size"]), 1)[0]
    counts = [0] * connections
    errors: list[str] = []
    stop = threading.Event()
    ready = threading.Barrier(connections + 1)

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None and len(errors) < 5:
            errors.append(str(err))

    def connection(k: int) -> None:
        producer = Producer({"bootstrap.servers": bootstrap, "client.id": f"bench-one-{k}",
                             "acks": str(spec.get("acks", "1")), "linger.ms": 0,
                             "socket.nagle.disable": True, "enable.idempotence": False,
                             "on_delivery": on_delivery})
        try:
            for _ in range(WARMUP):
                producer.produce(topic, value, partition=k)
                producer.flush(30)
        finally:
            ready.wait()
        produce, flush = producer.produce, producer.flush
        while not stop.is_set():
            produce(topic, value, partition=k)
            if flush(30):
                errors.append(f"connection {k}: a record was not acknowledged within 30 s")
                return
            counts[k] += 1

    threads = [threading.Thread(target=connection, args=(k,), daemon=True)
               for k in range(connections)]
    for thread in threads:
        thread.start()
    ready.wait()
    sampler = CpuSampler(spec["pids"])
    before, sent_before = sampler.sample(), sum(counts)
    t0 = time.perf_counter()
    time.sleep(float(spec["seconds"]))
    after, sent_after = sampler.sample(), sum(counts)
    seconds = time.perf_counter() - t0
    stop.set()
    for thread in threads:
        thread.join(35)
    result: dict[str, Any] = {"requests": sent_after - sent_before, "seconds": seconds,
                              "cpu": CpuSampler.delta(before, after)}
    if errors:
        result["error"] = f"one-record load: {errors[0]}"
    return result
