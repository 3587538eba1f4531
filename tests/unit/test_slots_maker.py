"""SlotsMaker: the compiled constructor of the frozen, slotted dataclasses on the hot path
gives the instance the class's own ``__init__`` gives, and leaves the class frozen."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kiproxy.interceptors import api, chain, verdict
from kiproxy.protocol import partition_batches, records
from kiproxy.protocol._codec import SlotsMaker

MAKERS: list[tuple[Any, type]] = [
    (api.batch_from_fields, api.RecordBatch),
    (api.context_from_fields, api.InterceptContext),
    (chain._result_from_fields, chain.ChainResult),
    (verdict._unchanged, verdict.Unchanged),
    (verdict._transformed, verdict.Transformed),
    (records._header_from_fields, records.RecordBatchHeader),
    (records._decoded_from_fields, records.DecodedBatch),
    (partition_batches._from_fields, partition_batches.PartitionBatches),
]


@pytest.mark.parametrize(("make", "cls"), MAKERS, ids=lambda m: getattr(m, "__name__", ""))
def test_a_maker_gives_what_the_class_gives_field_by_field(make: Any, cls: type) -> None:
    fields = dataclasses.fields(cls)
    values = [object() for _ in fields]  # a value of its own per field: the order shows
    made = make(*values)
    assert type(made) is cls
    assert made == cls(**{f.name: v for f, v in zip(fields, values, strict=True)})
    assert [getattr(made, f.name) for f in fields] == values


def test_what_a_maker_made_stays_frozen() -> None:
    batch = api.batch_from_fields("orders", 0, (), -1, -1, -1, False, "none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.topic = "other"  # type: ignore[misc]
    assert dataclasses.replace(batch, topic="other").topic == "other"
    assert batch.with_records(()) == batch


def test_a_wrong_number_of_values_names_the_class() -> None:
    with pytest.raises(TypeError, match=r"RecordBatch has 8 fields; 2 values given"):
        api.batch_from_fields("orders", 0)  # type: ignore[call-arg]


def test_a_class_it_cannot_make_is_refused_when_the_maker_is_made() -> None:
    @dataclasses.dataclass
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            raise ValueError

    with pytest.raises(TypeError, match="is not a dataclass"):
        SlotsMaker(int)
    with pytest.raises(TypeError, match=r"NoSlots\.a is not a slot"):
        SlotsMaker(NoSlots)
    with pytest.raises(TypeError, match="has a __post_init__"):
        SlotsMaker(Checked)
