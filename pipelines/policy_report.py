"""The policy section of ``kiproxy report``: what the routes' rules refused, or would have.

Built on Spark from the produce events that a route handled (``route`` set).
Each event says what the route did (``outcome``: ``rejected`` when it refused
the partition) and, for a route or link in observe mode, what it would have
done (``observed_outcome``: ``unchanged``, ``transformed`` or ``rejected``,
with the verdict's ``observed_error_code``, ``observed_error_message`` and
``observed_link`` where the event carries them, else ``error_code``,
``error_message`` and ``link``). Counts are in records.

Tables (Parquet and CSV beside the others):

- ``policy_by_route``: per route, records seen and in observe mode, rejected,
  would-reject and would-transform records, their rates and the time window;
- ``policy_by_link``: per route and deciding link, rejected and would-reject
  records and their share of the route's records;
- ``policy_by_client``: the same per route, principal and client id;
- ``policy_by_topic``: the same per route and topic;
- ``policy_by_hour``: per hour (UTC) and route, for the rates over time;
- ``policy_reasons``: per route, link, verdict (``rejected``/``would_reject``),
  error and reason: events, records and up to three examples
  (``topic[partition] client_id @ time``), most records first;
- ``policy_replay``: with ``--replay``, a replay dry run beside the live figures
  of the route on the same topics (:mod:`kiproxy.pipelines.impact`).

Rates are fractions (0.0038 is 0.38%): rejected over the route's records in
enforce mode, would-reject over its records in observe mode.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiproxy.interceptors.api import ERROR_CODES
from kiproxy.pipelines.charts import line_chart
from kiproxy.pipelines.html import table
from kiproxy.pipelines.impact import (
    COLUMNS,
    LiveFigures,
    ReplaySpec,
    compare,
    pick_route,
    read_replay,
)

__all__ = ["POLICY_TABLES", "aggregate_policy", "policy_sections"]

POLICY_TABLES = ("policy_by_route", "policy_by_link", "policy_by_client", "policy_by_topic",
                 "policy_by_hour", "policy_reasons", "policy_replay")

Rows = Mapping[str, tuple[list[str], list[tuple[Any, ...]]]]
WriteTable = Callable[[str, Any, Sequence[Any]], tuple[list[str], list[tuple[Any, ...]]]]
"""Writes one DataFrame as table NAME (Parquet, CSV) in the given order; returns its rows."""


def _base(F: Any, produce: Any) -> Any:
    """One row per produce event a route handled, with the verdict columns."""
    observed = F.col("observed_outcome")
    refused = F.col("outcome") == "rejected"
    records = F.coalesce("records", F.lit(0))

    def count(cond: Any) -> Any:
        return F.when(cond, records).otherwise(F.lit(0))

    return produce.where(F.col("route").isNotNull()).select(
        F.date_format(F.date_trunc("hour", F.timestamp_millis("ts")),
                      "yyyy-MM-dd'T'HH:00'Z'").alias("hour"),
        "route", "topic", "partition", "ts",
        F.coalesce("client_id", F.lit("")).alias("client_id"),
        F.coalesce("principal", F.lit("")).alias("principal"),
        records.alias("records"),
        count(observed.isNotNull()).alias("observed_records"),
        count(refused).alias("rejected_records"),
        count(observed == "rejected").alias("would_reject_records"),
        count(observed == "transformed").alias("would_transform_records"),
        F.when(refused, F.lit("rejected"))
        .when(observed == "rejected", F.lit("would_reject")).alias("verdict"),
        F.when(refused, F.col("link"))
        .otherwise(F.coalesce("observed_link", "link")).alias("link"),
        F.when(refused, F.col("error_code"))
        .otherwise(F.coalesce("observed_error_code", "error_code")).alias("error_code"),
        F.coalesce(F.when(refused, F.col("error_message"))
                   .otherwise(F.coalesce("observed_error_message", "error_message")),
                   F.lit("")).alias("reason"),
    )


def _metrics(F: Any) -> list[Any]:
    return [F.count(F.lit(1)).alias("events"), F.sum("records").alias("records"),
            F.sum("observed_records").alias("observed_records"),
            F.sum("rejected_records").alias("rejected_records"),
            F.sum("would_reject_records").alias("would_reject_records"),
            F.sum("would_transform_records").alias("would_transform_records")]


def _with_rates(F: Any, df: Any) -> Any:
    enforced = F.col("records") - F.col("observed_records")
    return df.select(
        "*",
        F.round(F.when(enforced > 0, F.col("rejected_records") / enforced), 6)
        .alias("rejected_rate"),
        F.round(F.when(F.col("observed_records") > 0,
                       F.col("would_reject_records") / F.col("observed_records")), 6)
        .alias("would_reject_rate"))


def aggregate_policy(spark: Any, F: Any, produce: Any, write: WriteTable,
                     replays: Sequence[ReplaySpec]) -> tuple[dict[str, Any], Rows]:
    """Compute and write the policy tables from the windowed produce events; returns the
    summary's ``policy`` part and each table's rows."""
    base = _base(F, produce).cache()
    m = _metrics(F)
    window = [F.min("ts").alias("first_ts"), F.max("ts").alias("last_ts")]
    rows: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    route_totals = base.groupBy("route").agg(*m, *window)
    rows["policy_by_route"] = write("policy_by_route", _with_rates(F, route_totals), ["route"])
    decided = base.where(F.col("verdict").isNotNull())
    by_link = decided.groupBy("route", F.coalesce("link", F.lit("")).alias("link")).agg(
        F.sum("rejected_records").alias("rejected_records"),
        F.sum("would_reject_records").alias("would_reject_records"))
    share = by_link.join(route_totals.select("route", F.col("records").alias("route_records")),
                         "route").select(
        "route", "link", "rejected_records", "would_reject_records", "route_records",
        F.round(F.col("rejected_records") / F.col("route_records"), 6).alias("rejected_share"),
        F.round(F.col("would_reject_records") / F.col("route_records"), 6)
        .alias("would_reject_share"))
    rows["policy_by_link"] = write("policy_by_link", share, ["route", "link"])
    for name, keys in (("policy_by_client", ["route", "principal", "client_id"]),
                       ("policy_by_topic", ["route", "topic"]),
                       ("policy_by_hour", ["hour", "route"])):
        rows[name] = write(name, _with_rates(F, base.groupBy(*keys).agg(*m)), keys)
    names = spark.createDataFrame([(c, n) for n, c in ERROR_CODES.items()],
                                  "error_code INT, error STRING")
    example = F.struct("ts", "topic", "partition", "client_id")
    reasons = (decided.groupBy("route", F.coalesce("link", F.lit("")).alias("link"), "verdict",
                               "error_code", "reason")
               .agg(F.count(F.lit(1)).alias("events"), F.sum("records").alias("records"),
                    F.slice(F.sort_array(F.collect_list(example)), 1, 3).alias("examples"))
               .join(F.broadcast(names), "error_code", "left")
               .select("route", "link", "verdict", "error_code",
                       F.coalesce("error", F.concat(F.lit("ERROR_"),
                                                    F.col("error_code").cast("string")))
                       .alias("error"), "reason", "events", "records",
                       F.concat_ws("; ", F.transform("examples", lambda e: F.concat(
                           e["topic"], F.lit("["), e["partition"].cast("string"), F.lit("] "),
                           e["client_id"], F.lit(" @ "),
                           F.date_format(F.timestamp_millis(e["ts"]),
                                         "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'"))))
                       .alias("examples")))
    rows["policy_reasons"] = write("policy_reasons", reasons,
                                   [F.desc("records"), "route", "link", "verdict", "reason"])
    comparisons = [_compare(F, base, spec) for spec in replays]
    rows["policy_replay"] = write("policy_replay", spark.createDataFrame(
        [tuple(c[k] for k in COLUMNS) for c in comparisons], _replay_schema()), ["route"])
    base.unpersist()
    columns, data = rows["policy_by_route"]
    routes = {r["route"]: {k: r[k] for k in ("events", "records", "observed_records",
                                             "rejected_records", "would_reject_records",
                                             "would_transform_records", "rejected_rate",
                                             "would_reject_rate", "first_ts", "last_ts")}
              for r in (dict(zip(columns, row, strict=True)) for row in data)}
    return {"routes": routes, "replays": [c["sentence"] for c in comparisons]}, rows


def _replay_schema() -> str:
    types = {"history_from": "LONG", "history_until": "LONG", "live_from": "LONG",
             "live_until": "LONG", "history_rejected_rate": "DOUBLE",
             "live_would_reject_rate": "DOUBLE", "live_rejected_rate": "DOUBLE"}
    return ", ".join(f"{c} {types.get(c, 'LONG' if c.endswith('records') else 'STRING')}"
                     for c in COLUMNS)


def _compare(F: Any, base: Any, spec: ReplaySpec) -> dict[str, Any]:
    replay = read_replay(spec)
    per_route = {r["route"]: r for r in base.where(F.col("topic").isin(list(replay.topics)))
                 .groupBy("route").agg(*_metrics(F), F.min("ts").alias("first"),
                                       F.max("ts").alias("last")).collect()}
    route = pick_route(spec, replay, {name: r["events"] for name, r in per_route.items()})
    t = per_route[route]
    live = LiveFigures(route=route, records=int(t["records"] or 0),
                       rejected_records=int(t["rejected_records"] or 0),
                       would_reject_records=int(t["would_reject_records"] or 0),
                       observed_records=int(t["observed_records"] or 0),
                       first_ts=t["first"], last_ts=t["last"])
    return compare(replay, live)


# ------------------------------------------------------------------------------- the page


def _pct(value: Any) -> str:
    return "" if value is None else f"{100 * float(value):.2f}%"


def _iso(ms: Any) -> str:
    return "" if ms is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(int(ms) / 1000))


def _slug(route: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", route)[:60] or "route"


def _dicts(rows: Rows, name: str) -> list[dict[str, Any]]:
    columns, data = rows[name]
    return [dict(zip(columns, r, strict=True)) for r in data]


def policy_sections(out: Path, rows: Rows) -> list[tuple[str, str]]:
    """The page sections of the policy tables, and a PNG chart per route."""
    routes = _dicts(rows, "policy_by_route")
    if not routes:
        return [("Policy impact", '<p class="note">No produce event was handled by a route in '
                                  "this window.</p>")]

    def data(name: str) -> str:
        return (f'<p class="note">Data: <a href="{name}.csv">{name}.csv</a>, '
                f'<a href="parquet/{name}/">parquet/{name}/</a></p>')

    sections = [("Policy impact by route", table(
        ["route", "records", "in observe mode", "rejected", "rejected rate", "would reject",
         "would-reject rate", "would transform", "from", "to"],
        [(r["route"], r["records"], r["observed_records"], r["rejected_records"],
          _pct(r["rejected_rate"]), r["would_reject_records"], _pct(r["would_reject_rate"]),
          r["would_transform_records"], _iso(r["first_ts"]), _iso(r["last_ts"]))
         for r in routes]) + data("policy_by_route"))]
    comparisons = _dicts(rows, "policy_replay")
    if comparisons:
        sentences = "".join(f"<li>{html.escape(c['sentence'])}</li>" for c in comparisons)
        sections.append(("Replay over history beside live traffic", f"<ul>{sentences}</ul>"
                         + data("policy_replay")))
    hours = _dicts(rows, "policy_by_hour")
    for route in (r["route"] for r in routes):
        mine = [h for h in hours if h["route"] == route]
        png = f"policy_{_slug(route)}.png"
        series = {label: [100 * (h[key] or 0) for h in mine]
                  for label, key in (("rejected", "rejected_rate"),
                                     ("would reject", "would_reject_rate"))
                  if any(h[key] is not None for h in mine)}  # only the modes it ran in
        line_chart(out / png, f"Route {route}: refused records per hour (%)",
                   [str(h["hour"]) for h in mine], series, ylabel="% of the route's records")
        sections.append((f"Route {route} over time", f'<img src="{png}" alt="route {route}">'))
    sections.append(("Refusals by route and link", table(
        ["route", "link", "rejected", "would reject", "route records", "rejected share",
         "would-reject share"],
        [(r["route"], r["link"], r["rejected_records"], r["would_reject_records"],
          r["route_records"], _pct(r["rejected_share"]), _pct(r["would_reject_share"]))
         for r in _dicts(rows, "policy_by_link")]) + data("policy_by_link")))
    sections.append(("Top refusal reasons", table(
        ["route", "link", "verdict", "error", "reason", "events", "records", "examples"],
        [(r["route"], r["link"], r["verdict"], r["error"], r["reason"], r["events"],
          r["records"], r["examples"]) for r in _dicts(rows, "policy_reasons")], limit=50)
        + data("policy_reasons")))
    for name, title, keys in (("policy_by_client", "Policy by principal and client id",
                               ["route", "principal", "client_id"]),
                              ("policy_by_topic", "Policy by topic", ["route", "topic"])):
        sections.append((title, table(
            [*keys, "records", "rejected", "rejected rate", "would reject", "would-reject rate"],
            [(*(r[k] for k in keys), r["records"], r["rejected_records"],
              _pct(r["rejected_rate"]), r["would_reject_records"], _pct(r["would_reject_rate"]))
             for r in _dicts(rows, name)], limit=100) + data(name)))
    return sections
