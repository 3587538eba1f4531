"""The report of one replay: ``summary.json``, ``chart.png`` and ``index.html``.

The summary is built by :func:`kiproxy.pipelines.replay.run_replay`; this
module only writes it down and renders it. Nothing in a summary is secret: the
cluster's settings appear as :meth:`ClientSecurity.describe` says them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiproxy.pipelines.charts import bar_chart
from kiproxy.pipelines.html_pages import page, table

__all__ = ["write_replay_report"]


def _count(value: int | None) -> str | int:
    return "not counted by this reader" if value is None else value


def write_replay_report(summary: Mapping[str, Any], report_dir: Path) -> None:
    """``summary.json``, ``chart.png`` and ``index.html`` into ``report_dir``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=False)
                                             + "\n")
    labels, passed, transformed, rejected = [], [], [], []
    for topic, t in summary["topics"].items():
        for partition, p in t["partitions"].items():
            labels.append(f"{topic}[{partition}]")
            passed.append(p["passed_records"] - p["transformed_records"])
            transformed.append(p["transformed_records"])
            rejected.append(p["rejected_records"])
    bar_chart(report_dir / "chart.png", "Records per topic-partition", labels,
              {"passed unchanged": passed, "transformed": transformed, "rejected": rejected},
              ylabel="records", horizontal=len(labels) > 12)

    totals = table(["", "batches", "records"], [
        ("seen", summary["batches"], summary["records"]),
        ("transformed", summary["transformed_batches"], summary["transformed_records"]),
        ("rejected", summary["rejected_batches"], summary["rejected_records"]),
        ("written to the output", "", summary["written_records"]),
        ("aborted records skipped", "", _count(summary.get("aborted_records_skipped"))),
        ("transaction markers skipped", _count(summary.get("control_batches_skipped")), ""),
    ])
    run_rows = [
        ("mode", summary["mode"]), ("interceptor", summary["interceptor"]),
        ("bootstrap", f"{summary['bootstrap']} ({summary.get('security', 'PLAINTEXT')})"),
        ("topics", ", ".join(summary["topic_list"])),
        ("from / to", f"{summary['from_offsets']} / {summary['to_offsets']}"),
        ("reader", f"{summary['reader']} ({summary['batching']})"),
        ("isolation level", summary.get("isolation_level", "read_uncommitted")),
        ("output", json.dumps(summary["output"]) if summary["output"] else "none (dry run)"),
        ("Spark", f"{summary['spark_version']} on {summary['spark_master']}, "
                  f"{summary['tasks']} tasks"),
        ("duration", f"{summary['duration_s']} s ({summary.get('records_per_s')} records/s)"),
    ]
    partitions = [
        (topic, int(partition), p["start_offset"], p["end_offset"], p["batches"], p["records"],
         p["transformed_records"], p["rejected_batches"], p["rejected_records"],
         _count(p.get("aborted_records_skipped")))
        for topic, t in summary["topics"].items() for partition, p in t["partitions"].items()
    ]
    reasons = [
        (r["error"], r["message"], r["batches"], r["records"],
         ", ".join(f"{s['topic']}[{s['partition']}]@{s['offset']}" for s in r["samples"]))
        for r in summary["reasons"]
    ]
    html_text = page("kiproxy replay report", [
        ("Run", table(["setting", "value"], run_rows)),
        ("Totals", totals),
        ("Records per topic-partition", '<img src="chart.png" alt="records per partition">'),
        ("Partitions", table(["topic", "partition", "start", "end", "batches", "records",
                              "transformed records", "rejected batches", "rejected records",
                              "aborted records skipped"],
                             partitions)),
        ("Rejection reasons", table(["error", "message", "batches", "records",
                                     "sample records (topic[partition]@offset)"], reasons)
         + '<p class="note">Every rejected record is listed in <code>rejected/</code> '
           "(JSON Lines).</p>"),
    ])
    (report_dir / "index.html").write_text(html_text)
