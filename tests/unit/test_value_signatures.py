"""``Record``, ``Header`` and ``RecordBatch`` are built the way their docstrings say."""

from __future__ import annotations

import inspect

import pytest

from kiproxy.interceptors import Header, Record, RecordBatch


def test_record_is_keyword_only_and_its_docstring_says_so() -> None:
    assert Record.__doc__ is not None
    assert Record.__doc__.splitlines()[0] == (
        "Record(*, key=None, value=None, headers=(), timestamp=0, offset_delta=0)")
    record = Record(key=b"k", value=b"v", headers=[("h", b"1")], timestamp=5, offset_delta=1)
    assert (record.key, record.value, record.headers, record.timestamp,
            record.offset_delta) == (b"k", b"v", (Header("h", b"1"),), 5, 1)
    with pytest.raises(TypeError) as info:
        Record(b"k", value=b"v")  # type: ignore[misc]
    assert str(info.value) == (
        "Record() takes keyword arguments only (1 positional given): "
        "Record(key=..., value=..., headers=..., timestamp=..., offset_delta=...)")


def test_header_takes_key_and_value_as_its_docstring_says() -> None:
    assert Header.__doc__ is not None
    assert Header.__doc__.startswith("Header(key, value): ")
    assert Header("h", b"1") == Header(key="h", value=b"1")


def test_record_batch_is_keyword_only() -> None:
    parameters = inspect.signature(RecordBatch).parameters.values()
    assert {p.kind for p in parameters} == {inspect.Parameter.KEYWORD_ONLY}
    with pytest.raises(TypeError):
        RecordBatch("orders", 0, ())  # type: ignore[misc]
    batch = RecordBatch(topic="orders", partition=0, records=(Record(value=b"v"),))
    assert (batch.topic, batch.partition, len(batch.records)) == ("orders", 0, 1)
