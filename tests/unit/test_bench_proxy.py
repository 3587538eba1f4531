"""The proxy benchmark's pure parts: statistics, /proc parsing, tables and targets.

No timing here: the harness's measurements are checked by running it, not by tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support.bench  # bench/ is not an installed package: this makes it importable

from bench.proxy.cpu import parse_proc_stat
from bench.proxy.matrix import paced_load, rotated, split_cpus, summarize_collapsed
from bench.proxy.render import render_rounds, render_table, render_targets
from bench.proxy.run import pinned
from bench.proxy.scenarios import SCENARIOS, Case, readme_plugin
from bench.proxy.stats import (
    RunResult,
    Summary,
    Target,
    TargetCheck,
    contention_note,
    cpu_bound_ratio,
    cpu_per_gb,
    cpu_per_million,
    evaluate_targets,
    haproxy_config,
    json_values,
    median,
    millicores_per_mbps,
    percentile,
    ratio,
    summarize,
)
from bench.results import replace_section

KIB = Case(1024, "none")


def _run(scenario: str, round_: int, rps: float, p99: float | None = 2.0,
         proxy_cpu: float | None = None, case: Case = KIB, **kw: object) -> RunResult:
    # ``rps`` records in one second.
    return RunResult(scenario=scenario, case=case, round=round_, records=int(rps), seconds=1.0,
                     proxy_cpu=proxy_cpu, p50_ms=1.0, p99_ms=p99, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- statistics


def test_median_ignores_missing_values() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0]) == 2.5
    assert median([None, None]) is None
    assert median([]) is None


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input


def test_percentile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_ratio_is_none_without_a_baseline() -> None:
    assert ratio(9.0, 10.0) == pytest.approx(0.9)
    assert ratio(None, 10.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


# --------------------------------------------------------------------------- CPU


def test_parse_proc_stat_reads_utime_and_stime() -> None:
    line = ("4242 (python3) S 1 4242 4242 0 -1 4194560 12345 0 0 0 "
            "1500 250 0 0 20 0 3 0 123456 1000000 5000 18446744073709551615")
    assert parse_proc_stat(line) == (1500, 250)


def test_parse_proc_stat_survives_spaces_and_parentheses_in_the_name() -> None:
    line = ("77 (kiproxy (worker) 1) R 1 77 77 0 -1 0 0 0 0 0 "
            "31 7 0 0 20 0 1 0 99 0 0")
    assert parse_proc_stat(line) == (31, 7)


def test_parse_proc_stat_rejects_other_text() -> None:
    with pytest.raises(ValueError, match="no '\\)'"):
        parse_proc_stat("not a stat line")
    with pytest.raises(ValueError, match="fields"):
        parse_proc_stat("1 (x) S 1 2 3")


def test_cpu_per_gb_and_per_million_records() -> None:
    assert cpu_per_gb(2.0, 500_000_000) == pytest.approx(4.0)
    assert cpu_per_million(3.0, 1_500_000) == pytest.approx(2.0)
    assert cpu_per_gb(None, 1) is None
    assert cpu_per_gb(1.0, 0) is None
    assert cpu_per_million(1.0, 0) is None


def test_millicores_per_mbps_equals_cpu_seconds_per_gb() -> None:
    # 0.5 cores for 10 s while carrying 100 MB/s: 500 millicores / 100 MB/s.
    assert millicores_per_mbps(5.0, 10.0, 1_000_000_000) == pytest.approx(5.0)
    assert cpu_per_gb(5.0, 1_000_000_000) == pytest.approx(5.0)
    assert millicores_per_mbps(None, 1.0, 1) is None
    assert millicores_per_mbps(1.0, 0.0, 1) is None


def test_cpu_bound_ratio() -> None:
    assert cpu_bound_ratio(6.0, 0.0) == 1.0
    assert cpu_bound_ratio(6.0, 2.0) == pytest.approx(0.75)
    assert cpu_bound_ratio(None, 1.0) is None


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("size", [64, 100, 1024, 4096])
def test_json_values_are_distinct_lower_case_json_of_the_exact_size(size: int) -> None:
    values = json_values(size, 200)
    assert len(set(values)) == 200
    for value in values:
        assert len(value) == size
        doc = json.loads(value)
        assert isinstance(doc["id"], int) and isinstance(doc["kind"], str)
        assert value == value.lower()


def test_json_values_too_short_to_hold_the_required_fields() -> None:
    with pytest.raises(ValueError, match="as short as"):
        json_values(20, 1)


def test_haproxy_config_is_one_tcp_frontend_to_the_broker() -> None:
    text = haproxy_config(19092, 9092)
    assert "mode tcp" in text
    assert "nbthread 1" in text
    assert "bind 127.0.0.1:19092" in text
    assert "server tansu 127.0.0.1:9092" in text


def test_rotated_starts_each_round_elsewhere() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []


def test_every_scenario_is_described() -> None:
    assert next(iter(SCENARIOS)) == "direct"
    assert {s.kind for s in SCENARIOS.values()} == {"direct", "haproxy", "forwarder", "kiproxy"}
    assert all(s.description for s in SCENARIOS.values())


# --------------------------------------------------------------------------- summaries


def test_summarize_pairs_each_round_with_direct() -> None:
    results = [
        _run("direct", 0, 100_000, p99=2.0), _run("passthrough", 0, 90_000, p99=2.5),
        _run("direct", 1, 200_000, p99=3.0), _run("passthrough", 1, 190_000, p99=3.1),
        _run("direct", 2, 100_000, p99=2.0), _run("passthrough", 2, 50_000, p99=4.0),
    ]
    rows = {s.scenario: s for s in summarize(results)}
    p = rows["passthrough"]
    # per-round ratios 0.90, 0.95, 0.50 -> median 0.90 (a ratio of medians would say 0.90 too,
    # but the pairs are what interleaving is for)
    assert p.vs_direct == pytest.approx(0.90)
    assert p.rps == 90_000
    assert p.mbps == pytest.approx(90_000 * 1024 / 1e6)
    assert p.p99_added_ms == pytest.approx(0.5)  # +0.5, +0.1, +2.0
    assert rows["direct"].vs_direct == pytest.approx(1.0)
    assert p.runs == p.ok_runs == 3


def test_summarize_added_latency_without_pairs_compares_medians() -> None:
    # Round 0: the proxy was over capacity; round 1: direct was. No pair, so medians.
    results = [_run("direct", 0, 100_000, p99=2.0),
               _run("passthrough", 0, 40_000, p99=None, saturated=True),
               _run("direct", 1, 30_000, p99=None, saturated=True),
               _run("passthrough", 1, 90_000, p99=3.5)]
    (row,) = [s for s in summarize(results) if s.scenario == "passthrough"]
    assert row.p99_added_ms == pytest.approx(1.5)
    assert row.saturated_runs == 1


def test_summarize_leaves_failed_runs_out_of_the_medians() -> None:
    failed = _run("uppercase", 1, 0, error="broker exited with code 1")
    results = [_run("direct", 0, 100_000), _run("uppercase", 0, 80_000), failed,
               _run("direct", 1, 100_000)]
    (row,) = [s for s in summarize(results) if s.scenario == "uppercase"]
    assert row.runs == 2 and row.ok_runs == 1
    assert row.vs_direct == pytest.approx(0.8)
    assert "broker exited" in row.note


def test_summarize_cpu_figures() -> None:
    # 100,000 x 1 KiB = 102.4 MB in one second with 0.2 CPU s: 1.95 s/GB, 2 s per M records
    results = [_run("direct", 0, 100_000), _run("passthrough", 0, 100_000, proxy_cpu=0.2)]
    (row,) = [s for s in summarize(results) if s.scenario == "passthrough"]
    assert row.cpu_s_per_gb == pytest.approx(0.2 * 1e9 / 102_400_000)
    assert row.cpu_s_per_mrec == pytest.approx(2.0)


def test_summarize_lists_unavailable_scenarios() -> None:
    rows = summarize([_run("direct", 0, 1000)], {"haproxy": "haproxy not installed"},
                     ["direct", "haproxy"])
    assert [(s.scenario, s.runs, s.note) for s in rows] == [
        ("direct", 1, ""), ("haproxy", 0, "haproxy not installed")]


# --------------------------------------------------------------------------- rendering


def test_render_table_has_one_row_per_summary() -> None:
    rows = [
        Summary(scenario="direct", case=KIB, runs=3, ok_runs=3, rps=250_000, mbps=256.0,
                vs_direct=1.0, p50_ms=5.1, p99_ms=9.0, p99_added_ms=0.0),
        Summary(scenario="passthrough", case=KIB, runs=3, ok_runs=3, rps=230_000,
                mbps=235.5, vs_direct=0.92, p50_ms=5.6, p99_ms=9.8, p99_added_ms=0.8,
                cpu_s_per_gb=1.1, cpu_s_per_mrec=1.2, paced_cpu_s_per_gb=1.6,
                cpu_vs_haproxy=1.8),
        Summary(scenario="validator", case=KIB, runs=3, ok_runs=3, rps=40_000, mbps=41.0,
                vs_direct=0.16, saturated_runs=3, cpu_s_per_gb=23.0),
        Summary(scenario="haproxy", case=KIB, runs=0, ok_runs=0,
                note="haproxy not installed (apt-get install haproxy); skipped"),
    ]
    lines = render_table(rows).splitlines()
    assert lines[0].startswith("| records | codec | scenario | rec/s | MB/s | x direct |")
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 1 KiB | none | passthrough | 230,000 | 235.5 | 0.92 | 5.60 | 9.80 | +0.80 | " \
           "1.1 | 1.8 | 1.2 | 1.6 | 3/3 |" in lines
    assert "over capacity" in lines[4]
    assert "haproxy not installed" in lines[5] and "n/a" in lines[5]


def test_render_rounds_pairs_each_round_with_direct() -> None:
    results = [
        _run("direct", 0, 100_000, p99=9.0, producer_cpu=0.5),
        _run("uppercase", 0, 50_000, p99=20.0, producer_cpu=0.5),  # capacity round: no p99
        _run("direct", 1, 100_000, p99=8.5, producer_cpu=0.7),
        _run("uppercase", 1, 50_000, p99=17.5, producer_cpu=0.45),
        _run("direct", 2, 100_000, p99=9.0, producer_cpu=0.6),
        _run("passthrough", 2, 100_000, p99=None, saturated=True),
        _run("uppercase", 2, 50_000, p99=10.0, producer_cpu=0.3),
    ]
    results[1].p99_ms = None
    lines = render_rounds(results, ["direct", "passthrough", "uppercase"]).splitlines()
    assert lines[0] == ("| records | codec | round | direct p99 ms | passthrough +ms (producer "
                        "us/rec) | uppercase +ms (producer us/rec) |")
    assert lines[2:] == ["| 1 KiB | none | 0 | 9.00 (5.00) | - | - |",
                         "| 1 KiB | none | 1 | 8.50 (7.00) | - | +9.00 (9.00) |",
                         "| 1 KiB | none | 2 | 9.00 (6.00) | - | +1.00 (6.00) |"]


def test_case_labels() -> None:
    assert Case(1024, "none").label == "1 KiB"
    assert Case(100, "lz4").label == "100 B"


def test_targets_pass_and_miss_with_margins() -> None:
    rows = [
        Summary(scenario="passthrough", case=KIB, runs=3, ok_runs=3, vs_direct=0.97,
                cpu_s_per_gb=12.0, p99_added_ms=0.4, cpu_vs_haproxy=1.5),
        Summary(scenario="uppercase", case=KIB, runs=3, ok_runs=3, vs_direct=0.6,
                cpu_s_per_gb=3.0, p99_added_ms=2.0),
        Summary(scenario="identity", case=Case(100, "none"), runs=3, ok_runs=3, vs_direct=1.0,
                p99_added_ms=2.5),
    ]
    checks = {(c.target.scenario, c.target.metric, c.target.case): c
              for c in evaluate_targets(rows)}
    b100 = Case(100, "none")
    assert checks[("passthrough", "vs_direct", KIB)].passed is True
    assert checks[("passthrough", "cpu", KIB)].passed is False
    assert checks[("passthrough", "p99_added_ms", KIB)].passed is True
    assert checks[("passthrough", "cpu_vs_haproxy", KIB)].passed is False
    assert checks[("uppercase", "vs_direct", KIB)].passed is False
    assert checks[("uppercase", "cpu", KIB)].passed is True
    assert checks[("uppercase", "p99_added_ms", KIB)].passed is True  # at the bound of 2
    assert checks[("identity", "p99_added_ms", b100)].passed is False
    assert checks[("identity", "vs_direct", KIB)].passed is None  # only 100 B was summarized
    # Targets of a size and codec that did not run are left out, not "n/a".
    assert not any(case.codec != "none" for _, _, case in checks)
    text = render_targets(list(checks.values()))
    assert "PASS  passthrough 1 KiB none: throughput / direct >= 0.95: measured 0.97, " \
           "ahead by 0.02" in text
    assert "MISS  passthrough 1 KiB none: proxy millicores per MB/s <= 10: measured 12.00, " \
           "short by 2.00" in text
    assert "MISS  passthrough 1 KiB none: proxy CPU per GB / haproxy's <= 1.2: measured " \
           "1.50" in text
    assert "MISS  identity 100 B none: p99 latency added (ms) <= 2: measured 2.50" in text
    assert "n/a   identity 1 KiB none: throughput / direct >= 0.9: not measured" in text


def test_summarize_pairs_cpu_with_haproxy_per_round() -> None:
    results = [_run("haproxy", 0, 100_000, proxy_cpu=1.0), _run("uppercase", 0, 100_000,
                                                                 proxy_cpu=3.0),
               _run("haproxy", 1, 100_000, proxy_cpu=2.0), _run("uppercase", 1, 100_000,
                                                                 proxy_cpu=4.0)]
    rows = {s.scenario: s for s in summarize(results)}
    assert rows["uppercase"].cpu_vs_haproxy == pytest.approx(2.5)  # 3x and 2x
    assert rows["haproxy"].cpu_vs_haproxy is None


def test_paced_load_is_a_fraction_of_the_slowest_chosen_scenario() -> None:
    b100 = Case(100, "none")
    capacity = [_run("direct", 0, 100_000), _run("uppercase", 0, 60_000),
                _run("validator", 0, 20_000), _run("direct", 0, 300_000, case=b100),
                _run("uppercase", 0, 0, case=b100, error="failed")]
    assert paced_load(capacity, 0.5, ["direct", "uppercase"]) == {KIB: 30_000,
                                                                  b100: 150_000}
    assert paced_load(capacity, 0.5, ["direct", "uppercase", "validator"])[KIB] == 10_000


def test_target_check_at_the_bound_passes() -> None:
    assert TargetCheck(Target("passthrough", "vs_direct", 0.95, True), 0.95).passed
    assert TargetCheck(Target("passthrough", "cpu", 10, False), 10.0).passed


def test_contention_note_explains_ratios_by_cpu() -> None:
    rows = [Summary(scenario="direct", case=KIB, runs=3, ok_runs=3, mbps=300.0,
                    stack_cpu_s_per_gb=6.0),
            Summary(scenario="passthrough", case=KIB, runs=3, ok_runs=3, vs_direct=0.85,
                    cpu_s_per_gb=1.0)]
    note = contention_note(rows)
    assert "6.0 CPU s/GB" in note
    assert "p <= 0.32 s/GB" in note  # 6 * (1/0.95 - 1)
    assert "passthrough: p = 1.00 s/GB -> CPU-bound ratio 0.86, measured 0.85" in note
    assert contention_note([]) == ""


# --------------------------------------------------------------------------- RESULTS.md


def test_replace_section_rewrites_only_between_its_markers() -> None:
    doc = ("# Benchmark results\n\nintro\n\n<!-- bench:codec -->\n## Codec\n\nc\n"
           "<!-- /bench:codec -->\n\n<!-- bench:proxy -->\n## Proxy\n\nold\n"
           "<!-- /bench:proxy -->\n\nafter\n")
    new = replace_section(doc, "proxy", "## Proxy\n\nnew table\n")
    assert new == doc.replace("## Proxy\n\nold\n", "## Proxy\n\nnew table\n")
    assert replace_section(new, "proxy", "## Proxy\n\nnew table\n") == new


def test_replace_section_appends_a_marked_section_when_missing() -> None:
    doc = "# R\n\n<!-- bench:codec -->\nc\n<!-- /bench:codec -->\n"
    assert replace_section(doc, "perf-test", "## Perf\n\nx\n\n") == \
        doc + "\n<!-- bench:perf-test -->\n## Perf\n\nx\n<!-- /bench:perf-test -->\n"
    with pytest.raises(ValueError, match="lower case"):
        replace_section(doc, "## Proxy", "x")


def test_results_md_has_a_marked_section_per_bench_that_writes_one() -> None:
    text = (Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md").read_text()
    for name in ("codec", "isolation", "proxy", "routes", "reload", "intercept", "neighbours",
                 "perf-test"):
        assert text.count(f"<!-- bench:{name} -->") == 1, name
        assert text.count(f"<!-- /bench:{name} -->") == 1, name



def test_summarize_collapsed_stacks() -> None:
    raw = "main;loop;read 30\nmain;loop;handle;decode 50\nmain;loop;handle 20\nbad line\n"
    text = summarize_collapsed(raw, top=3)
    assert text.splitlines()[0] == "100 samples"
    own = text.split("total (inclusive) time:")[0]
    assert "50.0%  decode" in own and "30.0%  read" in own
    total = text.split("total (inclusive) time:")[1]
    assert "100.0%  main" in total or "100.0%  loop" in total
    assert summarize_collapsed("") == "no samples"


def test_the_readme_plugin_is_benchmarked_as_printed(tmp_path: Path) -> None:
    """The ``no_secrets`` scenario runs the README's block itself, and with the
    scenario's word it rewrites every value the benchmark sends."""
    from kiproxy.interceptors.testing import load, make_batch, run_interceptor

    module = readme_plugin(tmp_path)
    assert module.read_text() in (support.bench.ROOT / "README.md").read_text()
    scenario = SCENARIOS["no_secrets"]
    plugin = load(scenario.interceptor or "", plugins_dir=tmp_path,
                  config=scenario.interceptor_config)
    values = json_values(100, 50)
    outcome = run_interceptor(plugin, make_batch(*values, topic="bench"))
    assert outcome.kind == "transformed", outcome
    assert scenario.stored_prefix is not None
    assert all(r.value is not None and r.value.startswith(scenario.stored_prefix.encode())
               for r in outcome.records)
    assert [(r.value or b"").replace(b"***", b"id") for r in outcome.records] == values


