"""The per-record loop the header middleware share: map each record, collect problems.

:func:`map_records` applies a per-record function and collects the records it
refused; :func:`per_record` is the whole ending of a per-record plugin's
``intercept``: the batch itself when no record changed, a copy with the new
records otherwise, or ``RejectBatch`` naming how many records were refused
and the first, with every refused record's index as a record error.
"""

from __future__ import annotations

from collections.abc import Callable

from kiproxy.interceptors.api import Record, RecordBatch, RejectBatch

__all__ = ["MAX_REPORTED", "map_records", "per_record"]

MAX_REPORTED = 50
"""Record errors reported per rejected batch; the loop stops collecting beyond it."""


def map_records(
    batch: RecordBatch, one: Callable[[Record], Record | str]
) -> tuple[list[Record], list[tuple[int, str]]]:
    """Apply ``one`` to every record; a ``str`` result is a problem with that record.

    Returns the new records and the ``(record index, problem)`` pairs, at most
    :data:`MAX_REPORTED` of them (the records list is incomplete when there are problems).
    """
    out: list[Record] = []
    problems: list[tuple[int, str]] = []
    for i, record in enumerate(batch.records):
        result = one(record)
        if isinstance(result, str):
            problems.append((i, result))
            if len(problems) >= MAX_REPORTED:
                break
        else:
            out.append(result)
    return out, problems


def per_record(batch: RecordBatch, one: Callable[[Record], Record | str], *, plugin: str,
               refused: str, error: str | int) -> RecordBatch:
    """``batch`` with ``one`` applied to every record, or ``RejectBatch`` (``error``).

    The rejection reads "``plugin``: N record(s) of topic[partition] ``refused``;
    first, record I: problem"; the batch itself is returned when ``one`` returned
    every record as it was.
    """
    out, problems = map_records(batch, one)
    if problems:
        first_index, first = problems[0]
        raise RejectBatch(
            f"{plugin}: {len(problems)} record(s) of {batch.topic}[{batch.partition}] "
            f"{refused}; first, record {first_index}: {first}",
            error, problems,
        )
    if all(a is b for a, b in zip(out, batch.records, strict=True)):
        return batch
    return batch.with_records(out)
