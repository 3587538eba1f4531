"""The neighbours benchmark's pure parts: latency summaries, batch shapes, pairing, rendering.

No timing here: the harness's measurements are checked by running it, not by tests.
"""

from __future__ import annotations

import pytest
import support.bench  # noqa: F401  (bench/ is not an installed package)

from bench.neighbours_stats import (
    BatchCost,
    BatchShape,
    Latency,
    Run,
    added_p99,
    batch_shape,
    fill_run,
    latency_summary,
    proxy_ms_per_batch,
    reading,
    render_comparison,
    render_table,
    summarize,
)
from bench.proxy.cpu import CpuSampler


def _run(path: str, large: bool, round_: int, p99: float, *, proxy_cpu: float | None = None,
         mbps: float | None = None, records: float = 1000.0, error: str | None = None) -> Run:
    return Run(path=path, large=large, round=round_, seconds=10.0, small_rps=1000.0,
               latency=Latency(count=10_000, p50_ms=1.0, p99_ms=p99, p999_ms=p99 * 2,
                               max_ms=p99 * 3),
               proxy_cpu=proxy_cpu, broker_cpu=2.0, other_cpu=1.0, large_mbps=mbps,
               large_batch=BatchShape(batches=100, records=records, wire_bytes=300_000)
               if large else None, error=error)


def _rounds() -> list[Run]:
    return [
        _run("kiproxy", False, 0, 2.0, proxy_cpu=2.0), _run("kiproxy", True, 0, 6.0,
                                                          proxy_cpu=7.0, mbps=50.0),
        _run("direct", False, 0, 1.5), _run("direct", True, 0, 2.5, mbps=100.0),
        _run("kiproxy", False, 1, 3.0, proxy_cpu=2.0), _run("kiproxy", True, 1, 5.0,
                                                          proxy_cpu=7.0, mbps=50.0),
        _run("direct", False, 1, 1.5), _run("direct", True, 1, 3.5, mbps=100.0),
    ]


def test_latency_summary_percentiles_and_max() -> None:
    summary = latency_summary([float(v) for v in range(1, 101)])
    assert summary is not None
    assert summary.count == 100
    assert summary.p50_ms == pytest.approx(50.5)
    assert summary.p99_ms == pytest.approx(99.01)
    assert summary.max_ms == 100.0
    assert latency_summary([]) is None


def test_batch_shape_adds_window_statistics_across_emissions() -> None:
    def emission(batches: int, records: int, size: int) -> dict[str, object]:
        return {"topics": {"large": {"batchcnt": {"cnt": batches, "sum": records},
                                     "batchsize": {"cnt": batches, "sum": size}},
                           "other": {"batchcnt": {"cnt": 99, "sum": 1}}}}

    shape = batch_shape([emission(2, 2000, 600_000), {"topics": {}},
                         emission(1, 700, 150_000)], "large")
    assert shape == BatchShape(batches=3, records=900.0, wire_bytes=250_000.0)
    assert batch_shape([{"topics": {}}], "large") is None


def test_fill_run_reads_both_reports_and_keeps_their_errors() -> None:
    run = Run(path="kiproxy", large=True, round=0)
    small = {"records": 4000, "seconds": 4.0, "error": None,
             "cpu": {"proxy": 1.0, "broker": 0.5, "other": 0.25},
             "latency": {"count": 4000, "p50_ms": 1.0, "p99_ms": 2.0, "p999_ms": 3.0,
                         "max_ms": 4.0}}
    large = {"mbps": 70.0, "batch": {"batches": 10, "records": 960.0, "wire_bytes": 3e5},
             "error": "Broker: Invalid record"}
    fill_run(run, small, large)
    assert run.latency is not None and run.latency.p99_ms == 2.0
    assert run.small_rps == 1000.0
    assert (run.proxy_cpu, run.broker_cpu, run.other_cpu) == (1.0, 0.5, 0.25)
    assert run.large_mbps == 70.0 and run.large_batch is not None
    assert run.error == "large producer: Broker: Invalid record"
    assert not run.ok


def test_added_p99_pairs_each_round_and_skips_incomplete_ones() -> None:
    runs = [*_rounds(), _run("kiproxy", True, 2, 50.0), _run("kiproxy", False, 3, 1.0,
                                                              error="broker did not start")]
    added, pairs = added_p99(runs, "kiproxy")
    assert pairs == [4.0, 2.0]
    assert added == 3.0
    assert added_p99(runs, "direct") == (1.5, [1.0, 2.0])
    assert added_p99([], "kiproxy") == (None, [])


def test_summarize_one_row_per_path_alone_then_beside() -> None:
    rows = summarize([*_rounds(), _run("direct", True, 2, 900.0, error="failed")])
    assert [(r.path, r.large) for r in rows] == [
        ("kiproxy", False), ("kiproxy", True), ("direct", False), ("direct", True)]
    beside = rows[1]
    assert beside.p99_ms == 5.5 and beside.large_mbps == 50.0 and beside.batch_kb == 300.0
    assert beside.proxy_cores == pytest.approx(0.7)
    assert rows[3].runs == 3 and rows[3].ok_runs == 2 and rows[3].p99_ms == 3.0
    assert rows[2].proxy_cores is None


def test_proxy_ms_per_batch_from_the_runs() -> None:
    # 0.5 extra cores for 50 MB/s of 1,000-record 1 KiB batches (48.8 batches/s).
    assert proxy_ms_per_batch(summarize(_rounds())) == pytest.approx(0.5 / (50e6 / 1024e3)
                                                                     * 1000)
    assert proxy_ms_per_batch(summarize(_rounds()[2:4])) is None


def test_render_table_has_a_row_per_path_and_dashes_for_missing_figures() -> None:
    table = render_table(summarize(_rounds()))
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| kiproxy | no | 1.00 | 2.50 |")
    assert "| 50.0 | 1,000 | 300 | 0.70 |" in lines[3]
    assert lines[4].startswith("| direct | no |") and "| - |" in lines[4]


def test_comparison_and_reading_set_the_added_p99_against_one_batch() -> None:
    cost = BatchCost(records=1000, request_bytes=300_000, ms=4.0)
    text = render_comparison(_rounds(), cost)
    assert "through kiproxy: +3.00 ms (per round: +4.00, +2.00)" in text
    assert "direct:          +1.50 ms" in text
    assert "kiproxy's share (through kiproxy minus direct):         +1.50 ms" in text
    assert "kiproxy's share / one batch's cost: 0.38 (within one batch)" in text
    assert "through kiproxy / one batch's cost: 0.75 (within one batch)" in text
    words = reading(_rounds(), cost)
    assert "from 2.50 ms alone to 5.50 ms beside the large producer (+3.00 ms" in words
    assert "Kiproxy's share, +1.50 ms, is within one batch's cost" in words
    over = reading(_rounds(), BatchCost(records=1000, request_bytes=300_000, ms=1.0))
    assert "is more than one batch's cost" in over
    assert "not measured" in render_comparison(_rounds(), None)
    assert reading([], cost).startswith("No round completed")


def test_cpu_sampler_delta_counts_what_the_named_processes_did_not_use_as_other() -> None:
    before = {"proxy": 1.0, "proxy_user": 0.8, "self": 0.5, "machine": 10.0}
    after = {"proxy": 3.0, "proxy_user": 2.0, "self": 1.0, "machine": 14.0}
    delta = CpuSampler.delta(before, after)
    assert delta["proxy"] == 2.0 and delta["self"] == 0.5
    assert delta["other"] == 1.5
    assert CpuSampler.delta({**before, "proxy": None}, after)["other"] is None
