"""confluent-kafka clients in tests: producers closed when their test ends, and
reading what a consumer is given.

A producer left open keeps librdkafka's threads, connections and queued records
alive after its test, and one left to the garbage collector closes (and may
block) at some later moment, inside another test. :func:`confluent_producer`
registers each producer it makes; :func:`close_producers`, which an autouse
fixture of ``tests/integration/conftest.py`` calls after every test, purges what
each still holds, serves the purged records' callbacks and closes it.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["close_producers", "confluent_producer", "group_consumer_conf", "poll_messages"]

_OPEN: list[Any] = []


def confluent_producer(conf: dict[str, Any]) -> Any:
    """A ``confluent_kafka.Producer`` with ``conf``, closed when the test ends."""
    from confluent_kafka import Producer

    producer = Producer(conf)
    _OPEN.append(producer)
    return producer


def group_consumer_conf(bootstrap: str, group: str, group_protocol: str) -> dict[str, Any]:
    """A consumer in ``group`` that commits by hand and starts at the earliest offset;
    the classic protocol gets short session and heartbeat times (KIP-848 groups take
    theirs from the broker): ``session.timeout.ms`` 6000, the lowest a Kafka broker
    accepts, as Tansu holds a member's first JoinGroup for half of it."""
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "group.id": group,
                            "enable.auto.commit": False, "auto.offset.reset": "earliest",
                            "group.protocol": group_protocol}
    if group_protocol == "classic":
        conf.update({"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})
    return conf


def close_producers() -> None:
    """Purge and close every producer :func:`confluent_producer` made since the last call."""
    while _OPEN:
        producer = _OPEN.pop()
        producer.purge()
        producer.flush(5)  # the purged records' delivery callbacks
        close = getattr(producer, "close", None)  # newer confluent-kafka versions
        if close is not None:
            close()


def poll_messages(consumer: Any, count: int, timeout: float = 60) -> list[Any]:
    """Up to ``count`` messages ``consumer.poll`` hands out within ``timeout`` seconds
    (fewer if that time runs out first); errors it reports are skipped."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            out.append(msg)
    return out
