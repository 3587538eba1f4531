"""The verdict: what an interceptor's answer to one batch means.

Every runtime that hands a batch to a plugin - the proxy, its isolation
workers, the replay pipeline - asks :func:`judge` (or :func:`judge_sync` on a
thread with no running event loop) and acts on the :data:`Verdict` it gets;
nothing else decides. The rules, in order:

* ``RejectBatch`` raised: :class:`Rejected` with its error code, message and
  record errors (indices within this batch) - a *policy* rejection
  (``plugin_fault`` false). The record errors sent are those naming a record of
  the batch (``0 <= index < record count``), in index order, one per record (the
  messages of a record named twice joined with "; "), which is what clients can
  map back to records; the others are left out, kept on the verdict
  (``stray_record_errors``) and named in a WARNING (one per plugin per 10 s).
  Every message a plugin gives (the rejection's, each record's, an exception's text)
  is cut to :data:`MAX_MESSAGE_CHARS` characters (:func:`clip`).
* The deadline (``ctx.deadline``, when a ``timeout`` is given) passes before
  an ``async def intercept`` finishes, or a plain one returns after it:
  REQUEST_TIMED_OUT, "interceptor X did not finish within N ms".
* Any other exception: INVALID_RECORD, "interceptor X failed: Class: text";
  the exception (with its traceback) is kept on the verdict for logging.
* Something other than a :class:`RecordBatch` returned: INVALID_RECORD,
  "interceptor X returned NoneType, not a RecordBatch".
* :class:`PluginFault` raised (a plugin host's sandbox stopped the plugin - a Wasm
  trap, out of memory or fuel - or could not read its answer): INVALID_RECORD with
  its message and record errors, ``fault`` as it says.
* Another number of records returned (the record-count rule): INVALID_RECORD,
  "interceptor X broke the record-count rule: returned 1 records for a batch of 2".
* The same records returned (the same tuple, or records equal in every field:
  key, value, headers in order, timestamp and offset delta): :class:`Unchanged`,
  and the proxy forwards the original bytes.
* More bytes returned than :class:`OutputLimits` allow (the output bound:
  ``max_plugin_output_bytes``, and ``max_plugin_output_ratio`` times the bytes
  received once past :data:`RATIO_CHECKED_FROM`): INVALID_RECORD, "interceptor X
  returned 40000000 bytes of records for 500 bytes received; the limit is
  max_plugin_output_bytes (33554432)". Sizes are the records' encoded size
  (:func:`~kiproxy.protocol.records.records_size`, compiled, reading fields nobody
  built from the decoded block); an unchanged batch is never measured.
* Anything else: :class:`Transformed`, carrying the returned batch.

The plugin-bug rejections set ``plugin_fault`` (and ``fault``, one of
:data:`FAULTS`), so a runtime can log them apart from policy rejections (rate-limited).

:func:`judge` and :func:`judge_sync` are one body (``_judging``) driven two ways: a
plain ``intercept`` is judged without an event loop; only an ``async def intercept``
waits, on the caller's loop. :func:`result_fault` is the return-type and
record-count rules alone, for a plugin that runs other plugins (``chain``).
:class:`Outcome` is a verdict as the test kit and replay report it.

A runtime that judged a batch elsewhere (the isolation pool, whose worker
process ran :func:`judge_sync`) passes the rejection on by raising
:class:`Judged` from its ``intercept``; :func:`judge` returns the carried
verdict as it is.

The acknowledgement hook (``on_acknowledgement``) is the plugin's only when it
overrides the base class's: :func:`acknowledgement_hook` says which callable,
if any, to call once the broker answered.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from kiproxy.interceptors.api import (
    AcknowledgedBatch,
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.awaiting import within
from kiproxy.interceptors.errors import ErrorCode, error_name
from kiproxy.protocol._codec import SlotsMaker
from kiproxy.protocol.compression import DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES
from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.protocol.records import encode_records, records_size

__all__ = [
    "DEFAULT_MAX_PLUGIN_OUTPUT_BYTES",
    "DEFAULT_MAX_PLUGIN_OUTPUT_RATIO",
    "DEFAULT_OUTPUT_LIMITS",
    "FAULTS",
    "MAX_MESSAGE_CHARS",
    "RATIO_CHECKED_FROM",
    "AcknowledgementHook",
    "Fault",
    "Judged",
    "Mode",
    "Outcome",
    "OutputLimits",
    "PluginFault",
    "Rejected",
    "Transformed",
    "Unchanged",
    "Verdict",
    "acknowledgement_hook",
    "clip",
    "encodable",
    "encoding_fault",
    "encoding_problem",
    "fault_rejection",
    "judge",
    "judge_sync",
    "output_fault",
    "output_limits",
    "output_size",
    "oversized",
    "result_fault",
    "stray_text",
    "unencodable_detail",
]

log = logging.getLogger("kiproxy.interceptors")
_stray_warnings = RateLimitedLog(log)

Mode = Literal["enforce", "observe"]
"""A route's (or link's) ``mode``: its verdict enforced, or only observed."""

Fault = Literal["raised", "return_type", "record_count", "timeout", "output_size", "crashed"]
"""Why a plugin-bug rejection happened."""
FAULTS: tuple[Fault, ...] = ("raised", "return_type", "record_count", "timeout",
                             "output_size", "crashed")

DEFAULT_MAX_PLUGIN_OUTPUT_BYTES = DEFAULT_MAX_DECOMPRESSED_BATCH_BYTES
"""The most bytes of records a plugin may return for one batch (32 MiB): as much as the
proxy accepts decompressed from a client (``max_decompressed_batch_bytes``)."""
DEFAULT_MAX_PLUGIN_OUTPUT_RATIO = 16
"""How many times the bytes it was given a plugin may return, once past
:data:`RATIO_CHECKED_FROM`."""
RATIO_CHECKED_FROM = 4 * 2**20
"""Bytes of output below which no ratio is checked: small batches may grow freely
(a header on a 5-byte record), as with ``max_decompression_ratio``."""


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """How much a plugin may return for one batch (the proxy's ``max_plugin_output_bytes``
    and ``max_plugin_output_ratio``; see docs/limits.md, "Plugins")."""

    max_bytes: int = DEFAULT_MAX_PLUGIN_OUTPUT_BYTES
    """Bytes of records (encoded, before compression) returned for one batch, at most."""
    max_ratio: int = DEFAULT_MAX_PLUGIN_OUTPUT_RATIO
    """Returned bytes over the bytes received, at most, once past
    :data:`RATIO_CHECKED_FROM` (0: no ratio check)."""


DEFAULT_OUTPUT_LIMITS = OutputLimits()
"""The limits of a runtime that was given none (the test kit, ``kiproxy check``, replay)."""

_LIMITS: ContextVar[OutputLimits] = ContextVar("kiproxy_output_limits",
                                               default=DEFAULT_OUTPUT_LIMITS)


def output_size(records: Sequence[Record]) -> int:
    """Bytes ``records`` take encoded, as the output bound counts them (0 for what cannot
    be encoded: encoding refuses it later, naming the record)."""
    return _encoded_size(records) or 0


def output_limits() -> OutputLimits:
    """The output bounds of the batch being judged (:func:`judge` sets them around the
    plugin's call; a thread the plugin hands its work to sees them when it runs in a
    copy of the caller's context): for a plugin host that builds its answer record by
    record, to stop before the whole of an oversized answer is in memory."""
    return _LIMITS.get()

AcknowledgementHook = Callable[[AcknowledgedBatch, int, "int | None"], None]


@dataclass(frozen=True, slots=True)
class Unchanged:
    """The plugin returned the batch's records as they were: forward the original."""

    batch: RecordBatch
    """The batch as it was handed to the plugin."""


@dataclass(frozen=True, slots=True)
class Transformed:
    """The plugin changed the records (same count): forward these instead."""

    batch: RecordBatch
    """The batch the plugin returned."""


_unchanged = SlotsMaker(Unchanged)
_transformed = SlotsMaker(Transformed)
"""Each batch's verdict, made without the frozen ``__init__`` (see SlotsMaker)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """The batch is not forwarded; the producer gets ``code`` and ``message``."""

    code: int
    """The Kafka error code (see :class:`~kiproxy.interceptors.errors.ErrorCode`)."""
    message: str
    """The partition's ``error_message``."""
    record_errors: tuple[tuple[int, str | None], ...] = ()
    """``(record index in this batch, message)`` pairs, from ``RejectBatch``: each index
    of the batch (``0 <= index < record count``) at most once, in index order."""
    stray_record_errors: tuple[object, ...] = ()
    """The ``RejectBatch.record_errors`` entries left out of :attr:`record_errors`, as the
    plugin gave them: an index naming no record of the batch, or not an
    ``(index, message)`` pair. A plugin bug, though the rejection stands."""
    fault: Fault | None = None
    """None for a policy rejection (``RejectBatch``); why the plugin failed otherwise."""
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception a ``raised`` fault came from (its traceback, for the log)."""

    @property
    def error(self) -> str:
        """Kafka's name of ``code`` (``POLICY_VIOLATION``), or ``ERROR_<code>``."""
        return error_name(self.code)

    @property
    def plugin_fault(self) -> bool:
        """True when the plugin misbehaved, False when it rejected by policy."""
        return self.fault is not None


Verdict = Unchanged | Transformed | Rejected
"""What became of one batch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What the proxy would do with the batch - one of three kinds, with the details - in
    the one shape the test kit (:func:`kiproxy.interceptors.testing.run_interceptor`)
    and replay (:mod:`kiproxy.pipelines.apply`) report it."""

    kind: Literal["unchanged", "transformed", "rejected"]
    """``unchanged`` (the original bytes are forwarded), ``transformed`` or ``rejected``."""
    records: tuple[Record, ...]
    """The records forwarded: the original ones, the transformed ones, or () when rejected."""
    error: str | None
    """The Kafka error name the producer gets (``POLICY_VIOLATION``), or None."""
    code: int
    """The Kafka error code (0 unless rejected)."""
    message: str | None
    """The partition's ``error_message``, or None."""
    record_errors: tuple[tuple[int, str | None], ...]
    """``(record index, message)`` pairs of a rejection."""
    fault: Fault | None
    """Why the plugin failed (``raised``, ``return_type``, ``record_count``, ``timeout``,
    ``output_size``, ``crashed``), or None (it answered, or rejected by policy with
    ``RejectBatch``)."""
    verdict: Verdict
    """The verdict itself, as :func:`~kiproxy.interceptors.verdict.judge` returned it."""
    mode: Mode = "enforce"
    """``enforce``: the verdict takes effect; ``observe``: the batch is forwarded as it came
    (``unchanged``) and :attr:`would` says what the verdict would have done."""
    would: Outcome | None = None
    """In observe mode, the outcome the verdict stands for when enforced (None otherwise)."""

    @classmethod
    def of(cls, verdict: Verdict, mode: Mode = "enforce",
           given: RecordBatch | None = None) -> Outcome:
        """The outcome a verdict on ``given`` stands for, enforced or observed (``mode``;
        observing needs ``given``, the batch forwarded as it came)."""
        if mode == "observe":
            if given is None:
                raise ValueError("Outcome.of(verdict, 'observe') needs the batch given")
            return cls(kind="unchanged", records=given.records, error=None, code=0,
                       message=None, record_errors=(), fault=None, verdict=verdict,
                       mode="observe", would=cls.of(verdict))
        if isinstance(verdict, Rejected):
            return cls(kind="rejected", records=(), error=verdict.error, code=verdict.code,
                       message=verdict.message, record_errors=verdict.record_errors,
                       fault=verdict.fault, verdict=verdict)
        kind: Literal["unchanged", "transformed"] = (
            "transformed" if isinstance(verdict, Transformed) else "unchanged")
        return cls(kind=kind, records=verdict.batch.records, error=None, code=0, message=None,
                   record_errors=(), fault=None, verdict=verdict)

    @property
    def forwarded(self) -> bool:
        """Whether the batch reaches the broker (unchanged or transformed)."""
        return self.kind != "rejected"

    @property
    def values(self) -> list[bytes | None]:
        """The forwarded records' values, in order."""
        return [r.value for r in self.records]


class PluginFault(RejectBatch):
    """Raised by a plugin host (the Wasm built-ins) when the plugin it runs misbehaved.

    ``fault`` says how: ``crashed`` (a Wasm trap, out of memory or fuel, or refused while
    the host backs it off after such crashes), ``return_type`` (an answer the host
    cannot read as records) or ``output_size`` (an answer past :func:`output_limits`,
    stopped as it was being read). Not a decision about the records: the verdict rejects the
    batch with ``error`` (INVALID_RECORD by default), the ``message`` as given (name
    the plugin and the cause in a user's words; a raw trace belongs in the log, at
    DEBUG) and ``record_errors``, as a plugin fault - logged rate-limited, not as a
    policy rejection. A ``RejectBatch``, so code that catches rejections sees it.
    """

    def __init__(self, message: str, record_errors: Sequence[tuple[int, str | None]] = (),
                 error: str | int = "INVALID_RECORD", *,
                 fault: Literal["crashed", "return_type", "output_size"] = "crashed"
                 ) -> None:
        super().__init__(message, error, record_errors)
        self.fault: Fault = fault


class Judged(Exception):
    """Raised by a runtime's ``intercept`` wrapper that judged the batch elsewhere.

    :func:`judge` returns :attr:`verdict` unchanged. Plugins raise ``RejectBatch``.
    """

    def __init__(self, verdict: Rejected) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


def fault_rejection(kind: Fault, name: str, detail: str, *,
          exception: BaseException | None = None) -> Rejected:
    """The rejection for a plugin bug: ``interceptor {name} {detail}``, cut by :func:`clip`."""
    code = ErrorCode.REQUEST_TIMED_OUT if kind == "timeout" else ErrorCode.INVALID_RECORD
    return Rejected(code=int(code), message=clip(f"interceptor {name} {detail}"), fault=kind,
                    exception=exception)


def unencodable_detail(exc: Exception) -> str:
    """How a rejection says a plugin's records cannot be encoded (not Records, a header key
    holding a surrogate that stands for no byte, a timestamp out of range), ``exc`` being
    what encoding them raised; the produce and fetch sides say it alike."""
    return f"returned records that cannot be encoded: {type(exc).__name__}: {exc}"


def encoding_fault(name: str, exc: Exception) -> Rejected:
    """The rejection of records a plugin returned that cannot be encoded: a
    ``return_type`` fault (:func:`unencodable_detail`)."""
    return fault_rejection("return_type", name, unencodable_detail(exc))


def encoding_problem(records: Sequence[Record], given: Sequence[Record]) -> Exception | None:
    """What encoding ``records`` (a plugin's answer for ``given``) raises, or None: the
    proxy finds it out when it writes the batch again; the test kit, ``kiproxy check`` and
    replay, which write nothing, by encoding the records once here."""
    base = given[0].timestamp if given else 0
    try:
        encode_records(records if type(records) is tuple else tuple(records), base, True)
    except Exception as exc:
        return exc
    return None


def encodable(verdict: Verdict, given: RecordBatch, name: str) -> Verdict:
    """``verdict``, or its :func:`encoding_fault` when it transforms ``given`` into records
    that cannot be encoded (:func:`encoding_problem`)."""
    if not isinstance(verdict, Transformed):
        return verdict
    problem = encoding_problem(verdict.batch.records, given.records)
    return verdict if problem is None else encoding_fault(name, problem)


MAX_MESSAGE_CHARS = 1024
"""A rejection's message and each record's error are cut to this many characters."""


def clip(message: str) -> str:
    """``message`` cut to :data:`MAX_MESSAGE_CHARS` characters, saying how much was cut: a
    plugin's reason goes to the producer and into the log, and a plugin may not decide
    the size of either."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return (f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS:,} more "
            "characters cut)")


def _timed_out(name: str, timeout: float | None) -> Rejected:
    within = "" if timeout is None else f" within {timeout * 1000:.0f} ms"
    return fault_rejection("timeout", name, f"did not finish{within}")


def _exception_verdict(exc: BaseException, batch: RecordBatch, name: str,
                       timeout: float | None) -> Rejected:
    if isinstance(exc, Judged):
        return exc.verdict
    if isinstance(exc, RejectBatch):
        sent, stray = _record_errors(exc.record_errors, len(batch.records))
        if stray:
            _warn_stray(name, batch, stray)
        return Rejected(code=exc.error_code, message=clip(str(exc.message)), record_errors=sent,
                        stray_record_errors=stray,
                        fault=exc.fault if isinstance(exc, PluginFault) else None)
    if isinstance(exc, TimeoutError):
        return _timed_out(name, timeout)
    return fault_rejection("raised", name, f"failed: {type(exc).__name__}: {exc}", exception=exc)


_RecordErrors = tuple[tuple[int, str | None], ...]


def _record_errors(given: Any, count: int) -> tuple[_RecordErrors, tuple[object, ...]]:
    """``RejectBatch.record_errors`` as sent, and the entries left out (see the module
    docstring). Clients read them as indices into the batch they sent, and librdkafka
    walks them in order alongside its records: one out of range or out of order and it
    fails records with ``_INVALID_DIFFERENT_RECORD`` instead of the plugin's error. A
    broker names a record once, so a record named twice gets one entry."""
    try:
        entries = tuple(given)
    except Exception:  # not even a sequence: nothing to send
        return (), (given,)
    sent: dict[int, str | None] = {}
    stray: list[object] = []
    for entry in entries:
        try:
            index, message = entry
            index = operator.index(index)
            if message is not None:
                message = clip(message if type(message) is str else str(message))
        except Exception:
            stray.append(entry)
            continue
        if not 0 <= index < count:
            stray.append(entry)
        elif index not in sent:
            sent[index] = message
        elif message is not None:
            before = sent[index]
            sent[index] = message if before is None else clip(f"{before}; {message}")
    return tuple(sorted(sent.items())), tuple(stray)


def stray_text(stray: Sequence[object]) -> str:
    """The entries of :attr:`Rejected.stray_record_errors` in a message: their indices
    (``99, -1``), or the entry itself where it is not an ``(index, message)`` pair."""
    def one(entry: object) -> str:
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int):
            return str(entry[0])
        return repr(entry)
    return ", ".join(one(entry) for entry in stray)


def _warn_stray(name: str, batch: RecordBatch, stray: tuple[object, ...]) -> None:
    count = len(batch.records)
    _stray_warnings.warning(
        ("stray record errors", name),
        "interceptor %s rejected %s[%d] with record_errors naming no record of its %d records "
        "(indices 0 to %d): %s; they were left out of the answer, the rejection stands",
        name, batch.topic, batch.partition, count, count - 1, stray_text(stray),
        more=MORE_IN_INTERVAL)


def result_fault(batch: RecordBatch, result: Any, name: str) -> Rejected | None:
    """The rejection when ``result`` breaks the return-type or record-count rule, else None.

    ``name`` names the plugin (``interceptor {name} ...``). A plugin that runs other
    plugins (the ``chain`` built-in) checks each one's answer with this.
    """
    if not isinstance(result, RecordBatch):
        return fault_rejection("return_type", name,
                               f"returned {type(result).__name__}, not a RecordBatch")
    if len(result.records) != len(batch.records):
        return fault_rejection("record_count", name,
                     f"broke the record-count rule: returned {len(result.records)} records "
                     f"for a batch of {len(batch.records)}")
    return None


def _encoded_size(records: Sequence[Record]) -> int | None:
    """Bytes ``records`` take encoded; None when a record cannot be encoded at all (a header
    key holding a surrogate that stands for no byte): encoding refuses the batch next,
    naming the record."""
    if type(records) is not tuple:  # a plugin may build its batch with a list of records
        records = tuple(records)
    try:
        return records_size(records)
    except UnicodeEncodeError:
        return None


def output_fault(batch: RecordBatch, result: RecordBatch, name: str,
                 limits: OutputLimits) -> Rejected | None:
    """The rejection when ``result`` holds more bytes than ``limits`` allow, else None.

    The returned records are measured in compiled code (no Python loop per record);
    the batch received only when the ratio is to be checked. Records that cannot be
    encoded at all (a header key holding a surrogate that stands for no byte) are not
    measured: encoding them refuses the batch next, naming the record.
    """
    size = _encoded_size(result.records)
    if size is None:
        return None
    detail = oversized(size, output_size, batch.records, limits)
    return None if detail is None else fault_rejection("output_size", name, detail)


_M = TypeVar("_M")


def oversized(size: int, measure: Callable[[_M], int], given: _M,
              limits: OutputLimits) -> str | None:
    """Why ``size`` bytes of records returned for ``given`` (``measure(given)`` bytes,
    asked only when needed: nothing is measured or made for an answer within bounds) are
    past ``limits`` (``returned ...``, the plugin's name left to the caller), else None:
    the one rule of both hooks' output."""
    if size > limits.max_bytes:
        return (f"returned {size} bytes of records for {measure(given)} bytes received; the "
                f"limit is max_plugin_output_bytes ({limits.max_bytes})")
    if limits.max_ratio and size > RATIO_CHECKED_FROM:
        received = measure(given)
        if size > received * limits.max_ratio:
            return (f"returned {size} bytes of records for {received} bytes received, more "
                    f"than max_plugin_output_ratio ({limits.max_ratio}) times as many")
    return None


def _result_verdict(batch: RecordBatch, result: Any, name: str,
                    limits: OutputLimits) -> Verdict:
    fault = result_fault(batch, result, name)
    if fault is not None:
        return fault
    if result.records is batch.records or result.records == batch.records:
        unchanged: Unchanged = _unchanged(batch)
        return unchanged
    fault = output_fault(batch, result, name, limits)
    if fault is not None:
        return fault
    transformed: Transformed = _transformed(result)
    return transformed


_Pending = tuple[Awaitable[Any], float | None]
"""An ``async def intercept``'s awaitable and the seconds it may take (None: no limit)."""


def _judging(interceptor: Any, batch: RecordBatch, ctx: InterceptContext, name: str,
             timeout: float | None, limits: OutputLimits) -> Generator[_Pending, Any, Verdict]:
    """The one body of :func:`judge` and :func:`judge_sync`, without the waiting.

    Yields once, for an ``async def intercept``: the driver waits for the awaitable and
    sends its result in (or throws its exception, ``TimeoutError`` past the deadline).
    """
    try:
        result = interceptor.intercept(batch, ctx)
        if type(result) is not RecordBatch and inspect.isawaitable(result):
            remaining = None if timeout is None else max(ctx.deadline - time.monotonic(), 0)
            result = yield result, remaining
        elif timeout is not None and time.monotonic() > ctx.deadline:
            return _timed_out(name, timeout)
    except (Exception, asyncio.CancelledError, SystemExit) as exc:
        # All the plugin's fault: a plain intercept cannot be cancelled by its caller (it
        # does not await), an awaited one is told apart by judge(). Escaping, these would
        # close the client's connection silently, or stop the event loop. (A
        # KeyboardInterrupt is the plugin's only where the proxy handles SIGINT itself:
        # judge(); a replay or `kiproxy check` stops on Ctrl-C.)
        return _exception_verdict(exc, batch, name, timeout)
    return _result_verdict(batch, result, name, limits)


def _resumed(judging: Generator[_Pending, Any, Verdict], result: Any,
             error: BaseException | None) -> Verdict:
    """Hand the awaited ``result`` (or ``error``) back to :func:`_judging`: its verdict."""
    try:
        if error is None:
            judging.send(result)
        else:
            judging.throw(error)
    except StopIteration as done:
        verdict: Verdict = done.value
        return verdict
    raise RuntimeError("the verdict yielded twice")  # _judging yields at most once


async def judge(interceptor: Any, batch: RecordBatch, ctx: InterceptContext, *,
                name: str, timeout: float | None,
                limits: OutputLimits = DEFAULT_OUTPUT_LIMITS) -> Verdict:
    """Run ``interceptor.intercept(batch, ctx)`` and return the verdict; never raises.

    ``name`` names the plugin in messages. ``timeout`` (seconds, the configured
    ``interceptor.timeout_ms``) turns on the deadline ``ctx.deadline``; None
    leaves the deadline to the caller (an isolation worker, killed by its pool).
    ``limits`` bound the bytes it may return (the proxy's configured ones; the plugin
    reads them with :func:`output_limits`).
    """
    judging = _judging(interceptor, batch, ctx, name, timeout, limits)
    # The default needs no setting (it is the variable's own): no cost on the usual path.
    bounds = None if limits is DEFAULT_OUTPUT_LIMITS else _LIMITS.set(limits)
    try:
        try:
            awaitable, remaining = next(judging)
        except StopIteration as done:  # a plain intercept: judged without waiting
            verdict: Verdict = done.value
            return verdict
        except KeyboardInterrupt as exc:  # the plugin's: the proxy handles SIGINT itself
            return _exception_verdict(exc, batch, name, timeout)
        try:
            result = await within(awaitable, remaining, name)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the proxy's own (the client left, a shutdown): not a verdict
            return _resumed(judging, None, exc)  # a future the plugin awaited was cancelled
        except KeyboardInterrupt as exc:
            judging.close()
            return _exception_verdict(exc, batch, name, timeout)
        except (Exception, SystemExit) as exc:
            return _resumed(judging, None, exc)
        return _resumed(judging, result, None)
    finally:
        if bounds is not None:
            _LIMITS.reset(bounds)


def judge_sync(interceptor: Any, batch: RecordBatch, ctx: InterceptContext, *,
               name: str, timeout: float | None,
               run: Callable[[Awaitable[Any], float | None], Any],
               limits: OutputLimits = DEFAULT_OUTPUT_LIMITS) -> Verdict:
    """:func:`judge` for a caller without a running event loop (the same rules, one body).

    ``run(awaitable, seconds)`` runs an ``async def intercept``'s awaitable to
    completion on the caller's own loop, raising ``TimeoutError`` after
    ``seconds`` (None: no limit). A plain ``intercept`` never reaches ``run``.
    """
    judging = _judging(interceptor, batch, ctx, name, timeout, limits)
    bounds = None if limits is DEFAULT_OUTPUT_LIMITS else _LIMITS.set(limits)
    try:
        try:
            awaitable, remaining = next(judging)
        except StopIteration as done:
            verdict: Verdict = done.value
            return verdict
        try:
            result = run(awaitable, remaining)
        except (Exception, asyncio.CancelledError, SystemExit) as exc:  # as judge() does
            return _resumed(judging, None, exc)
        return _resumed(judging, result, None)
    finally:
        if bounds is not None:
            _LIMITS.reset(bounds)


def acknowledgement_hook(interceptor: Any) -> AcknowledgementHook | None:
    """The plugin's ``on_acknowledgement``, or None when it keeps the base class's no-op."""
    hook = getattr(interceptor, "on_acknowledgement", None)
    overridden = (getattr(type(interceptor), "on_acknowledgement", None)
                  is not ProduceRequestInterceptor.on_acknowledgement)
    return hook if callable(hook) and overridden else None
