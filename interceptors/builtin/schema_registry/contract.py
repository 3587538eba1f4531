"""The contract check of one batch: framing, id, subject, payload and rules, record by record.

Contract: :meth:`ContractCheck.check` returns None when every record of the
batch keeps its topic's contract, or a :class:`Refusal` - the error code, the
batch message and one ``(index, text)`` per bad record - which the interceptor
raises as ``RejectBatch``. It never raises for what a record holds.

How a batch is checked, so that a cache miss delays only the batch that needs it:

1. Every record's schema id is read (framing or header), with no I/O.
2. Ids not in the compiled-schema cache are looked up and compiled, all at
   once (``asyncio.gather``); a batch whose ids are all cached awaits nothing.
3. Each record is checked with what is known. A subject check or a latest-version
   check that needs an answer not yet known (an id's subjects, a subject's
   latest id, both trusted for ``lookup_ttl_s``) is looked up and the batch
   checked again.

A registry that cannot be reached, for an id not cached, and a schema the proxy cannot
compile (an unknown type, an unresolvable reference, a feature the compiler lacks: the
proxy's inability, not the record's fault): with ``on_registry_unavailable: reject`` the
batch is refused with REQUEST_TIMED_OUT (7), a code every Kafka client retries, so the
records are produced once the registry (or the proxy) can check them; with ``pass``
the records that need the missing answer are forwarded unchecked, counted, and logged
at most every 10 seconds. An uncompilable schema is also counted (``uncompilable``)
and logged (WARNING, the id and the compiler's message, at most every 10 seconds per
id). A record that does not match a schema the proxy did compile is refused with the
configured error (INVALID_RECORD).

What the check knows of the registry, and for how long, is :mod:`.lookups`'.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kiproxy.interceptors.api import Record, RecordBatch
from kiproxy.interceptors.builtin.schema_registry.avro import compile_avro, plain
from kiproxy.interceptors.builtin.schema_registry.formats import (
    CompiledSchema,
    GlobalIdLookup,
    PayloadError,
    SchemaCompileError,
    SchemaLookup,
    SchemaSource,
)
from kiproxy.interceptors.builtin.schema_registry.json_payload import compile_json, parse_json
from kiproxy.interceptors.builtin.schema_registry.lookups import Lookups, Missing, Unavailable
from kiproxy.interceptors.builtin.schema_registry.protobuf import compile_protobuf, to_map
from kiproxy.interceptors.builtin.schema_registry.settings import Settings, SideCheck, TopicPolicy
from kiproxy.interceptors.builtin.schema_registry.wire import (
    FramingError,
    confluent_frame,
    header_id,
    message_indexes,
)
from kiproxy.interceptors.errors import ErrorCode, error_code

__all__ = ["CHECKS", "ContractCheck", "Refusal",
           "compile_schema"]

log = logging.getLogger("kiproxy.schema_registry")

CHECKS = ("unframed", "unknown_id", "subject", "latest", "payload", "rule",
          "tombstone", "registry_unavailable", "too_many_lookups")
"""The checks a record can fail, as ``rejections{check}`` counts them."""

LOOKUPS_PER_BATCH = 64
"""Registry lookups (schema ids, subjects, latest versions not cached) one batch may start.
A batch that needs more - values not framed by a serializer, whose bytes read as many
made-up ids - has that many done and is refused with REQUEST_TIMED_OUT: its retry finds
them cached and starts the next ones. Real ids are all checked in the end, and a stream of
made-up ones costs each batch a bounded number of requests instead of filling the
registry's request slots (and the memory) that other producers wait on."""

_MAX_ERRORS = 1000
_RECHECK_S = 1.0
"""A subject missing from an id's cached subjects is asked again at most this often."""


_COMPILERS: dict[str, Callable[[SchemaSource], CompiledSchema]] = {
    "AVRO": compile_avro, "PROTOBUF": compile_protobuf, "JSON": compile_json}