def test_the_default_matrix_leaves_out_opt_in_scenarios() -> None:
    """``pii`` paces nothing and measures scaling: it runs only when named."""
    from bench.proxy.matrix import _parser

    default = _parser().parse_args([]).scenarios.split(",")
    assert "pii" in SCENARIOS and "pii" not in default
    assert {"direct", "haproxy", "uppercase", "readme", "no_secrets"} <= set(default)
    assert _parser().parse_args(["--scenarios", "direct,pii"]).scenarios == "direct,pii"


def test_split_cpus_reads_lists_and_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert split_cpus("1") == {1}
    assert split_cpus("2,3") == {2, 3}
    assert split_cpus("1-3") == {1, 2, 3}


@pytest.mark.parametrize("text", ["", "x", "1-", "0-3", "0,1,2,3", "7"])
def test_split_cpus_refuses_what_leaves_no_cpu_or_is_not_a_cpu(
        monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(ValueError, match="--proxy-cpus"):
        split_cpus(text)


def test_pinned_confines_the_child_and_what_it_starts() -> None:
    assert pinned(None) is None and pinned(set()) is None
    cpu = min(os.sched_getaffinity(0))
    script = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
              "print(subprocess.run([sys.executable, '-c', 'import os; "
              "print(sorted(os.sched_getaffinity(0)))'], capture_output=True, "
              "text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, preexec_fn=pinned({cpu})).stdout.split()
    assert out == [f"[{cpu}]", f"[{cpu}]"]


def test_the_results_section_is_the_report_without_its_details() -> None:
    from bench.proxy.render import section
    from bench.proxy.run import Options

    runs = [_run(s, r, 1000, proxy_cpu=0.1) for s in ("direct", "passthrough") for r in (0, 1)]
    summaries = summarize(runs, [], ["direct", "passthrough"])
    options = Options(records={1024: 1000}, warmup=10, latency_seconds=1, load_fraction=0.5,
                      partitions=3, acks="1", linger_ms=5, max_in_flight=5, proxy_flags=[])
    scenarios = [SCENARIOS[n] for n in ("direct", "passthrough")]
    kw: dict[str, Any] = dict(command="python -m bench.proxy", results=runs, options=options,
                              repeats=2, scenarios=scenarios, load="low", notes=[],
                              code="commit x")
    full = section(summaries, evaluate_targets(summaries), **kw)
    short = section(summaries, evaluate_targets(summaries), details=False, **kw)
    assert full.startswith(short.rstrip("\n"))
    assert "| passthrough |" in short and "Command: `python -m bench.proxy`" in short
    assert "Targets" in full and "Targets" not in short


def test_the_uvloop_forwarder_copies_both_ways_and_closes_the_other_side(
        tmp_path: Path) -> None:
    """bench.proxy.forwarder joins each client to a new upstream connection: bytes sent
    before the upstream answered reach it, answers come back, and a client that closes
    closes its upstream connection."""
    import socket

    upstream = socket.create_server(("127.0.0.1", 0))
    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    listen.close()  # the forwarder takes the port
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.proxy.forwarder", str(port),
         str(upstream.getsockname()[1])],
        cwd=support.bench.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        client.sendall(b"early")  # before the forwarder's upstream connection is accepted
        upstream.settimeout(10)
        broker, _ = upstream.accept()
        broker.settimeout(10)
        got = b""
        while len(got) < 5:
            got += broker.recv(100)
        assert got == b"early"
        broker.sendall(b"x" * 300_000)
        received = 0
        while received < 300_000:
            received += len(client.recv(65536))
        assert received == 300_000
        client.close()
        assert broker.recv(100) == b""  # the client's close reached the broker's side
        broker.close()
    finally:
        proc.terminate()
        proc.wait(10)
        upstream.close()
