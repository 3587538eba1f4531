from typing import Any

MAX_DEPTH: int
MAX_EMPTY_ITEMS: int

class AvroCheckError(ValueError):
    """A payload that is not one datum of the schema: ``path`` (field names) and ``problem``."""

    problem: str
    path: tuple[str, ...]
    expected: str | None
    left_over: int
    def __init__(self, problem: str, path: tuple[str, ...] = (),
                 expected: str | None = None, left_over: int = 0) -> None: ...

class Node:
    """One schema node: kind, size, children and, for a record, its field names."""

    def __init__(self, kind: str, desc: str) -> None: ...
    def set(self, children: tuple[Node, ...] = (), names: tuple[str, ...] = (),
            size: int = 0, zero: bool = False) -> None: ...

class Checker:
    """A schema's root node, ready to check payloads."""

    def __init__(self, root: Node) -> None: ...
    def check(self, data: bytes | bytearray | memoryview, start: int = 0) -> None: ...
    def check_run(self, records: tuple[Any, ...], begin: int, frame: bytes) -> int: ...