def compile_schema(schema: SchemaSource) -> CompiledSchema:
    """The compiled form of a registered schema, or :class:`SchemaCompileError`."""
    kind = (schema.schema_type or "AVRO").upper()  # the registry omits schemaType for Avro
    compiler = _COMPILERS.get(kind)
    if compiler is None:
        raise SchemaCompileError(f"schema id {schema.schema_id} has type {kind!r}, "
                                 "which is none of AVRO, PROTOBUF, JSON")
    return compiler(schema)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a batch is refused."""

    code: int
    message: str
    record_errors: tuple[tuple[int, str], ...]


@dataclass(slots=True)
class _Pass:
    """One pass over a batch: what it learnt (kept across passes) and what it found."""

    looked: dict[int, Any]
    """Ids looked up for this batch: compiled, Missing or Unavailable."""
    down: dict[tuple[str, object], str]
    """Lookups the registry could not answer for this batch, with its message."""
    pending: dict[tuple[str, object], Callable[[], Awaitable[None]]]
    """The lookups this pass asks for, one per thing looked up (many records of one new
    id ask once), started by :meth:`ContractCheck._look_up`."""
    counts: collections.Counter[str]
    rules: collections.Counter[str]
    unavailable: list[str]
    looked_global: dict[int, Any] = field(default_factory=dict)
    """Apicurio globalIds looked up for this batch: the registry's id, Missing or
    Unavailable."""
    good_frames: dict[tuple[str, bytes], CompiledSchema] = field(default_factory=dict)
    """Frames (side, 5 bytes) whose id and subject checks held in this pass: the records
    that carry them only need their payload decoded."""

    def ask(self, key: tuple[str, object], lookup: Callable[[], Awaitable[None]]) -> None:
        """Ask for ``key`` once in this pass."""
        self.pending.setdefault(key, lookup)


class ContractCheck:
    """The per-batch check against one registry, with its caches."""

    def __init__(self, settings: Settings, client: SchemaLookup | None, *,
                 unknown_id: type[Exception], unavailable: type[Exception],
                 compile: Callable[[SchemaSource], CompiledSchema] = compile_schema,
                 global_ids: GlobalIdLookup | None = None, cache_ttl_s: float = 300.0,
                 negative_ttl_s: float = 5.0, compile_threads: int = 2) -> None:
        self.settings = settings
        self.client = client
        self.global_ids = global_ids
        self.lookups = Lookups(client, global_ids, unknown_id=unknown_id,
                               unavailable=unavailable, compile=compile,
                               size=settings.compiled_cache_size, cache_ttl_s=cache_ttl_s,
                               lookup_ttl_s=settings.lookup_ttl_s,
                               negative_ttl_s=negative_ttl_s, compile_threads=compile_threads)
        """What is known of the registry, each answer with its lifetime."""
        self._rechecked: dict[tuple[int, str], float] = {}
        """When an id's subjects were last asked again for a subject they lacked."""
        self.rejections: collections.Counter[str] = collections.Counter()
        self.rule_rejections: collections.Counter[str] = collections.Counter()
        self.unavailable_passed = 0
        self._last_pass_log = 0.0

    def close(self) -> None:
        """Stop the compiling threads (a compile under way finishes on its own)."""
        self.lookups.close()

    # -- the batch ---------------------------------------------------------------

    async def check(self, batch: RecordBatch) -> Refusal | None:
        """None when the batch keeps its topic's contract, else the refusal."""
        policy = self.settings.policy_for(batch.topic)
        if policy is None:
            return None
        looked: dict[int, Any] = {}
        looked_global: dict[int, Any] = {}
        ids: set[int] = set()
        # The id-only path finds its misses in its one pass (each frame is read once there).
        for side in () if policy.fast_ids else (policy.key, policy.value):
            if side.level == "none":
                continue
            read = self._ids(batch.records, side)
            if side.header is None or side.header.id == "registry":
                ids |= read
                continue
            new = sorted(gid for gid in read if self.lookups.global_id(gid) is None)
            refusal = await self._look_up(batch, [partial(self.lookups.relook_global, gid,
                                                          looked_global) for gid in new])
            if refusal is not None:
                return refusal
            for gid in read:
                mapped = self.lookups.global_id(gid) or looked_global.get(gid)
                if isinstance(mapped, int):
                    ids.add(mapped)
        missing = sorted(sid for sid in ids if self.lookups.compiled(sid) is None)
        refusal = await self._look_up(batch, [partial(self.lookups.relook, sid, looked)
                                              for sid in missing])
        if refusal is not None:
            return refusal
        down: dict[tuple[str, object], str] = {}
        for _ in range(4):
            state = _Pass(looked, down, {}, collections.Counter(), collections.Counter(), [],
                          looked_global)
            outcome = self._evaluate(batch, policy, state)
            if not state.pending:
                self.rejections.update(state.counts)
                self.rule_rejections.update(state.rules)
                return outcome
            refusal = await self._look_up(batch, list(state.pending.values()))
            if refusal is not None:
                return refusal
        self.rejections["too_many_lookups"] += 1
        return Refusal(int(ErrorCode.REQUEST_TIMED_OUT),
                       f"the registry's answers for {batch.topic}[{batch.partition}] did not "
                       "all stay cached while it was checked (registry.compiled_cache_size "
                       "is below the schemas one batch uses); the batch was not stored, retry",
                       ())

    async def _look_up(self, batch: RecordBatch,
                       lookups: Sequence[Callable[[], Awaitable[None]]]) -> Refusal | None:
        """Start ``lookups`` and wait for them; None, or the refusal of a batch that needs
        more than :data:`LOOKUPS_PER_BATCH` (the first ones run, the rest are not started)."""
        if lookups:
            await asyncio.gather(*(start() for start in lookups[:LOOKUPS_PER_BATCH]))
        if len(lookups) <= LOOKUPS_PER_BATCH:
            return None
        self.rejections["too_many_lookups"] += 1
        return Refusal(int(ErrorCode.REQUEST_TIMED_OUT),
                       f"{batch.topic}[{batch.partition}] needs {len(lookups)} schema registry "
                       f"lookups (ids, subjects or latest versions not cached); a batch starts "
                       f"at most {LOOKUPS_PER_BATCH}, the rest when it is retried (values not "
                       "framed by a schema-registry serializer read as many ids)", ())

    def _ids(self, records: Sequence[Record], side: SideCheck) -> set[int]:
        """The schema ids the records carry on ``side`` (each distinct frame read once)."""
        ids: set[int] = set()
        frames: set[bytes] = set()
        by_header = side.header is not None
        for record in records:
            data = record.key if side.side == "key" else record.value
            if data is None:
                continue
            if not by_header:
                frame = data[:5]
                if frame in frames:
                    continue
                frames.add(frame)
            with contextlib.suppress(FramingError):
                ids.add(self._frame(record, data, side)[0])
        return ids

    @staticmethod
    def _frame(record: Record, data: bytes, side: SideCheck) -> tuple[int, memoryview]:
        if side.header is not None:
            return header_id(record.headers, side.header.name, side.header.encoding), \
                memoryview(data)
        return confluent_frame(data)

    def _evaluate(self, batch: RecordBatch, policy: TopicPolicy, state: _Pass) -> Refusal | None:
        if policy.fast_ids:
            errors = self._ids_only(batch, policy, state)
        else:
            errors = self._each_record(batch, policy, state)
        return self._outcome(batch, errors, state)

    def _ids_only(self, batch: RecordBatch, policy: TopicPolicy,
                  state: _Pass) -> list[tuple[int, str]]:
        """Values checked to ``id`` or ``subject`` level and nothing else: the verdict is
        the frame's, so each distinct 5-byte frame is judged once and every other record
        costs a slice and a comparison."""
        errors: list[tuple[int, str]] = []
        judged: dict[bytes, tuple[str, str] | None] = {}
        last_good = b"-"
        for index, record in enumerate(batch.records):
            value = record.value
            if value is None:
                continue
            frame = value[:5]
            if frame == last_good:
                continue
            if frame in judged:
                verdict = judged[frame]
                if verdict is not None:
                    state.counts[verdict[1]] += 1
            else:
                before = dict(state.counts)
                problems: list[str] = []
                self._side(record, policy.value, batch.topic, state, problems)
                check = next((k for k, n in state.counts.items() if n != before.get(k, 0)),
                             "unframed")
                verdict = judged[frame] = ("; ".join(problems), check) if problems else None
            if verdict is None:
                if len(frame) == 5:  # a short value is judged whole, not by its prefix
                    last_good = frame
            elif len(errors) < _MAX_ERRORS:
                errors.append((index, f"record {index}: {verdict[0]}"))
        return errors

    def _each_record(self, batch: RecordBatch, policy: TopicPolicy,
                     state: _Pass) -> list[tuple[int, str]]:
        errors: list[tuple[int, str]] = []
        need = bool(policy.rules)  # the rules read decoded values; the checks alone do not
        # Only the value's payload to check, framed: once a frame's id and subject held,
        # the records that follow with the same frame are checked in one call (in C for
        # Avro), and the loop below sees only the others.
        runs = (not need and policy.key.level == "none" and policy.value.level == "payload"
                and policy.value.header is None)  # a run stops at a tombstone
        run: tuple[bytes, CompiledSchema] | None = None
        records = batch.records
        index = 0
        while index < len(records):
            if run is not None:
                index = run[1].check_run(records, index, run[0])
                if index == len(records):
                    break
            record = records[index]
            problems: list[str] = []
            key_value = self._side(record, policy.key, batch.topic, state, problems, need)
            if record.value is None and policy.tombstones == "reject":
                problems.append("null value (tombstone), which this topic refuses")
                state.counts["tombstone"] += 1
            value = self._side(record, policy.value, batch.topic, state, problems, need)
            if key_value is _UNFRAMED:  # allowed without a schema id: the rules see its bytes
                key_value = record.key
            if (policy.rules and not problems and value is not _SKIP
                    and record.value is not None and not state.pending):
                self._rules(record, policy, batch.topic, value, key_value, state, problems)
            if problems:
                if len(errors) < _MAX_ERRORS:
                    errors.append((index, f"record {index}: " + "; ".join(problems)))
            elif runs and record.value is not None:
                frame = record.value[:5]
                known = state.good_frames.get(("value", frame))
                if known is not None:
                    run = (frame, known)
            index += 1
        return errors

    def _outcome(self, batch: RecordBatch, errors: list[tuple[int, str]],
                 state: _Pass) -> Refusal | None:
        if state.pending:
            return None
        if state.unavailable and self.settings.on_registry_unavailable == "reject":
            state.counts["registry_unavailable"] += 1
            return Refusal(int(ErrorCode.REQUEST_TIMED_OUT),
                           f"the proxy could not check {batch.topic}[{batch.partition}] "
                           f"against the schema registry ({state.unavailable[0]}); the "
                           "batch was not stored, retry", ())
        if state.unavailable:
            self._passed_unchecked(len(state.unavailable), state.unavailable[0])
        if not errors:
            return None
        first = errors[0][1]
        return Refusal(error_code(self.settings.error),
                       f"{len(errors)} of {len(batch.records)} record(s) of "
                       f"{batch.topic}[{batch.partition}] broke the data contract; first, "
                       f"{first}", tuple(errors))

    @staticmethod
    def _rules(record: Record, policy: TopicPolicy, topic: str, value: Any, key_value: Any,
               state: _Pass, problems: list[str]) -> None:
        if policy.value.level == "none" or value is _UNFRAMED:
            try:
                value = parse_json(record.value or b"")
            except PayloadError as exc:
                problems.append(f"{exc} (the rules read the value as JSON)")
                state.counts["payload"] += 1
                return
        headers = {h.key: h.value for h in record.headers}
        for name, text in policy.rules.failures(_for_cel(value), _for_cel(key_value),
                                                headers, topic):
            problems.append(text)
            state.rules[name] += 1
        if problems:
            state.counts["rule"] += 1

    def _side(self, record: Record, side: SideCheck, topic: str, state: _Pass,
              problems: list[str], need_value: bool = True) -> Any:
        """The side's decoded value (its bytes below payload level or when not
        ``need_value``), or _SKIP."""
        data = record.key if side.side == "key" else record.value
        if side.level == "none" or data is None:
            return data
        what = "key: " if side.side == "key" else ""
        known = state.good_frames.get((side.side, data[:5])) if side.header is None else None
        if known is not None:  # the id and subject of this frame held a record ago
            try:
                if need_value:
                    return known.decode(memoryview(data)[5:], ())
                known.check(data, (), 5)
                return data
            except PayloadError as exc:
                problems.append(f"{what}{exc}")
                state.counts["payload"] += 1
                return _SKIP
        try:
            schema_id, body = self._frame(record, data, side)
        except FramingError as exc:
            if side.allow_unframed:
                return _UNFRAMED
            problems.append(f"{what}{exc}")
            state.counts["unframed"] += 1
            return _SKIP
        if side.header is not None and side.header.id == "global_id":
            mapped = _settled(self.lookups.global_id(schema_id)
                              or state.looked_global.get(schema_id),
                              f"Apicurio global id {schema_id}",
                              f" (header {side.header.name})", what, state, problems,
                              lambda: self.lookups.relook_global(schema_id, state.looked_global))
            if mapped is None:
                return _SKIP
            schema_id = mapped
        compiled = _settled(self.lookups.compiled(schema_id) or state.looked.get(schema_id),
                            f"schema id {schema_id}", "", what, state, problems,
                            lambda: self.lookups.relook(schema_id, state.looked))
        if compiled is None:
            return _SKIP
        indexes: tuple[int, ...] = ()
        try:
            if compiled.uses_message_indexes:
                if side.header is None:
                    indexes, body = message_indexes(body)
                else:
                    indexes = (0,)
            if side.level in ("subject", "payload") or side.require_latest:
                name = compiled.record_name(indexes) if side.strategy != "TopicName" else None
                subject = side.subject(topic, name)
                problem = self._subject_problem(schema_id, subject, side, state)
                if problem in ("down", "pending"):
                    return _SKIP
                if problem:
                    problems.append(f"{what}{problem[1]}")
                    state.counts[problem[0]] += 1
                    return _SKIP
            if side.level == "payload":
                if side.header is None and not compiled.uses_message_indexes:
                    state.good_frames[(side.side, data[:5])] = compiled
                if need_value:
                    return compiled.decode(body, indexes)
                compiled.check(body, indexes)
        except (PayloadError, FramingError) as exc:
            problems.append(f"{what}{exc}")
            state.counts["payload"] += 1
            return _SKIP
        return data

    def _subject_problem(self, schema_id: int, subject: str, side: SideCheck,
                         state: _Pass) -> tuple[str, str] | str | None:
        """None (holds), "pending" (asked the registry), "down" (it did not answer), or
        (check, text)."""
        now = time.monotonic()
        down = state.down.get(("subjects", schema_id))
        if down is not None:
            state.unavailable.append(f"subjects of schema id {schema_id}: {down}")
            return "down"
        known = self.lookups.subjects(schema_id)
        if isinstance(known, Unavailable):  # remembered: not asked again before its time
            state.unavailable.append(f"subjects of schema id {schema_id}: {known}")
            return "down"
        if known is None:
            state.ask(("subjects", schema_id),
                      partial(self.lookups.fetch_subjects, schema_id, state.down))
            return "pending"
        if subject not in known[0]:
            # Registered there since? Ask once, then at most every second per (id, subject).
            asked = self._rechecked.get((schema_id, subject))
            if known[1] < now and (asked is None or now - asked >= _RECHECK_S):
                if len(self._rechecked) >= self.settings.compiled_cache_size:
                    self._rechecked.clear()
                self._rechecked[(schema_id, subject)] = now
                state.ask(("subjects", schema_id), partial(self.lookups.fetch_subjects,
                                                           schema_id, state.down))
                return "pending"
            if not known[0]:
                return "subject", f"schema id {schema_id} is registered under no subject"
            under = ", ".join(sorted(known[0])[:5])
            return "subject", (f"schema id {schema_id} is registered under {under}, not "
                               f"{subject}")
        if side.require_latest:
            down = state.down.get(("latest", subject))
            if down is not None:
                state.unavailable.append(f"latest version of {subject}: {down}")
                return "down"
            latest = self.lookups.latest(subject)
            if isinstance(latest, Unavailable):
                state.unavailable.append(f"latest version of {subject}: {latest}")
                return "down"
            if latest is None:
                state.ask(("latest", subject),
                          partial(self.lookups.fetch_latest, subject, state.down))
                return "pending"
            if latest != schema_id:
                return "latest", (f"schema id {schema_id} is not the latest version of "
                                  f"{subject} (schema id {latest} is)")
        return None

    def _passed_unchecked(self, records: int, cause: str) -> None:
        self.unavailable_passed += records
        now = time.monotonic()
        if now - self._last_pass_log >= 10:
            self._last_pass_log = now
            log.warning("schema registry unavailable, records passed unchecked "
                        "(on_registry_unavailable: pass; %d so far): %s",
                        self.unavailable_passed, cause)


def _settled(found: Any, label: str, where: str, what: str, state: _Pass,
             problems: list[str], relook: Callable[[], Awaitable[None]]) -> Any:
    """A lookup's answer when it holds one, else None, having noted why: the registry
    down (``state.unavailable``), a refusal (``problems``), or - None, looked up a moment
    ago and evicted since by another batch - a lookup again (``state.pending``)."""
    if isinstance(found, Unavailable):
        state.unavailable.append(f"{label}: {found}")
        return None
    if isinstance(found, Missing):
        problems.append(f"{what}{found.text}{where}")
        state.counts[found.check] += 1
        return None
    if found is None:
        state.ask(("relook", label), relook)
    return found


class _Skip:
    """The side was not decoded (a problem, or passed unchecked)."""


class _Unframed:
    """The side carries no schema id and its topic allows that: the rules read it as JSON."""


_SKIP: Any = _Skip()
_UNFRAMED: Any = _Unframed()


def _for_cel(value: Any) -> Any:
    if hasattr(value, "DESCRIPTOR"):
        return to_map(value)
    return plain(value)
