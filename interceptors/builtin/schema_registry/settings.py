"""The ``schema_registry`` interceptor's settings: what to check, per topic, for keys and values.

Contract: :func:`parse_settings` reads the interceptor's ``config`` mapping
(everything but ``registry:``, which the registry client's settings read) into
a frozen :class:`Settings`, or raises ``ValueError`` naming the key at fault
(``topics.orders.value.check: ...``). :meth:`Settings.policy_for` gives a
topic's :class:`TopicPolicy`: its exact entry first, then the first regular
expression (matched against the whole name) in configured order; a topic no
entry matches is not checked.

Check levels, each including the ones before it: ``none`` (nothing; with
rules, the value is read as plain JSON), ``id`` (the record is framed and its
id is registered), ``subject`` (the id is registered under the subject the
naming strategy gives), ``payload`` (the payload decodes with the id's schema).
A side may read its id from a header instead of the frame (:class:`HeaderId`:
the header's name, the number's encoding, and whether it is an id of the
registry's Confluent-compatible API or an Apicurio globalId). A record a side
allows without an id (``allow_unframed``) is not looked up; with rules, its
value is read as plain JSON, as at level ``none``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kiproxy.interceptors.builtin.schema_registry.rules import Rules, compile_rules
from kiproxy.interceptors.builtin.schema_registry.wire import HEADER_ENCODINGS, HeaderEncoding
from kiproxy.interceptors.errors import error_code

__all__ = ["HEADER_ID_KINDS", "LEVELS", "STRATEGIES", "HeaderId", "HeaderIdKind", "Level",
           "Settings", "SideCheck", "Strategy", "TopicPolicy", "parse_settings"]

Level = Literal["none", "id", "subject", "payload"]
LEVELS: tuple[Level, ...] = ("none", "id", "subject", "payload")
Strategy = Literal["TopicName", "RecordName", "TopicRecordName"]
STRATEGIES: tuple[Strategy, ...] = ("TopicName", "RecordName", "TopicRecordName")
HeaderIdKind = Literal["registry", "global_id"]
HEADER_ID_KINDS: tuple[HeaderIdKind, ...] = ("registry", "global_id")
_CCOMPAT_URL = re.compile(r"https?://.+/apis/ccompat/v[0-9]+/?")

_TOP_KEYS = {"registry", "topics", "on_registry_unavailable", "error", "compiled_cache_size",
             "lookup_ttl_s"}
_TOPIC_KEYS = {"key", "value", "rules", "subject_strategy", "allow_unframed",
               "require_latest", "tombstones"}
_SIDE_KEYS = {"check", "subject_strategy", "allow_unframed", "require_latest", "header"}


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderId:
    """Where a header-carried schema id is read from."""

    name: str
    """The header name (``apicurio.value.globalId``)."""
    encoding: HeaderEncoding = "long"
    """``long`` (8-byte big-endian, as Apicurio serdes write), ``int`` (4-byte) or ``string``."""
    id: HeaderIdKind = "registry"
    """What the number is: ``registry``, an id of the registry's Confluent-compatible API
    (Confluent's ids; on Apicurio 2.x its contentIds, or its globalIds in legacy id mode),
    looked up as it is; ``global_id``, an Apicurio globalId (what Apicurio serdes write by
    default), translated through Apicurio's native API (``/apis/registry/v2``) to the
    artifact version it names. Defaults to ``global_id`` for a header named ``*.globalId``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SideCheck:
    """What is checked of one side (key or value) of a topic's records."""

    side: Literal["key", "value"]
    level: Level = "none"
    strategy: Strategy = "TopicName"
    allow_unframed: bool = False
    """Records without a schema id pass (unchecked) instead of being refused."""
    require_latest: bool = False
    """The id must be the subject's latest version."""
    header: HeaderId | None = None
    """Read the id from this header; the payload is then not framed."""

    def subject(self, topic: str, record_name: str | None) -> str:
        """The subject this side's strategy names."""
        if self.strategy == "TopicName":
            return f"{topic}-{self.side}"
        if self.strategy == "RecordName":
            return str(record_name)
        return f"{topic}-{record_name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicPolicy:
    """One ``topics:`` entry."""

    pattern: str
    key: SideCheck
    value: SideCheck
    rules: Rules
    tombstones: Literal["pass", "reject"] = "pass"

    @property
    def fast_ids(self) -> bool:
        """Only the values' frames matter (id or subject level, Confluent framing, no
        unframed values allowed, no key check, no rules, tombstones pass)."""
        return (self.key.level == "none" and self.value.level in ("id", "subject")
                and self.value.header is None and not self.value.allow_unframed
                and not self.rules and self.tombstones == "pass")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything of the interceptor's config but the registry connection."""

    exact: Mapping[str, TopicPolicy]
    patterns: tuple[tuple[re.Pattern[str], TopicPolicy], ...]
    on_registry_unavailable: Literal["reject", "pass"] = "reject"
    error: str = "INVALID_RECORD"
    compiled_cache_size: int = 1000
    lookup_ttl_s: float = 30.0
    needs_registry: bool = False
    global_ids: bool = False
    """Some side reads Apicurio globalIds (``header.id: global_id``)."""
    _cache: dict[str, TopicPolicy | None] = field(default_factory=dict, compare=False)

    def policy_for(self, topic: str) -> TopicPolicy | None:
        """The topic's policy, or None when no entry matches it."""
        try:
            return self._cache[topic]
        except KeyError:
            pass
        policy = self.exact.get(topic)
        if policy is None:
            policy = next((p for rx, p in self.patterns if rx.fullmatch(topic)), None)
        if len(self._cache) < 100_000:  # topics are few; a bound against a hostile client
            self._cache[topic] = policy
        return policy


def _unknown(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(map(str, raw)) - allowed
    if unknown:
        at = f"{where}: " if where else ""
        raise ValueError(f"{at}unknown key(s) {', '.join(sorted(unknown))}; "
                         f"expected {', '.join(sorted(allowed))}")


def _bool(raw: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _choice(value: Any, choices: tuple[str, ...], where: str) -> Any:
    if value not in choices:
        raise ValueError(f"{where}: expected one of {' | '.join(choices)}, got {value!r}")
    return value


def _side(raw: Any, side: Literal["key", "value"], topic: Mapping[str, Any],
          where: str) -> SideCheck:
    at = f"{where}.{side}"
    if raw is None:
        raw = {}
    elif isinstance(raw, str):
        raw = {"check": raw}
    elif not isinstance(raw, Mapping):
        raise ValueError(f"{at}: expected a check level ({' | '.join(LEVELS)}) or a mapping")
    _unknown(raw, _SIDE_KEYS, at)
    header = raw.get("header")
    header_id: HeaderId | None = None
    if header is not None:
        if isinstance(header, str):
            header = {"name": header}
        if not isinstance(header, Mapping) or not isinstance(header.get("name"), str):
            raise ValueError(f"{at}.header: expected a header name or {{name, encoding, id}}")
        _unknown(header, {"name", "encoding", "id"}, f"{at}.header")
        name = header["name"]
        kind = header.get("id", "global_id" if name.endswith(".globalId") else "registry")
        header_id = HeaderId(name=name, encoding=_choice(
            header.get("encoding", "long"), HEADER_ENCODINGS, f"{at}.header.encoding"),
            id=_choice(kind, HEADER_ID_KINDS, f"{at}.header.id"))
    return SideCheck(
        side=side,
        level=_choice(raw.get("check", "none"), LEVELS, f"{at}.check"),
        strategy=_choice(raw.get("subject_strategy", topic.get("subject_strategy", "TopicName")),
                         STRATEGIES, f"{at}.subject_strategy"),
        allow_unframed=_bool(raw, "allow_unframed",
                             _bool(topic, "allow_unframed", False, where), at),
        require_latest=_bool(raw, "require_latest",
                             _bool(topic, "require_latest", False, where), at),
        header=header_id,
    )


def _topic(name: str, raw: Any) -> TopicPolicy:
    where = f"topics.{name}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping with key, value and rules")
    _unknown(raw, _TOPIC_KEYS, where)
    key = _side(raw.get("key"), "key", raw, where)
    value = _side(raw.get("value"), "value", raw, where)
    rules = compile_rules(raw.get("rules"), f"{where}.rules")
    if rules and value.level in ("id", "subject"):
        raise ValueError(f"{where}.rules: rules read the decoded value, so value must be "
                         f"payload (or none, for plain JSON values), not {value.level}")
    tombstones = _choice(raw.get("tombstones", "pass"), ("pass", "reject"),
                         f"{where}.tombstones")
    return TopicPolicy(pattern=name, key=key, value=value, rules=rules, tombstones=tombstones)


def parse_settings(config: Mapping[str, Any]) -> Settings:
    """Read and check the interceptor's config (but ``registry:``)."""
    _unknown(config, _TOP_KEYS, "")
    topics = config.get("topics")
    if not isinstance(topics, Mapping) or not topics:
        raise ValueError("topics: expected a mapping of topic name (or regular expression) "
                         "to what to check, e.g. {orders: {value: payload}}")
    exact: dict[str, TopicPolicy] = {}
    patterns: list[tuple[re.Pattern[str], TopicPolicy]] = []
    for name, raw in topics.items():
        name = str(name)
        policy = _topic(name, raw)
        if re.fullmatch(r"[A-Za-z0-9._-]+", name):  # a legal topic name is taken literally
            exact[name] = policy
            continue
        try:
            patterns.append((re.compile(name), policy))
        except re.error as exc:
            raise ValueError(f"topics.{name}: not a topic name nor a regular expression: "
                             f"{exc}") from None
    error = str(config.get("error", "INVALID_RECORD"))
    try:
        error_code(error)
    except ValueError as exc:
        raise ValueError(f"error: {exc}") from None
    size = config.get("compiled_cache_size", 1000)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"compiled_cache_size: expected a positive integer, got {size!r}")
    ttl = config.get("lookup_ttl_s", 30.0)
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl < 0:
        raise ValueError(f"lookup_ttl_s: expected seconds (a number >= 0), got {ttl!r}")
    policies = [*exact.values(), *(p for _, p in patterns)]
    needs = any(p.key.level != "none" or p.value.level != "none" for p in policies)
    if needs and config.get("registry") is None:
        raise ValueError("registry: a check level above none needs the registry, e.g. "
                         "registry: {url: http://127.0.0.1:8081/apis/ccompat/v7}")
    global_ids = any(s.level != "none" and s.header is not None and s.header.id == "global_id"
                     for p in policies for s in (p.key, p.value))
    registry = config.get("registry")
    url = registry.get("url") if isinstance(registry, Mapping) else None
    if global_ids and isinstance(url, str) and not _CCOMPAT_URL.fullmatch(url):
        raise ValueError(
            f"registry.url: {url!r} is not an Apicurio Registry's Confluent-compatible API "
            "(http://HOST:PORT/apis/ccompat/v7), which a header with id: global_id needs (its "
            "globalIds are looked up through the native API beside it); against another "
            "registry, give the header id: registry")
    return Settings(
        exact=exact, patterns=tuple(patterns),
        on_registry_unavailable=_choice(config.get("on_registry_unavailable", "reject"),
                                        ("reject", "pass"), "on_registry_unavailable"),
        error=error, compiled_cache_size=size, lookup_ttl_s=float(ttl), needs_registry=needs,
        global_ids=global_ids,
    )
