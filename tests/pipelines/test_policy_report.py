"""The policy section of ``kiproxy report`` over the audit files of observe and enforce routes,
and a replay dry run over the same topic's history beside the live figures.

The audit files are written by the proxy's own audit writer (``AuditLog`` fed with
``produce_events`` of ``ResponseInfo`` values), so the report reads exactly what
the proxy writes; the observe-mode fields are set on ``PartitionSummary`` where it
has them and added to the events otherwise. Every figure is checked against the
counts this test produced. Spark runs locally on loopback (the package's session).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors.observer import PartitionSummary, RequestInfo, ResponseInfo
from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.impact import (
    LiveFigures,
    ReplaySpec,
    ReplaySummary,
    compare,
    parse_replay_arg,
    pick_route,
)
from kiproxy.protocol.records import Record, build_batch
from kiproxy.proxy.observe.audit import AuditLog, produce_events
from kiproxy_dev.tansu import EmbeddedBroker

from .test_pipelines import PLUGINS, create_topic, kiproxy, produce_raw

pytestmark = pytest.mark.timeout(240)

HOUR = 3_600_000
DAY = 24 * HOUR
LIVE_START = 1_763_798_400_000  # 2025-11-22T08:00:00Z
HISTORY_START = LIVE_START - 7 * DAY
CLIENTS = (("orders-svc", "User:orders"), ("billing-svc", "User:billing"))
AMOUNT = ("policies:AmountCheck", "amount is negative")
CURRENCY = ("policies:CurrencyCheck", "currency missing")
_NATIVE = {f.name for f in dataclasses.fields(PartitionSummary)}


def live_events(history_topic: str) -> list[dict[str, Any]]:
    """Three hours of produce events: route ``watch`` observes ``history_topic`` and
    ``trial``, route ``guard`` enforces on ``payments``, route ``layered`` enforces on
    ``ledger`` with a link of its own in observe mode, route ``sampled`` observes
    ``clicks`` with ``observe_sample`` (every other batch judged), ``other`` matches no
    route."""
    out: list[dict[str, Any]] = []
    for h in range(3):
        for j in range(4):
            for c, (client, principal) in enumerate(CLIENTS):
                ts = LIVE_START + h * HOUR + j * 60_000 + c
                common = {"ts": ts, "client_id": client, "principal": principal}
                watch: dict[str, Any] = {**common, "route": "watch", "records": 5 + j,
                                         "outcome": "forwarded", "observed_outcome": "unchanged",
                                         "observe_mode": True}
                if (h + j) % 4 == 0:
                    watch.update(observed_outcome="rejected", observed_error_code=44,
                                 observed_link=AMOUNT[0], observed_error_message=AMOUNT[1])
                elif c == 1 and j == 3:
                    watch.update(observed_outcome="rejected", observed_error_code=87,
                                 observed_link=CURRENCY[0], observed_error_message=CURRENCY[1])
                elif j == 1:
                    watch.update(observed_outcome="transformed")
                out.append({**watch, "topic": history_topic})
                if j % 2 == 0:
                    out.append({**watch, "topic": "trial", "ts": ts + 10})
                guard: dict[str, Any] = {**common, "route": "guard", "topic": "payments",
                                         "records": 3, "outcome": "forwarded"}
                if j == 2:
                    guard.update(outcome="rejected", error_code=87, link=AMOUNT[0],
                                 error_message=AMOUNT[1])
                out.append(guard)
                layered: dict[str, Any] = {**common, "route": "layered", "topic": "ledger",
                                           "records": 2, "outcome": "forwarded",
                                           "observed_outcome": "unchanged"}
                if j == 1:  # the enforcing link refuses; the observing one saw it first
                    layered.update(outcome="rejected", error_code=87, link=AMOUNT[0],
                                   error_message=AMOUNT[1])
                elif j == 3:
                    layered.update(observed_outcome="rejected", observed_error_code=87,
                                   observed_link=CURRENCY[0],
                                   observed_error_message=CURRENCY[1])
                out.append(layered)
                sampled: dict[str, Any] = {**common, "route": "sampled", "topic": "clicks",
                                           "records": 4, "outcome": "forwarded",
                                           "observe_mode": True}
                if j % 2 == 0:  # judged; the others were left out by observe_sample
                    sampled.update(observed_outcome="rejected", observed_error_code=87,
                                   observed_link=CURRENCY[0],
                                   observed_error_message=CURRENCY[1])
                out.append(sampled)
                out.append({**common, "route": None, "topic": "other", "records": 7,
                            "outcome": "forwarded"})
    return out


def write_audit(path: Path, events: list[dict[str, Any]]) -> None:
    """Write ``events`` as the proxy does: one ``ResponseInfo`` each, through ``AuditLog``."""
    audit = AuditLog()
    audit.configure({"path": str(path), "rotate_interval_s": 0})
    try:
        for n, e in enumerate(events):
            fields = {k: v for k, v in e.items() if k not in ("ts", "client_id", "principal")}
            extra = {k: fields.pop(k) for k in list(fields)
                     if k.startswith(("observed_", "link")) and k not in _NATIVE}
            part = PartitionSummary(partition=n % 2, batches=1, bytes=40 * e["records"],
                                    base_offset=-1 if e["outcome"] == "rejected" else n,
                                    **fields)
            request = RequestInfo(api_key=0, api_name="Produce", api_version=9,
                                  correlation_id=n, client_id=e["client_id"],
                                  client_address="127.0.0.1:50000", principal=e["principal"],
                                  size=100, received_at_ms=e["ts"], node_id=111)
            [event] = produce_events(ResponseInfo(request=request, size=60, latency_ms=1.5,
                                                  answered_by_proxy=False, produce=(part,)))
            audit.record([{**event, **extra}])
    finally:
        audit.close()


@pytest.fixture(scope="module")
def history(broker: EmbeddedBroker) -> tuple[str, int, int]:
    """A topic with 7 days of history: 14 batches of 10 records, one every 12 hours; the
    batches 2, 7 and 12 hold a ``bad`` value (``replay_rules:RejectBad`` refuses them)."""
    topic = create_topic(broker.bootstrap, 1)
    rejected = 0
    for k in range(14):
        bad = k % 5 == 2
        records = [Record(key=b"k%d" % i, value=b"bad %d" % i if bad and i == 4 else
                          b"ok %d" % i, timestamp=HISTORY_START + k * 12 * HOUR + i,
                          offset_delta=i) for i in range(10)]
        produce_raw(broker.bootstrap, topic, 0, build_batch(records))
        rejected += 10 if bad else 0
    return topic, 140, rejected


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def rate(part: int, whole: int) -> float:
    return round(part / whole, 6)


def test_the_policy_section_counts_what_the_routes_did_and_would_have_done(
        broker: EmbeddedBroker, spark: Any, history: tuple[str, int, int],
        tmp_path: Path) -> None:
    topic, history_records, history_rejected = history
    replay_dir = tmp_path / "replay"
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                   "--report", str(replay_dir)) == 0
    events = live_events(topic)
    audit = tmp_path / "audit" / "audit.jsonl"
    write_audit(audit, events)
    out = tmp_path / "report"
    assert kiproxy("report", "--audit", str(audit), "--out", str(out),
                   "--replay", str(replay_dir)) == 0
    summary = json.loads((out / "summary.json").read_text())
    routed = [e for e in events if e["route"] is not None]

    def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
        observed = [e for e in rows if "observed_outcome" in e]
        return {
            "records": sum(e["records"] for e in rows),
            "observed_records": sum(e["records"] for e in observed),
            "enforced_records": sum(e["records"] for e in rows if not e.get("observe_mode")),
            "rejected_records": sum(e["records"] for e in rows if e["outcome"] == "rejected"),
            "would_reject_records": sum(e["records"] for e in observed
                                        if e["observed_outcome"] == "rejected"),
            "would_transform_records": sum(e["records"] for e in observed
                                           if e["observed_outcome"] == "transformed"),
        }

    def check(row: dict[str, str], want: dict[str, int]) -> None:
        for k, v in want.items():
            assert int(row[k]) == v, (k, row)
        enforced = want["enforced_records"]
        assert row["rejected_rate"] == ("" if not enforced else
                                        str(rate(want["rejected_records"], enforced)))
        assert row["would_reject_rate"] == ("" if not want["observed_records"] else str(
            rate(want["would_reject_records"], want["observed_records"])))

    by_route = {r["route"]: r for r in read_csv(out / "policy_by_route.csv")}
    assert set(by_route) == {"watch", "guard", "layered", "sampled"}  # not the unrouted one
    for route in by_route:
        mine = [e for e in routed if e["route"] == route]
        check(by_route[route], counts(mine))
        assert int(by_route[route]["first_ts"]) == min(e["ts"] for e in mine)
        assert summary["policy"]["routes"][route]["records"] == counts(mine)["records"]
    assert counts([e for e in routed if e["route"] == "watch"])["would_reject_records"] > 0
    # An enforcing route whose link observes: its refusals over all its records.
    layered = by_route["layered"]
    assert int(layered["enforced_records"]) == int(layered["records"]) > 0
    assert float(layered["rejected_rate"]) == 0.25
    # An observing route with observe_sample: no rejected rate; would-reject over judged.
    sampled = by_route["sampled"]
    assert sampled["rejected_rate"] == "" and float(sampled["would_reject_rate"]) == 1.0

    keyed = [("policy_by_client", ("route", "principal", "client_id")),
             ("policy_by_topic", ("route", "topic"))]
    for name, keys in keyed:
        rows = read_csv(out / f"{name}.csv")
        groups = {tuple(e[k] for k in keys) for e in routed}
        assert {tuple(r[k] for k in keys) for r in rows} == groups
        for r in rows:
            check(r, counts([e for e in routed if all(e[k] == r[k] for k in keys)]))
    hours = read_csv(out / "policy_by_hour.csv")
    routes = ("guard", "layered", "sampled", "watch")
    assert [(r["hour"], r["route"]) for r in hours] == [
        (f"2025-11-22T{8 + h:02d}:00Z", route) for h in range(3) for route in routes]
    for h, r in zip([h for h in range(3) for _ in routes], hours, strict=True):
        check(r, counts([e for e in routed if e["route"] == r["route"]
                         and LIVE_START + h * HOUR <= e["ts"] < LIVE_START + (h + 1) * HOUR]))

    def link_of(e: dict[str, Any]) -> str:
        return e.get("link") or e.get("observed_link") or ""

    refused = [e for e in routed if e["outcome"] == "rejected"
               or e.get("observed_outcome") == "rejected"]
    by_link = {(r["route"], r["link"]): r for r in read_csv(out / "policy_by_link.csv")}
    assert set(by_link) == {(e["route"], link_of(e)) for e in refused}
    for (route, link), r in by_link.items():
        mine = counts([e for e in refused if e["route"] == route and link_of(e) == link])
        assert int(r["rejected_records"]) == mine["rejected_records"]
        assert int(r["would_reject_records"]) == mine["would_reject_records"]
        assert int(r["route_records"]) == int(by_route[route]["records"])

    reasons = read_csv(out / "policy_reasons.csv")
    tally: Counter[tuple[str, str, str, str]] = Counter()
    for e in refused:
        verdict = "rejected" if e["outcome"] == "rejected" else "would_reject"
        reason = e.get("error_message") or e.get("observed_error_message") or ""
        tally[(e["route"], link_of(e), verdict, reason)] += e["records"]
    assert {(r["route"], r["link"], r["verdict"], r["reason"]): int(r["records"])
            for r in reasons} == dict(tally)
    assert [int(r["records"]) for r in reasons] == sorted(tally.values(), reverse=True)
    guard_reason = next(r for r in reasons if r["route"] == "guard")
    assert guard_reason["error"] == "INVALID_RECORD"
    first = min((e for e in refused if e["route"] == "guard"), key=lambda e: e["ts"])
    assert guard_reason["examples"].startswith("payments[") and \
        f"] {first['client_id']} @ 2025-11-22T08:02:00" in guard_reason["examples"]
    assert guard_reason["examples"].count(";") == 2  # three examples

    # The replay over history, beside the live observe-mode figures on the same topic.
    [row] = read_csv(out / "policy_replay.csv")
    live = counts([e for e in routed if e["route"] == "watch" and e["topic"] == topic])
    assert row["route"] == "watch" and row["topics"] == topic
    assert (int(row["history_records"]), int(row["history_rejected_records"])) == \
        (history_records, history_rejected)
    assert int(row["history_from"]) == HISTORY_START
    assert int(row["live_observed_records"]) == live["observed_records"]
    assert int(row["live_would_reject_records"]) == live["would_reject_records"]
    history_pct = f"{100 * history_rejected / history_records:.2f}%"
    live_pct = f"{100 * live['would_reject_records'] / live['observed_records']:.2f}%"
    [sentence] = summary["policy"]["replays"]
    assert f"over 6.5 days of history (2025-11-15 to 2025-11-21) it would have refused " \
           f"{history_pct} ({history_rejected} of {history_records} records); live since " \
           f"2025-11-22 08:00 UTC it would have refused {live_pct}" in sentence
    page = (out / "index.html").read_text()
    assert live_pct in page and "Route watch over time" in page
    for route in routes:
        assert (out / f"policy_{route}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_arguments_and_the_route_they_compare_with(tmp_path: Path) -> None:
    assert parse_replay_arg("watch=out/r1") == ReplaySpec(directory=Path("out/r1"),
                                                          route="watch")
    assert parse_replay_arg("out/r1") == ReplaySpec(directory=Path("out/r1"))
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert parse_replay_arg(str(odd)) == ReplaySpec(directory=odd)
    replay = ReplaySummary(directory="r", interceptor="p:P", topics=("t",), records=1000,
                           rejected_records=4, transformed_records=0, first_timestamp=None,
                           last_timestamp=None, from_offsets="earliest", to_offsets="latest",
                           reasons=())
    assert pick_route(ReplaySpec(directory=Path("r")), replay, {"a": 3, "b": 9}) == "b"
    with pytest.raises(PipelineError, match="no produce event of route 'c'"):
        pick_route(ReplaySpec(directory=Path("r"), route="c"), replay, {"a": 3})
    row = compare(replay, LiveFigures(route="b", records=5000, rejected_records=0,
                                      would_reject_records=19, observed_records=5000,
                                      enforced_records=0, first_ts=LIVE_START,
                                      last_ts=LIVE_START + DAY))
    assert row["sentence"] == (
        "Route b on t: over the history from earliest to latest it would have refused 0.40% "
        "(4 of 1,000 records); live since 2025-11-22 08:00 UTC it would have refused 0.38% "
        "(19 of 5,000 records).")
    # Moved to enforce later: its refusals are counted from then, and said so.
    moved = compare(replay, LiveFigures(route="b", records=5000, rejected_records=3,
                                        would_reject_records=19, observed_records=4000,
                                        enforced_records=1000, first_ts=LIVE_START,
                                        last_ts=LIVE_START + DAY,
                                        enforced_from=LIVE_START + 2 * HOUR))
    assert moved["sentence"].endswith(
        "live since 2025-11-22 08:00 UTC it would have refused 0.47% (19 of 4,000 records); "
        "live since 2025-11-22 10:00 UTC it refused 0.30% (3 of 1,000 records).")


def test_a_replay_directory_without_a_summary_is_refused_before_spark_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit = tmp_path / "audit.jsonl"
    write_audit(audit, live_events("t")[:2])
    assert kiproxy("report", "--audit", str(audit), "--out", str(tmp_path / "o"),
                   "--replay", f"watch={tmp_path / 'nothing-here'}") == 2
    err = capsys.readouterr().err
    assert f"--replay {tmp_path / 'nothing-here'}: cannot read" in err
    assert "the --report directory of a kiproxy replay run" in err
