"""The paced latency phase of the proxy benchmark (runs in the producer's process).

:func:`paced_phase` offers ``offered`` records/s for ``seconds`` from a fresh
confluent-kafka producer and reports the produce-to-acknowledgement latency of
the records it samples: librdkafka's own ``Message.latency()``, read in the
delivery callback. With ``sample`` 1 every record is timed, as librdkafka's
delivery reports allow; with ``sample`` N a record is timed with probability
1/N, chosen by a fixed pseudo-random pattern that is independent of partitions
and batch boundaries. Untimed records carry no delivery callback, so they cost
the producer no Python call: at 300,000 records/s that call is a large part of
the producer's CPU on a machine the proxy and the broker share.

Every record is still accounted for. Records go to partitions round-robin, so
the offset each one must get is known in advance: ``before[p]`` records already
in partition ``p`` plus its place in the phase. Every timed record's offset is
checked against that, and the last :data:`TIMED_TAIL` records are always timed:
a record lost or written twice anywhere before them shifts the offsets of the
tail of its partition, and the phase reports it as an error. Percentiles are
over the timed records (``latencies`` in the result).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.proxy.cpu import CpuSampler
from bench.proxy.stats import percentile

TIMED_TAIL = 1000
"""The last records of a sampled phase are all timed (see the module docstring)."""
PATTERN_LENGTH = 10_007
"""Length of the sampling pattern (a prime: no period shared with partition counts)."""


def sampling_pattern(sample: int, length: int = PATTERN_LENGTH, seed: int = 21) -> list[bool]:
    """Which positions of a repeating pattern are timed: each with probability 1/``sample``."""
    if sample < 1:
        raise ValueError(f"latency sample must be 1 or more, not {sample}")
    if sample == 1:
        return [True] * length
    rng = random.Random(seed)
    return [rng.random() * sample < 1 for _ in range(length)]


def round_robin_counts(records: int, partitions: int) -> list[int]:
    """How many of ``records`` records sent round-robin land in each partition."""
    return [records // partitions + (1 if p < records % partitions else 0)
            for p in range(partitions)]


def offset_errors(timed: Sequence[int], partitions: int, before: Sequence[int],
                  delivered: Sequence[tuple[int, int]]) -> str | None:
    """Whether ``delivered`` (partition, offset) pairs are exactly those of the ``timed``
    records (indices in the phase, round-robin after ``before[p]`` records); else why not."""
    expected = sorted((s % partitions, before[s % partitions] + s // partitions) for s in timed)
    got = sorted(delivered)
    if got == expected:
        return None
    missing, extra = len(set(expected) - set(got)), len(set(got) - set(expected))
    return (f"the timed records' offsets do not match the records produced "
            f"({missing} expected offsets missing, {extra} unexpected): "
            "records were lost or written twice")


def paced_phase(spec: Mapping[str, Any], config: Mapping[str, Any], values: Sequence[bytes],
                sampler: CpuSampler, offered: float, sent_before: Sequence[int],
                warm_up: Callable[[Any], int]) -> dict[str, Any]:
    """Offer ``offered`` records/s for ``spec["latency_seconds"]``; latencies and CPU.

    ``sent_before`` are the runs of records sent to the topic before this phase, each
    run round-robin from partition 0; ``warm_up`` produces and flushes the warm-up
    records (one more such run) on a producer and returns how many it produced.
    """
    from confluent_kafka import Producer

    topic, partitions = spec["topic"], spec["partitions"]
    sample = int(spec.get("latency_sample", 1))
    pattern = sampling_pattern(sample)
    n_pattern, n_values = len(pattern), len(values)
    errors: list[str] = []
    latencies: list[float] = []
    delivered: list[tuple[int, int]] = []
    timed: list[int] = []  # indices in the phase of the records produced with on_timed

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            if len(errors) < 5:
                errors.append(str(err))
            return
        latency = msg.latency()
        if latency is not None:
            latencies.append(latency)

    def on_timed(err: Any, msg: Any) -> None:
        on_delivery(err, msg)
        if err is None:
            delivered.append((msg.partition(), msg.offset()))

    paced = Producer({**config, "on_delivery": on_delivery} if sample == 1 else dict(config))
    runs = [*sent_before, warm_up(paced)]
    in_partition = [sum(round_robin_counts(n, partitions)[p] for n in runs)
                    for p in range(partitions)]
    latencies.clear()
    total = max(int(offered * spec["latency_seconds"]), 1)
    tail = total - TIMED_TAIL
    produce, poll = paced.produce, paced.poll
    tick = 0.001
    before = sampler.sample()
    start = time.perf_counter()
    sent = 0
    while sent < total:
        now = time.perf_counter()
        due = min(total, int((now - start) * offered) + 1)
        while sent < due:
            try:
                if sample == 1 or not (pattern[sent % n_pattern] or sent >= tail):
                    produce(topic, values[sent % n_values], partition=sent % partitions)
                else:
                    produce(topic, values[sent % n_values], partition=sent % partitions,
                            on_delivery=on_timed)
                    timed.append(sent)
            except BufferError:
                poll(0.001)
                continue
            sent += 1
        poll(0)
        pause = start + sent / offered - time.perf_counter()
        if pause > 0:
            time.sleep(max(pause, tick))
    produced_in = time.perf_counter() - start
    left = paced.flush(120)
    paced_seconds = time.perf_counter() - start
    paced_cpu = CpuSampler.delta(before, sampler.sample())
    if left:
        errors.append(f"{left} paced records not delivered after flush")
    result: dict[str, Any] = dict(
        paced_records=total, paced_seconds=paced_seconds,
        paced_rps=total / produced_in if produced_in > 0 else None,
        paced_cpu=paced_cpu, latencies=len(latencies), latency_sample=sample)
    if latencies:
        ms = [v * 1000 for v in latencies]
        result.update(p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
                      p999_ms=percentile(ms, 99.9))
    if sample > 1 and not errors:
        mismatch = offset_errors(timed, partitions, in_partition, delivered)
        if mismatch:
            errors.append(mismatch)
    if errors:
        result["error"] = f"latency phase: {errors[0]}"
    return result
