"""What each Python client shows its application for a plain ``RejectBatch(message)``.

The table in docs/rejections.md is measured the same way; this pins the default
code's row: POLICY_VIOLATION (44) is named by all three clients and retried by
none, and kafka-python alone shows the plugin's message. INVALID_RECORD (87), the
previous default, is unknown to aiokafka 0.14 (``UnknownError``).
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
