"""``RecordEncryption`` (``record_encryption``): record values encrypted on produce, decrypted
on fetch, with data keys from a KMS (envelope encryption).

Contract. One configured instance serves both hooks:

* **Produce** (``intercept``): the records of a topic its :class:`~.settings.TopicPlan`
  encrypts are sealed by :class:`~.records.RecordCipher` under the topic's current data
  key (value, and the chosen headers; keys, timestamps and other headers stay as they
  are; a tombstone stays a tombstone). What cannot be encrypted is never stored in
  clear unless a policy says so:

  - the KEK is unknown or unusable (:class:`~.kms.UnresolvedKey`): ``unresolved_key``,
    ``pass`` (stored as it came, in clear, counted, logged once a minute per topic) or
    ``reject`` (POLICY_VIOLATION); a key that the configuration fixes (a template
    without a placeholder) and that the KMS can tell unusable without a call (not in
    the key file, not a valid AWS alias name) is refused at load instead, so a reload
    never switches topics to plaintext that way, and so is a template whose own text
    makes an alias name AWS refuses for every topic (``alias/KEK.${topic}``);
  - the KMS cannot be used (unreachable, throttled, timed out, refused credentials:
    any other :class:`~.kms.KmsError`): REQUEST_TIMED_OUT, the code producers retry
    (the one ``schema_registry`` answers when its registry is down); with
    ``on_kms_unavailable: pass`` a retriable failure stores the batch as it came,
    counted and logged;
  - a record that already carries the marker header: INVALID_RECORD.

* **Fetch** (``on_consume_blocks`` or ``on_consume_block``, then ``on_consume``): every
  record carrying the marker header is opened, on any topic; records without it are
  returned as they are, and a batch with none is returned unchanged. The common batch -
  every value sealed under one data key - is opened as its records block, without a
  record object each (a fetched partition's common batches together, their cipher calls
  over threads); any other goes on to ``on_consume``, record by record. A record that does not open
  (:class:`~.kms.Undecryptable`, :class:`~.envelope.EnvelopeError`) follows its
  topic's ``on_undecryptable``:
  ``error`` refuses the partition (:class:`~kiproxy.interceptors.RefuseFetch`, a code
  consumers retry; the reason in the proxy's log), ``pass`` hands the consumer the
  ciphertext record as stored. A KMS that cannot be used refuses the partition too.

Counters (:meth:`RecordEncryption.metrics`) say how many records were encrypted,
decrypted, passed unencrypted and why, how many KMS calls failed and how many data
keys were generated and unwrapped. Warnings are logged at most once a minute per
topic and cause, each with that topic's count so far.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable, Sequence

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    FetchResponseInterceptor,
    InterceptContext,
    MetricSample,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RefuseFetch,
    RejectBatch,
)
from kiproxy.interceptors.log_limit import RateLimitedLog
from kiproxy.interceptors.sealing import carries_header

from .data_keys import DataKeyCache
from .envelope import MARKER_HEADER, EnvelopeError
from .key_file import KeyFileKms
from .kms import InvalidKeyReference, KmsError, KmsProvider, Undecryptable, UnresolvedKey
from .records import RecordCipher
from .settings import RecordEncryptionSettings, TopicPlans

__all__ = ["RecordEncryption"]

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0


def _kms(settings: RecordEncryptionSettings) -> KmsProvider:
    kms = settings.kms
    if kms.type == "key_file":
        assert kms.path is not None  # the settings model requires it
        return KeyFileKms(kms.path)
    from .aws_kms import AwsKmsProvider  # boto3 loads only for an AWS KMS
    return AwsKmsProvider(kms)


class _Configured:
    """What ``configure`` builds: the plans, the cipher and its KMS."""

    __slots__ = ("cipher", "headers", "kms", "plans", "settings")

    def __init__(self, settings: RecordEncryptionSettings) -> None:
        self.settings = settings
        self.plans = TopicPlans.of(settings)
        self.headers = frozenset(settings.headers)
        self.kms = _kms(settings)
        for where, reference in self.plans.fixed_references():
            problem = self.kms.reference_problem(reference)
            if problem is not None:
                raise ValueError(f"{where}: {problem}")
        for where, template, sample in self.plans.sample_references():
            problem = self.kms.form_problem(sample)
            if problem is not None:  # its literal part: so for every topic
                raise ValueError(f"{where}: {template!r} names no usable key for any topic "
                                 f"(for a topic t: {problem})")
        self.cipher = RecordCipher(DataKeyCache(self.kms, settings.data_keys))


class RecordEncryption(ProduceRequestInterceptor[RecordEncryptionSettings],
                       FetchResponseInterceptor[RecordEncryptionSettings]):
    """Encrypts record values with data keys from a KMS on produce, decrypts them on fetch."""

    def __init__(self) -> None:
        self._state: _Configured | None = None
        self.counts: Counter[str] = Counter()
        """Records and KMS calls by outcome (what :meth:`metrics` reports)."""
        self._by_topic: Counter[tuple[str, str]] = Counter()
        """Records passed unencrypted or undecrypted by (cause, topic), for the warnings."""
        self._log = RateLimitedLog(log, _LOG_EVERY_S)

    def configure(self, config: RecordEncryptionSettings) -> None:
        """Take the validated settings; a key file is read now, the KMS is not called yet.
        Raises ValueError naming the setting whose fixed key the KMS can tell unusable."""
        self._state = _Configured(config)

    def _configured(self) -> _Configured:
        if self._state is None:
            raise RuntimeError("record_encryption: configure() was not called")
        return self._state

    # -- produce ----------------------------------------------------------------------

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """``batch`` with its records encrypted (see the module docstring for the policies)."""
        state = self._configured()
        topic, where = batch.topic, f"{batch.topic}[{batch.partition}]"
        reference = state.plans.plan(topic).reference
        if reference is None:
            return self._as_is(batch, where)
        try:
            records = await state.cipher.encrypt(topic, batch.records, key_reference=reference,
                                                 header_names=state.headers,
                                                 deadline=ctx.deadline)
        except UnresolvedKey as exc:
            return self._unresolved(batch, reference, exc)
        except KmsError as exc:
            self.counts["kms_errors_encrypt"] += 1
            if exc.retriable and state.settings.on_kms_unavailable == "pass":
                self.counts["kms_unavailable_passed"] += len(batch.records)
                self._log.warning(("kms", topic), "record_encryption: %s stored UNENCRYPTED "
                                  "(on_kms_unavailable: pass; records of this topic so "
                                  "far: %d): %s", where,
                                  self._count("kms", topic, len(batch.records)), exc)
                return batch  # encrypt() refused a marked record before any KMS call
            self._log.warning(("kms", topic), "record_encryption: %s refused, the KMS could "
                              "not be used: %s", where, exc)
            raise RejectBatch(f"{where} could not be encrypted, the KMS could not be used "
                              f"({exc}); nothing was stored, retry", "REQUEST_TIMED_OUT"
                              ) from None
        except EnvelopeError as exc:
            raise RejectBatch(f"{where}: {exc}", "INVALID_RECORD") from None
        self.counts["encrypted"] += sum(map(operator.is_not, records, batch.records))
        return batch.with_records(records)

    def _unresolved(self, batch: RecordBatch, reference: str, exc: UnresolvedKey
                    ) -> RecordBatch:
        where = f"{batch.topic}[{batch.partition}]"
        # a name the KMS does not accept says so itself; another key may yet be created
        unusable = (str(exc) if isinstance(exc, InvalidKeyReference)
                    else f"its key {reference!r} is not usable: {exc}")
        if self._configured().settings.unresolved_key == "reject":
            self.counts["unresolved_rejected"] += len(batch.records)
            if isinstance(exc, InvalidKeyReference):
                raise RejectBatch(f"{where} refused, {unusable}; nothing was stored "
                                  "(unresolved_key: reject)", "POLICY_VIOLATION") from None
            raise RejectBatch(f"{where} has no usable encryption key {reference!r} ({exc}); "
                              "create the key, or change `key:` or `topics:` of "
                              "record_encryption", "POLICY_VIOLATION") from None
        self.counts["unresolved_passed"] += len(batch.records)
        self._log.warning(("unresolved", batch.topic), "record_encryption: topic %r stored "
                          "UNENCRYPTED, %s (unresolved_key: pass; records of this topic "
                          "so far: %d)", batch.topic, unusable,
                          self._count("unresolved", batch.topic, len(batch.records)))
        return batch  # encrypt() refused a marked record before resolving the key

    @staticmethod
    def _as_is(batch: RecordBatch, where: str) -> RecordBatch:
        """``batch`` of a topic not encrypted, to be stored as it came, unless a record
        carries the marker header: the fetch side would take it for sealed on any topic,
        so a producer never passes a record off as sealed (on an encrypted topic,
        :meth:`~.records.RecordCipher.encrypt` refuses it, whatever the policies)."""
        if carries_header(batch.records, MARKER_HEADER):
            raise RejectBatch(f"{where}: a record already carries the {MARKER_HEADER} "
                              "header, which only the proxy writes; nothing was stored",
                              "INVALID_RECORD")
        return batch

    def _count(self, cause: str, topic: str, records: int) -> int:
        """Records of ``topic`` passed for ``cause`` so far, ``records`` more included."""
        self._by_topic[cause, topic] += records
        return self._by_topic[cause, topic]

    # -- fetch ------------------------------------------------------------------------

    async def on_consume_block(self, block: ConsumedBlock, ctx: ConsumeContext
                               ) -> bytes | memoryview | None:
        """The common batch (every value sealed under one data key) opened as its records
        block, a batch with nothing sealed passed as it is; None hands any other batch
        to :meth:`on_consume`, record by record."""
        state = self._configured()
        topic = block.topic
        try:
            opened = await state.cipher.decrypt_block(topic, block.data, block.record_count,
                                                      deadline=ctx.deadline)
        except KmsError as exc:
            if isinstance(exc, Undecryptable) and \
                    state.plans.plan(topic).on_undecryptable == "pass":
                return None  # on_consume keeps what does not open as it is
            raise self._refusal(topic, _where(block), exc) from None
        if opened is not None and opened is not block.data:
            self.counts["decrypted"] += block.record_count
        return opened

    async def on_consume_blocks(self, blocks: Sequence[ConsumedBlock], ctx: ConsumeContext
                                ) -> list[bytes | memoryview | RefuseFetch | None]:
        """:meth:`on_consume_block` of a fetched partition's batches at once: the common
        ones opened together (over threads, where there are CPUs to spare), a batch
        whose data key could not be had refused as :meth:`on_consume_block` refuses it
        (or, for a key the KMS will not unwrap under ``on_undecryptable: pass``, None);
        None for any other, which :meth:`on_consume` reads record by record."""
        if not blocks:
            return []
        state = self._configured()
        topic = blocks[0].topic
        opened = await state.cipher.decrypt_blocks(
            topic, [(b.data, b.record_count) for b in blocks], deadline=ctx.deadline)
        out: list[bytes | memoryview | RefuseFetch | None] = []
        refusal: RefuseFetch | None = None  # the answer ends at the first: one counted
        for block, answer in zip(blocks, opened, strict=True):
            if refusal is not None:  # not sent: neither counted nor opened again
                out.append(refusal)
                continue
            if isinstance(answer, KmsError):
                if isinstance(answer, Undecryptable) and \
                        state.plans.plan(topic).on_undecryptable == "pass":
                    out.append(None)  # on_consume keeps what does not open as it is
                    continue
                refusal = self._refusal(topic, _where(block), answer)
                out.append(refusal)
                continue
            if answer is not None and answer is not block.data:
                self.counts["decrypted"] += block.record_count
            out.append(answer)
        return out

    async def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        """``batch`` with every sealed record opened (plaintext records as they are)."""
        state = self._configured()
        if not carries_header(batch.records, MARKER_HEADER):
            return batch
        topic = batch.topic
        where = _where(batch)
        try:
            records = await state.cipher.decrypt(topic, batch.records, deadline=ctx.deadline)
        except (Undecryptable, EnvelopeError) as exc:
            if state.plans.plan(topic).on_undecryptable == "error":
                raise self._refusal(topic, where, exc) from None
            try:
                records = await self._each(state.cipher, topic, where, batch.records,
                                           ctx.deadline)
            except KmsError as kms:
                raise self._refusal(topic, where, kms) from None
        except KmsError as exc:
            raise self._refusal(topic, where, exc) from None
        # an opened record is a new value; one passed as stored is the same object
        self.counts["decrypted"] += sum(map(operator.is_not, records, batch.records))
        return batch.with_records(records)

    def _refusal(self, topic: str, where: str, exc: Exception) -> RefuseFetch:
        """The refusal of a batch that did not decrypt (counted and logged): ``exc`` is an
        :class:`~.kms.Undecryptable` or :class:`~.envelope.EnvelopeError` under
        ``on_undecryptable: error``, or a KMS that could not be used."""
        if isinstance(exc, (Undecryptable, EnvelopeError)):
            self.counts["undecryptable_refused"] += 1
            self._log.warning(("undecryptable", topic), "record_encryption: %s refused to "
                              "the consumer, a record does not decrypt (on_undecryptable: "
                              "error): %s", where, exc)
            return RefuseFetch(f"{where}: a record does not decrypt: {exc}")
        self.counts["kms_errors_decrypt"] += 1
        self._log.warning(("kms", topic), "record_encryption: %s refused to the consumer, "
                          "the KMS could not be used: %s", where, exc)
        return RefuseFetch(f"{where} could not be decrypted, the KMS could not be used: "
                           f"{exc}")

    async def _each(self, cipher: RecordCipher, topic: str, where: str,
                    records: Sequence[Record], deadline: float) -> tuple[Record, ...]:
        """``records`` opened one by one, those that do not open kept as stored."""
        out: list[Record] = []
        for record in records:
            try:
                out += await cipher.decrypt(topic, (record,), deadline=deadline)
            except (Undecryptable, EnvelopeError) as exc:
                self.counts["undecryptable_passed"] += 1
                self._log.warning(("undecryptable", topic), "record_encryption: %s: a record "
                                  "passed to the consumer as ciphertext (on_undecryptable: "
                                  "pass; records of this topic so far: %d): %s", where,
                                  self._count("undecryptable", topic, 1), exc)
                out.append(record)
        return tuple(out)

    # -- both -------------------------------------------------------------------------

    def metrics(self) -> Iterable[MetricSample]:
        """Records by outcome, KMS errors, data keys generated and unwrapped."""
        counts = self.counts
        yield _counter("record_encryption_records_encrypted",
                       "Records encrypted on produce", counts["encrypted"])
        yield _counter("record_encryption_records_decrypted",
                       "Records decrypted on fetch", counts["decrypted"])
        for policy, key in (("pass", "unresolved_passed"), ("reject", "unresolved_rejected")):
            yield _counter("record_encryption_unresolved_key_records",
                           "Records of a topic whose key could not be resolved (the KMS "
                           "does not know it, or it is no valid key name), by the "
                           "unresolved_key policy applied", counts[key], policy=policy)
        yield _counter("record_encryption_kms_unavailable_passed",
                       "Records stored unencrypted because the KMS could not be used "
                       "(on_kms_unavailable: pass)", counts["kms_unavailable_passed"])
        for policy, key in (("pass", "undecryptable_passed"), ("error", "undecryptable_refused")):
            yield _counter("record_encryption_undecryptable",
                           "Fetched records (pass) or batches (error) that did not decrypt, "
                           "by the on_undecryptable policy applied", counts[key], policy=policy)
        for hook in ("encrypt", "decrypt"):
            yield _counter("record_encryption_kms_errors",
                           "Batches refused or passed because a KMS call failed",
                           counts[f"kms_errors_{hook}"], hook=hook)
        if self._state is not None:
            keys = self._state.cipher.keys
            yield _counter("record_encryption_data_keys_generated",
                           "Data keys generated by the KMS", keys.generated)
            yield _counter("record_encryption_data_keys_unwrapped",
                           "Data keys unwrapped by the KMS (cache misses)", keys.unwrapped)

    async def close(self) -> None:
        """Release the KMS client's threads and connections."""
        if self._state is not None:
            await self._state.kms.close()


def _where(batch: ConsumedBatch | ConsumedBlock) -> str:
    return f"{batch.topic}[{batch.partition}] batch at offset {batch.base_offset}"


def _counter(name: str, help_text: str, value: float, **labels: str) -> MetricSample:
    return MetricSample(name=name, kind="counter", help=help_text, labels=labels,
                        value=float(value))
