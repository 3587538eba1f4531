"""The produce pipeline's settle step: every decided partition turned into the answer.

Contract: :meth:`Settler.settle` takes one
:class:`~kiproxy.proxy.produce.job.PartitionJob` and its
:class:`~kiproxy.proxy.produce.job.Decision`, in request order, and is the one place
their consequences happen: the :class:`~kiproxy.interceptors.observer.PartitionSummary`
observers and metrics get (:func:`summarize`), what observe mode saw (the
``kiproxy_would_*`` counters, a rate-limited log line, the ``dead_letter_observed``
copy), a refusal's ``kiproxy_rejected_batches_total`` and dead-letter copy, the
acknowledgement hooks' entries, and the new records a splice puts in the frame. It
gathers them in one :class:`~kiproxy.proxy.produce.response.Settled` per request;
:meth:`Settler.log_rejections` then writes every rejection's one log line
(:class:`~kiproxy.proxy.observe.verdict_log.VerdictLog`: policy at INFO, plugin faults
at a rate-limited WARNING). Nothing here blocks: dead-letter copies are offered to
the process's sink.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.errors import error_name
from kiproxy.interceptors.observer import PartitionSummary
from kiproxy.proxy.observe.dead_letter import DeadLetterCopy
from kiproxy.proxy.observe.verdict_log import Subject, VerdictLog
from kiproxy.proxy.produce.response import Acked, Observation, Rejection, Settled

if TYPE_CHECKING:
    import logging

    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.observe.kafka_sink import KafkaSink
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.produce.job import Decision, PartitionJob

__all__ = ["Settler", "summarize"]


def summarize(job: PartitionJob, decision: Decision) -> PartitionSummary:
    """What observers are told of one decided partition (the broker's answer is added
    by the merger)."""
    rejection = decision.rejection
    observed: dict[str, Any] = {}
    if decision.watched:
        seen = next((o for o in decision.observed if o.outcome == "rejected"),
                    decision.observed[0] if decision.observed else None)
        observed = {"observed_outcome": "unchanged"} if seen is None else {
            "observed_outcome": seen.outcome, "observed_error_code": seen.error_code,
            "observed_error_message": seen.message, "observed_link": seen.link}
    batches = job.batches
    return PartitionSummary(
        topic=job.topic, partition=job.partition, batches=batches.batches,
        records=batches.records, bytes=batches.size, outcome=decision.outcome,
        error_code=rejection.error_code if rejection is not None else 0,
        error_message=rejection.message if rejection is not None else None,
        route=job.chain.name if job.chain is not None else None,
        link=rejection.link if rejection is not None else None,
        observe_mode=job.chain is not None and job.chain.route.observe, **observed)


class Settler:
    """Where the consequences of every decided partition go (see the module contract)."""

    def __init__(self, *, log: logging.Logger, metrics: Metrics | None,
                 dead_letter: KafkaSink | None, topic_names: dict[uuid.UUID, str]) -> None:
        self.metrics = metrics
        self.verdict_log = VerdictLog(log)
        """Where every rejection is logged, once (see :meth:`log_rejections`)."""
        self.dead_letter = dead_letter
        """Where routes with ``dead_letter`` copy refused records (the process's sink)."""
        self.topic_names = topic_names

    def settle(self, job: PartitionJob, decision: Decision, settled: Settled) -> None:
        """Add one partition's decision to ``settled`` and do what it calls for."""
        if settled.summaries is not None:
            settled.summaries.append(summarize(job, decision))
        for seen in decision.observed:
            self._observed(job, seen)
        rejection = decision.rejection
        if rejection is not None:
            settled.rejections.append(rejection)
            settled.edits[job.position] = None
            self._copy(job, rejection)
            if self.metrics is not None:
                self.metrics.rejected_batches.labels(rejection.reason).inc(
                    max(job.batches.batches, 1))
            return
        chain = job.chain
        if chain is not None and chain.hooks:
            settled.acked.append(Acked(job.topic_key, job.partition, decision.acknowledged,
                                       chain.hooks, chain.hook_names))
        if decision.changed:
            settled.edits[job.position] = decision.records
        settled.forwarded += 1

    def log_rejections(self, client: RequestingClient, rejections: list[Rejection]) -> None:
        """The one place a rejection is logged: policy at INFO, a plugin fault as a
        rate-limited WARNING (see :mod:`kiproxy.proxy.observe.verdict_log`)."""
        who = client.identity
        for r in rejections:
            topic = self.topic_names.get(r.topic, r.topic)
            where = f"{topic}[{r.partition}]"
            if r.fault is None:
                self.verdict_log.policy(Subject(where, who.client_address, who.client_id,
                                                client.log_context, r.route, r.link),
                                        r.error_code, r.message)
            else:
                extra = {**client.log_context, "topic": topic, "partition": r.partition}
                self.verdict_log.fault(Subject(where, who.client_address, who.client_id, extra,
                                               r.route, r.link), r.fault, r.message,
                                       r.exception)

    def _observed(self, job: PartitionJob, seen: Observation) -> None:
        """What observe mode saw of one batch: the ``kiproxy_would_*`` counters, a
        rate-limited log line, and (``dead_letter_observed``) the copy of what would
        have been refused."""
        assert job.chain is not None
        route = job.chain.name
        rejected = seen.outcome == "rejected"
        if self.metrics is not None:
            if rejected:
                self.metrics.would_reject_batches.labels(route, seen.link, seen.reason).inc()
                self.metrics.would_reject_records.labels(
                    route, seen.link, seen.reason).inc(seen.record_count)
            else:
                self.metrics.would_transform_batches.labels(route, seen.link).inc()
                self.metrics.would_transform_records.labels(route, seen.link).inc(
                    seen.record_count)
        who = job.client.identity
        detail = f": error {seen.error_code}: {seen.message}" if rejected else ""
        self.verdict_log.observed(
            Subject(f"{job.topic}[{job.partition}]", who.client_address, who.client_id,
                    job.client.log_context, route, seen.link),
            "rejected" if rejected else "transformed", detail,
            route_observes=job.chain.route.observe)
        self._copy(job, seen)

    def _copy(self, job: PartitionJob, refused: Rejection | Observation) -> None:
        """The records of a refusal (or of what observe mode saw would be one) to the
        route's dead-letter topic, when it has one (never blocks)."""
        chain = job.chain
        if (self.dead_letter is None or not refused.records or chain is None
                or chain.route.dead_letter is None):
            return
        who = job.client.identity
        self.dead_letter.offer(DeadLetterCopy(
            topic=chain.route.dead_letter, source_topic=job.topic, partition=job.partition,
            route=chain.name, link=refused.link, error_code=refused.error_code,
            error_name=error_name(refused.error_code), reason=refused.message or "",
            client_id=who.client_id, principal=who.principal,
            time_ms=job.facts.received_at_ms, observed=isinstance(refused, Observation),
            records=refused.records,
            record_reasons={i: m for i, m in refused.record_errors if m is not None}))
