"""Which topic: the one way a topic name is matched, by routes and by plugins alike.

Contract. A :class:`TopicPattern` is a regular expression that must match the
whole topic name (``orders|payments``, ``logs\\..*``), as a route's ``match.topic``
is. A :class:`TopicSelector` is an ordered table of patterns and values: the
first pattern that matches a topic gives its value, else the default; the
answer is cached per topic, so a batch costs a dict lookup. A table keyed by
exact topic names with ``"*"`` for any other topic (the ``topics:`` of
``pii_masker``, the ``tokens:`` of ``header_token_authorizer``) is
:meth:`TopicSelector.of_names`. The proxy's route table matches ``match.topic``
with the same :class:`TopicPattern`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["TopicPattern", "TopicSelector", "topic_regex"]

T = TypeVar("T")

_CACHE_LIMIT = 10_000


def topic_regex(value: str) -> str:
    """``value`` if it is a regular expression, else ``ValueError`` saying why not."""
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
    return value


class TopicPattern:
    """A regular expression matched against the whole topic name."""

    __slots__ = ("pattern", "regex")

    def __init__(self, regex: str) -> None:
        self.regex = topic_regex(regex)
        """The expression as configured."""
        self.pattern = re.compile(regex)

    @classmethod
    def name(cls, topic: str) -> TopicPattern:
        """The pattern that matches exactly ``topic``."""
        return cls(re.escape(topic))

    def holds(self, topic: str) -> bool:
        """Whether the pattern matches the whole of ``topic``."""
        return self.pattern.fullmatch(topic) is not None

    def __repr__(self) -> str:
        return f"TopicPattern({self.regex!r})"


class TopicSelector(Generic[T]):
    """An ordered table of topic patterns and values; see the module docstring."""

    __slots__ = ("_chosen", "default", "entries")

    def __init__(self, entries: Iterable[tuple[TopicPattern | str, T]],
                 default: T | None = None) -> None:
        self.entries: tuple[tuple[TopicPattern, T], ...] = tuple(
            (p if isinstance(p, TopicPattern) else TopicPattern(p), value)
            for p, value in entries)
        """``(pattern, value)`` in the order they are tried."""
        self.default = default
        """The value of a topic no pattern matches (None: no value)."""
        self._chosen: dict[str, T | None] = {}

    @classmethod
    def of_names(cls, table: Mapping[str, T], wildcard: str = "*") -> TopicSelector[T]:
        """Exact topic names -> values; the ``wildcard`` entry is the default."""
        return cls(((TopicPattern.name(topic), value) for topic, value in table.items()
                    if topic != wildcard), table.get(wildcard))

    def select(self, topic: str) -> T | None:
        """The value of the first pattern that matches ``topic``, else the default."""
        try:
            return self._chosen[topic]
        except KeyError:
            pass
        chosen = next((value for pattern, value in self.entries if pattern.holds(topic)),
                      self.default)
        if len(self._chosen) >= _CACHE_LIMIT:
            self._chosen.clear()
        self._chosen[topic] = chosen
        return chosen

    def __iter__(self) -> Iterator[tuple[TopicPattern, T]]:
        """The ``(pattern, value)`` entries in order (the default is not one)."""
        return iter(self.entries)
