"""The ``schema_registry`` interceptor's settings: what to check, per topic, for keys and values.

Contract: :class:`SchemaRegistrySettings` is the interceptor's typed settings
model (``registry:`` is :class:`~.registry_config.RegistrySettings`): the loader
validates the ``config`` mapping with it, every problem naming its key
(``topics.orders.value.check: ...``). :meth:`Settings.of` resolves the model into
what the checks read: each topic's :class:`TopicPolicy` (a side's unset keys taken
from its topic, its rules compiled) in a
:class:`~kiproxy.interceptors.TopicSelector`, where :meth:`Settings.policy_for`
finds it: the entries that are legal topic names first, taken literally, then the
others as regular expressions (matched against the whole name) in configured
order; a topic no entry matches is not checked. :func:`parse_settings` is both
steps for a config mapping.

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
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings
from kiproxy.interceptors.builtin.schema_registry.rules import (
    Rules,
    RuleSettings,
    compile_rules,
    unique_names,
)
from kiproxy.interceptors.builtin.schema_registry.wire import HeaderEncoding
from kiproxy.interceptors.settings import ErrorName, PluginSettings
from kiproxy.interceptors.settings import parse_settings as parse_model
from kiproxy.interceptors.topics import TopicPattern, TopicSelector

__all__ = ["LEVELS", "HeaderId", "HeaderIdKind", "Level", "SchemaRegistrySettings", "Settings",
           "SideCheck", "SideSettings", "Strategy", "TopicPolicy", "TopicSettings",
           "parse_settings"]

Level = Literal["none", "id", "subject", "payload"]
LEVELS: tuple[Level, ...] = ("none", "id", "subject", "payload")
Strategy = Literal["TopicName", "RecordName", "TopicRecordName"]
HeaderIdKind = Literal["registry", "global_id"]
_CCOMPAT_URL = re.compile(r"https?://.+/apis/ccompat/v[0-9]+/?")
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _header(raw: Any) -> Any:
    """A header name as ``{name}``; ``id`` defaults to ``global_id`` for ``*.globalId``."""
    if isinstance(raw, str):
        raw = {"name": raw}
    if isinstance(raw, Mapping) and "id" not in raw and isinstance(raw.get("name"), str) \
            and raw["name"].endswith(".globalId"):
        raw = {**raw, "id": "global_id"}
    return raw


class HeaderId(PluginSettings):
    """Where a header-carried schema id is read from: a header name, or these keys."""

    name: str
    """The header name (``apicurio.value.globalId``)."""
    encoding: HeaderEncoding = "long"
    """``long`` (8-byte big-endian, as Apicurio serdes write), ``int`` (4-byte) or ``string``
    (decimal)."""
    id: HeaderIdKind = "registry"
    """What the number is: ``registry``, an id of the registry's Confluent-compatible API
    (Confluent's ids; on Apicurio 2.x its contentIds, or its globalIds in legacy id mode),
    looked up as it is; ``global_id``, an Apicurio globalId (what Apicurio serdes write by
    default), translated through Apicurio's native API (``/apis/registry/v2``) to the
    artifact version it names. Defaults to ``global_id`` for a header named ``*.globalId``."""


def _side(raw: Any) -> Any:
    """A check level alone as ``{check: LEVEL}``; nothing as ``{}``."""
    if raw is None:
        return {}
    return {"check": raw} if isinstance(raw, str) else raw


class SideSettings(PluginSettings):
    """What is checked of one side (key or value): a check level, or these keys."""

    check: Level = "none"
    """``none`` (not checked), ``id`` (framed, id registered), ``subject`` (and registered
    under the strategy's subject), ``payload`` (and the payload decodes with that schema)."""
    subject_strategy: Strategy | None = None
    """``TopicName`` (``<topic>-value`` / ``<topic>-key``), ``RecordName`` (the record's full
    name), ``TopicRecordName`` (``<topic>-<record name>``); unset: the topic's."""
    allow_unframed: bool | None = None
    """Records without a schema id pass (unchecked) instead of being refused; unset: the
    topic's."""
    require_latest: bool | None = None
    """The id must be the subject's latest version; unset: the topic's."""
    header: Annotated[HeaderId | None, BeforeValidator(_header)] = None
    """Read the id from this record header (a name, or ``{name, encoding, id}``) instead of
    the frame; the payload is then not framed."""


Side = Annotated[SideSettings, BeforeValidator(_side)]


class TopicSettings(PluginSettings):
    """What to check on a topic (or on the topics a regular expression matches)."""

    key: Side = SideSettings()
    """The key's check: a level (``none``, ``id``, ``subject``, ``payload``) or a mapping."""
    value: Side = SideSettings()
    """The value's check: a level (``none``, ``id``, ``subject``, ``payload``) or a
    mapping."""
    rules: Annotated[list[RuleSettings], AfterValidator(unique_names)] = Field(
        default_factory=list)
    """Named CEL rules over the decoded record, ``{name, expr, message}``."""
    subject_strategy: Strategy = "TopicName"
    """The subject naming strategy of both sides (each may set its own)."""
    allow_unframed: bool = False
    """Records without a schema id pass instead of being refused (not looked up; the rules
    read such a value as plain JSON); both sides (each may set its own)."""
    require_latest: bool = False
    """The id must be the subject's latest version; both sides (each may set its own)."""
    tombstones: Literal["pass", "reject"] = "pass"
    """``reject`` refuses null values on the topic."""

    @model_validator(mode="after")
    def _rules_read_payloads(self) -> TopicSettings:
        if self.rules and self.value.check in ("id", "subject"):
            raise ValueError(f"rules read the decoded value, so value must be payload (or "
                             f"none, for plain JSON values), not {self.value.check}")
        return self


class SchemaRegistrySettings(PluginSettings):
    """Settings of ``schema_registry``."""

    registry: RegistrySettings | None = None
    """The registry connection (URL, credentials, TLS, cache sizes and lifetimes); needed
    when any topic checks above ``none``."""
    topics: dict[str, TopicSettings]
    """Topic name, or a regular expression matching the whole name -> what to check. An
    exact name wins, then the first expression (in order); topics no entry matches pass
    unchecked."""
    on_registry_unavailable: Literal["reject", "pass"] = "reject"
    """What happens to a record whose id the registry cannot be asked about."""
    error: ErrorName = "INVALID_RECORD"
    """The error code of a refused batch."""
    compiled_cache_size: int = Field(default=1000, ge=1, strict=True)
    """Compiled schemas kept (by id, least recently used dropped)."""
    lookup_ttl_s: float = Field(default=30.0, ge=0, strict=True)
    """How long an id's subjects and a subject's latest id are trusted, in seconds."""

    @field_validator("topics")
    @classmethod
    def _names_or_patterns(cls, topics: dict[str, TopicSettings]) -> dict[str, TopicSettings]:
        if not topics:
            raise ValueError("expected at least one topic name (or regular expression) and "
                             "what to check, e.g. {orders: {value: payload}}")
        for name in topics:
            if not _TOPIC_NAME.fullmatch(name):
                try:
                    TopicPattern(name)
                except ValueError as exc:
                    raise ValueError(f"{name!r} is neither a topic name nor a regular "
                                     f"expression: {str(exc).split(': ', 1)[-1]}") from None
        return topics

    @model_validator(mode="after")
    def _registry_when_needed(self) -> SchemaRegistrySettings:
        sides = [s for t in self.topics.values() for s in (t.key, t.value)]
        if self.registry is None and any(s.check != "none" for s in sides):
            raise ValueError("registry: a check level above none needs the registry, e.g. "
                             "registry: {url: http://127.0.0.1:8081/apis/ccompat/v7}")
        url = self.registry.url if self.registry is not None else ""
        if _global_ids(sides) and not _CCOMPAT_URL.fullmatch(url):
            raise ValueError(
                f"registry.url: {url!r} is not an Apicurio Registry's Confluent-compatible API "
                "(http://HOST:PORT/apis/ccompat/v7), which a header with id: global_id needs "
                "(its globalIds are looked up through the native API beside it); against "
                "another registry, give the header id: registry")
        return self


def _global_ids(sides: list[SideSettings]) -> bool:
    return any(s.check != "none" and s.header is not None and s.header.id == "global_id"
               for s in sides)


@dataclass(frozen=True, slots=True, kw_only=True)
class SideCheck:
    """What is checked of one side (key or value) of a topic's records, resolved."""

    side: Literal["key", "value"]
    level: Level = "none"
    strategy: Strategy = "TopicName"
    allow_unframed: bool = False
    """Records without a schema id pass (unchecked) instead of being refused."""
    require_latest: bool = False
    """The id must be the subject's latest version."""
    header: HeaderId | None = None
    """Read the id from this header; the payload is then not framed."""

    @classmethod
    def of(cls, side: Literal["key", "value"], settings: SideSettings,
           topic: TopicSettings) -> SideCheck:
        """The side's settings, a key it leaves unset taken from its topic's."""
        def either(mine: Any, topics: Any) -> Any:
            return topics if mine is None else mine

        return cls(side=side, level=settings.check,
                   strategy=either(settings.subject_strategy, topic.subject_strategy),
                   allow_unframed=either(settings.allow_unframed, topic.allow_unframed),
                   require_latest=either(settings.require_latest, topic.require_latest),
                   header=settings.header)

    def subject(self, topic: str, record_name: str | None) -> str:
        """The subject this side's strategy names."""
        if self.strategy == "TopicName":
            return f"{topic}-{self.side}"
        if self.strategy == "RecordName":
            return str(record_name)
        return f"{topic}-{record_name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TopicPolicy:
    """One ``topics:`` entry, resolved."""

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
    """What the checks read of the settings: the policies by topic, and the rest."""

    policies: TopicSelector[TopicPolicy]
    on_registry_unavailable: Literal["reject", "pass"] = "reject"
    error: str = "INVALID_RECORD"
    compiled_cache_size: int = 1000
    lookup_ttl_s: float = 30.0
    needs_registry: bool = False
    global_ids: bool = False
    """Some side reads Apicurio globalIds (``header.id: global_id``)."""

    @classmethod
    def of(cls, settings: SchemaRegistrySettings) -> Settings:
        """The validated settings resolved: sides completed, rules compiled, topics ordered."""
        policies = {name: TopicPolicy(pattern=name, key=SideCheck.of("key", t.key, t),
                                      value=SideCheck.of("value", t.value, t),
                                      rules=compile_rules(t.rules), tombstones=t.tombstones)
                    for name, t in settings.topics.items()}
        exact = [(TopicPattern.name(n), p) for n, p in policies.items() if _TOPIC_NAME.fullmatch(n)]
        regexes = [(TopicPattern(n), p) for n, p in policies.items()
                   if not _TOPIC_NAME.fullmatch(n)]
        sides = [s for t in settings.topics.values() for s in (t.key, t.value)]
        return cls(policies=TopicSelector([*exact, *regexes]),
                   on_registry_unavailable=settings.on_registry_unavailable,
                   error=settings.error, compiled_cache_size=settings.compiled_cache_size,
                   lookup_ttl_s=settings.lookup_ttl_s,
                   needs_registry=any(s.check != "none" for s in sides),
                   global_ids=_global_ids(sides))

    def policy_for(self, topic: str) -> TopicPolicy | None:
        """The topic's policy, or None when no entry matches it."""
        return self.policies.select(topic)


def parse_settings(config: Mapping[str, Any] | SchemaRegistrySettings) -> Settings:
    """The interceptor's config validated and resolved (``SettingsError`` names the keys)."""
    return Settings.of(parse_model(SchemaRegistrySettings, config))
