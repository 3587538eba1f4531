"""The ``record_encryption`` interceptor's settings: which KMS, which key per topic, the policies.

Contract. :class:`RecordEncryptionSettings` is the interceptor's typed settings model
(the loader validates ``config:`` with it; every problem names its key, and
``docs/builtin-settings.md`` is generated from it). :meth:`TopicPlans.of` resolves it
into what the hooks read per topic, a :class:`TopicPlan`: the KEK reference its records
are encrypted under (None: not encrypted) and what a record that does not decrypt
becomes.

Which topic is encrypted, and under which key:

* ``key`` is a template: ``${topic}`` (or ``$topic``) is the topic's name
  (``alias/KEK_${topic}`` gives ``alias/KEK_orders``); ``${topic_alias}`` is the name
  with each character an AWS alias cannot hold (a topic's ``.``) as ``_``
  (``alias/KEK_${topic_alias}`` gives ``alias/KEK_logs_app`` for ``logs.app``; Apache
  Kafka refuses a topic whose name collides with another's that way); ``$$`` is a
  literal ``$``.
* Without ``topics:`` every topic the route hands the interceptor is encrypted under
  ``key``. With ``topics:``, only the topics an entry matches are: an entry is a topic
  name, or a regular expression matched against the whole name; names are tried first,
  then expressions in the order written (as ``schema_registry`` does); an entry may
  give its own ``key`` template, ``encrypt: false`` or its own ``on_undecryptable``.
* :meth:`TopicPlans.fixed_references` lists the references of the templates without a
  placeholder (one key for every topic they serve), which the built-in has its KMS
  check at load; :meth:`TopicPlans.sample_references` gives each other template's
  reference for a plain topic name, whose form (an AWS alias name) is checked too.
* Decryption does not depend on this: any record carrying the marker header is
  opened, on any topic the route hands the fetch-side hook.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from kiproxy.interceptors.settings import PluginSettings
from kiproxy.interceptors.topics import TopicPattern, TopicSelector

from .aws_kms import AwsKmsSettings, alias_safe
from .data_keys import DataKeyPolicy
from .envelope import MARKER_HEADER

__all__ = ["KmsSettings", "RecordEncryptionSettings", "TopicEncryption", "TopicPlan",
           "TopicPlans", "key_template"]

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]+")
_PLACEHOLDERS = frozenset({"topic", "topic_alias"})
_AWS_ONLY = frozenset(AwsKmsSettings.model_fields)
_PLANS_CACHED = 10_000

Undecryptable = Literal["error", "pass"]


def key_template(value: str) -> str:
    """``value`` if it is a key template whose placeholders are ``${topic}`` and
    ``${topic_alias}``."""
    template = string.Template(value)
    if not template.is_valid():
        raise ValueError(f"{value!r} is not a key template: write ${{topic}} for the topic's "
                         "name, ${topic_alias} for it as an AWS alias may hold it, and $$ "
                         "for a literal $")
    unknown = set(template.get_identifiers()) - _PLACEHOLDERS
    if unknown:
        raise ValueError(f"{value!r} names {sorted(unknown)}; the placeholders are "
                         "${topic} and ${topic_alias}")
    if not value.strip():
        raise ValueError("an empty key names no KEK")
    return value


KeyTemplate = Annotated[str, AfterValidator(key_template)]


class KmsSettings(AwsKmsSettings):
    """Where the key-encryption keys (KEKs) are: ``type: aws`` (the AWS KMS API; its keys
    below) or ``type: key_file`` (a local file, for development; ``path``)."""

    type: Literal["aws", "key_file"]
    """``aws``: the AWS KMS API (AWS, LocalStack, moto), credentials read as AWS SDKs
    read them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, roles).
    ``key_file``: KEKs in a local JSON or YAML file."""
    path: str | None = None
    """With ``type: key_file``: the key file."""

    @model_validator(mode="after")
    def _keys_of_its_type(self) -> KmsSettings:
        if self.type == "key_file":
            if self.path is None:
                raise ValueError("type key_file needs `path:`, the key file")
            stray = sorted(self.model_fields_set & _AWS_ONLY)
            if stray:
                raise ValueError(f"{', '.join(stray)}: only for type aws")
        elif self.path is not None:
            raise ValueError("path: only for type key_file")
        return self


def _names_as_table(raw: Any) -> Any:
    """``topics: [orders, payments]`` is short for ``{orders: {}, payments: {}}``."""
    if isinstance(raw, list):
        return {str(name): {} for name in raw}
    return raw


def _regexes(table: dict[str, TopicEncryption]) -> dict[str, TopicEncryption]:
    for entry in table:
        TopicPattern(entry)  # a ValueError naming the expression that does not compile
    return table


def _sealable(names: list[str]) -> list[str]:
    if MARKER_HEADER in names:
        raise ValueError(f"{MARKER_HEADER} is the marker header; it is not sealed")
    if len(set(names)) != len(names):
        raise ValueError("a header is named twice")
    return names


class TopicEncryption(PluginSettings):
    """How one entry of ``topics:`` is encrypted."""

    key: KeyTemplate | None = None
    """This entry's KEK template (default: the top-level ``key``)."""
    encrypt: bool = True
    """False: records produced to these topics are stored as they come (records that
    carry the marker header are still decrypted)."""
    on_undecryptable: Undecryptable | None = None
    """This entry's policy for a record that does not decrypt (default: the top-level
    ``on_undecryptable``)."""


