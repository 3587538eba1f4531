"""What each Python client shows its application for a plain ``RejectBatch(message)``.

The table in docs/rejections.md is measured the same way; this pins the default
code's row: POLICY_VIOLATION (44) is named by all three clients and retried by
none, and kafka-python alone shows the plugin's message. INVALID_RECORD (87), the
previous default, is unknown to aiokafka 0.14 (``UnknownError``). With
``record_errors``, confluent-kafka and kafka-python fail each record of the batch on its
own (KIP-467): the table of that in docs/rejections.md is pinned here too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import TESTS, ProxyProcess, launch_proxy

from kiproxy.interceptors import RejectBatch

REASON = "orders need a customer id"


@pytest.fixture(scope="module")
def proxy(broker: Any) -> Iterator[ProxyProcess]:
    p = launch_proxy(broker.bootstrap, interceptor="tp_plain_reject:PlainReject",
                     plugins_dir=TESTS / "plugins")
    yield p
    p.stop()


def _topic(code: int | None = None) -> str:
    prefix = "plain" if code is None else f"code-{code}"
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_the_default_code_is_policy_violation() -> None:
    assert RejectBatch(REASON).error_code == 44


def test_confluent_kafka_names_policy_violation_and_does_not_retry(proxy: ProxyProcess) -> None:
    from confluent_kafka import KafkaError, Producer

    errors: list[Any] = []
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "message.timeout.ms": 10000})
    producer.produce(_topic(), b"v", partition=0, on_delivery=lambda e, m: errors.append(e))
    assert producer.flush(20) == 0
    (error,) = errors
    assert error.code() == KafkaError.POLICY_VIOLATION
    assert error.name() == "POLICY_VIOLATION"
    assert error.str() == "Broker: Policy violation"  # error_message is not shown
    assert not error.retriable()


def test_kafka_python_names_it_and_shows_the_plugins_message(proxy: ProxyProcess) -> None:
    from kafka import KafkaProducer
    from kafka.errors import PolicyViolationError

    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, request_timeout_ms=10000)
    try:
        with pytest.raises(PolicyViolationError) as info:
            producer.send(_topic(), b"v", partition=0).get(20)
    finally:
        producer.close(5)
    assert str(info.value) == f"[Error 44] PolicyViolationError: {REASON}"
    assert not info.value.retriable


async def _aiokafka_send(bootstrap: str, topic: str) -> BaseException:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, b"v", partition=0), 20)
    except Exception as exc:
        return exc
    finally:
        await producer.stop()
    raise AssertionError("the rejected batch was acknowledged")


def test_aiokafka_names_policy_violation(proxy: ProxyProcess) -> None:
    from aiokafka.errors import PolicyViolationError

    error = asyncio.run(_aiokafka_send(proxy.bootstrap, _topic()))
    assert isinstance(error, PolicyViolationError)
    assert str(error) == "[Error 44] PolicyViolationError"  # error_message is not shown
    assert not error.retriable


def test_aiokafka_does_not_know_invalid_record(proxy: ProxyProcess) -> None:
    from aiokafka.errors import UnknownError

    error = asyncio.run(_aiokafka_send(proxy.bootstrap, _topic(87)))
    assert type(error) is UnknownError
    assert str(error) == "[Error -1] UnknownError"


def _batch_outcomes_confluent(proxy: ProxyProcess, values: list[bytes]) -> list[str]:
    from confluent_kafka import Producer

    topic = f"each-{uuid.uuid4().hex[:8]}"
    outcomes: dict[bytes, str] = {}
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "linger.ms": 200,
                         "message.timeout.ms": 10000})
    for value in values:
        producer.produce(topic, value, partition=0,
                         on_delivery=lambda e, m: outcomes.__setitem__(m.value(), e.name()))
    assert producer.flush(20) == 0
    return [outcomes[v] for v in values]


def _batch_outcomes_kafka_python(proxy: ProxyProcess, values: list[bytes]) -> list[str]:
    from kafka import KafkaProducer

    topic = f"each-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, linger_ms=200, retries=0,
                             request_timeout_ms=10000)
    try:
        futures = [producer.send(topic, v, partition=0) for v in values]
        producer.flush(timeout=20)
        out = []
        for f in futures:
            try:
                f.get(timeout=5)
                out.append("ok")
            except Exception as exc:  # the client's own error is the outcome
                out.append(str(exc))
        return out
    finally:
        producer.close(timeout=5)


def test_record_errors_in_confluent_kafka(proxy: ProxyProcess) -> None:
    # Two record errors: the records named fail INVALID_RECORD, whatever the batch's code;
    # the others, _INVALID_DIFFERENT_RECORD. One: every record gets the batch's code.
    assert _batch_outcomes_confluent(proxy, [b"bad 0", b"good 1", b"bad 2"]) == [
        "INVALID_RECORD", "_INVALID_DIFFERENT_RECORD", "INVALID_RECORD"]
    assert _batch_outcomes_confluent(proxy, [b"good 0", b"bad 1", b"good 2"]) == [
        "POLICY_VIOLATION"] * 3


def test_record_errors_in_kafka_python(proxy: ProxyProcess) -> None:
    # The records named fail with their own text: under the batch's code when there is
    # one record error, as InvalidRecordError when there are more; the others with a
    # generic error.
    other = ("KafkaError: Failed to append record because it was part of a batch which "
             "had one more more invalid records")
    assert _batch_outcomes_kafka_python(proxy, [b"bad 0", b"good 1", b"bad 2"]) == [
        "[Error 87] InvalidRecordError: record 0 is bad", other,
        "[Error 87] InvalidRecordError: record 2 is bad"]
    assert _batch_outcomes_kafka_python(proxy, [b"good 0", b"bad 1", b"good 2"]) == [
        other, "[Error 44] PolicyViolationError: record 1 is bad", other]
