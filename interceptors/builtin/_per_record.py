"""The per-record loop the header middleware share: map each record, collect problems."""

from __future__ import annotations

from collections.abc import Callable

from kiproxy.interceptors.api import Record, RecordBatch

__all__ = ["MAX_REPORTED", "map_records"]

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