class RecordEncryptionSettings(PluginSettings):
    """Settings of ``record_encryption`` (docs/record-encryption.md)."""

    kms: KmsSettings
    """The KMS that holds the KEKs and makes data keys."""
    key: KeyTemplate
    """The KEK of a topic, a template: ``${topic}`` is the topic's name
    (``alias/KEK_${topic}``; a key id, an ARN or a key file's key name);
    ``${topic_alias}`` is the name with each ``.`` as ``_``, for AWS aliases, which
    cannot hold a ``.``."""
    topics: Annotated[dict[str, TopicEncryption], BeforeValidator(_names_as_table),
                      AfterValidator(_regexes)] = {}
    """Which topics are encrypted: topic names or regular expressions matching the whole
    name (a list, or a mapping to per-topic settings). Empty: every topic the route
    hands the interceptor."""
    headers: Annotated[list[str], AfterValidator(_sealable)] = []
    """Header names whose values are encrypted too (all occurrences); other headers,
    keys and timestamps stay readable."""
    unresolved_key: Literal["pass", "reject"] = "pass"
    """A topic whose KEK the KMS does not know (or that is disabled): ``pass`` stores its
    records UNENCRYPTED, in clear (counted, logged once a minute per topic); ``reject``
    refuses them with POLICY_VIOLATION (for production, where nothing may be stored in
    clear)."""
    on_kms_unavailable: Literal["reject", "pass"] = "reject"
    """The KMS cannot be used to encrypt (unreachable, throttling, timed out, refused
    credentials): ``reject`` refuses the batch with REQUEST_TIMED_OUT, which producers
    retry, and nothing is stored; ``pass`` stores it unencrypted (counted, logged)."""
    on_undecryptable: Undecryptable = "error"
    """A record that carries the marker header and does not decrypt (damaged, or its
    data key does not unwrap): ``error`` answers the partition with an error the
    consumer retries; ``pass`` hands the consumer the ciphertext record as stored."""
    data_keys: DataKeyPolicy = Field(default_factory=DataKeyPolicy)
    """How long a data key is used (rotation) and how unwrapped keys are cached."""


@dataclass(frozen=True, slots=True)
class TopicPlan:
    """What the hooks do with one topic."""

    reference: str | None
    """The KEK reference its records are encrypted under; None: not encrypted."""
    on_undecryptable: Undecryptable
    """What a record that does not decrypt becomes."""


class TopicPlans:
    """Each topic's :class:`TopicPlan`, from the settings (cached per topic)."""

    def __init__(self, settings: RecordEncryptionSettings) -> None:
        self.settings = settings
        every = TopicEncryption()
        names = [(TopicPattern.name(t), e) for t, e in settings.topics.items()
                 if _TOPIC_NAME.fullmatch(t)]
        regexes = [(TopicPattern(t), e) for t, e in settings.topics.items()
                   if not _TOPIC_NAME.fullmatch(t)]
        self._entries: TopicSelector[TopicEncryption] = TopicSelector(
            names + regexes, default=None if settings.topics else every)
        self._plans: dict[str, TopicPlan] = {}

    @classmethod
    def of(cls, settings: RecordEncryptionSettings) -> TopicPlans:
        """The plans of ``settings``."""
        return cls(settings)

    def plan(self, topic: str) -> TopicPlan:
        """The plan of ``topic``."""
        found = self._plans.get(topic)
        if found is not None:
            return found
        entry = self._entries.select(topic)
        undecryptable = (entry.on_undecryptable if entry is not None
                         and entry.on_undecryptable is not None
                         else self.settings.on_undecryptable)
        reference = None
        if entry is not None and entry.encrypt:
            template = string.Template(entry.key or self.settings.key)
            reference = template.substitute(topic=topic, topic_alias=alias_safe(topic))
        if len(self._plans) >= _PLANS_CACHED:
            self._plans.clear()
        plan = self._plans[topic] = TopicPlan(reference, undecryptable)
        return plan

    def fixed_references(self) -> list[tuple[str, str]]:
        """The KEK references of the key templates in use that have no placeholder (the
        same key for every topic), each with the setting that gives it."""
        return [(where, string.Template(template).substitute())
                for where, template in self._templates() if _fixed(template)]

    def sample_references(self) -> list[tuple[str, str, str]]:
        """The key templates in use that have a placeholder, each with the setting that
        gives it and the reference it gives a topic whose name an AWS alias may hold
        (``t``): a form the KMS refuses for that one it refuses for every topic."""
        return [(where, template, string.Template(template).substitute(topic="t",
                                                                       topic_alias="t"))
                for where, template in self._templates() if not _fixed(template)]

    def _templates(self) -> list[tuple[str, str]]:
        """Each key template in use once, with the first setting that gives it."""
        settings = self.settings
        found: dict[str, str] = {}
        entries = settings.topics.items() if settings.topics else [("", TopicEncryption())]
        for entry_name, entry in entries:
            if entry.encrypt:
                found.setdefault(entry.key or settings.key,
                                 f"topics.{entry_name}.key" if entry.key else "key")
        return [(where, template) for template, where in found.items()]


def _fixed(template: str) -> bool:
    """Whether the key ``template`` names the same key for every topic."""
    return not string.Template(template).get_identifiers()
