"""The policy section of ``kiproxy report``: what the routes' rules refused, or would have.

Built on Spark from the produce events that a route handled (``route`` set).
Each event says what the route did (``outcome``: ``rejected`` when it refused
the partition) and, for a route or link in observe mode, what it would have
done (``observed_outcome``: ``unchanged``, ``transformed`` or ``rejected``,
with the verdict's ``observed_error_code``, ``observed_error_message`` and
``observed_link`` where the event carries them, else ``error_code``,
``error_message`` and ``link``). Counts are in records.

Tables (CSV beside the others; the five roll-ups are one Parquet table,
``parquet/policy_rollups/``, whose ``rollup`` column names the table):

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

Rates are fractions (0.0038 is 0.38%): rejected over the records the route enforced
(``enforced_records``: a route not in observe mode, whether or not some link of it
observes), would-reject over the records judged in observe mode (``observed_records``: by
the route or by a link; batches an ``observe_sample`` left unjudged count in neither).
"""

from __future__ import annotations

import csv
import html
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiproxy.interceptors.api import ERROR_CODES
from kiproxy.pipelines.charts import line_chart
from kiproxy.pipelines.html_pages import table
from kiproxy.pipelines.impact import (
    COLUMNS,
    LiveFigures,
    ReplaySpec,
    compare,
    pick_route,
    read_replay,
)

__all__ = ["POLICY_TABLES", "ROLLUP_TABLES", "aggregate_policy", "policy_sections"]

POLICY_TABLES = ("policy_rollups", "policy_reasons", "policy_replay")
"""The policy tables written as Parquet (and CSV); ``policy_rollups`` is also written as
one CSV per roll-up (``policy_by_route.csv`` ...)."""

Rows = Mapping[str, tuple[list[str], list[tuple[Any, ...]]]]
WriteTable = Callable[[str, Any, Sequence[Any]], tuple[list[str], list[tuple[Any, ...]]]]
"""Writes one DataFrame as table NAME (Parquet, CSV) in the given order; returns its rows."""


def _base(F: Any, produce: Any) -> Any:
    """One row per produce event a route handled, with the verdict columns."""
    observed = F.col("observed_outcome")
    refused = F.col("outcome") == "rejected"
    # The route enforced unless it is in observe mode (older audit logs, without
    # observe_mode: unless something observed the partition).
    enforced = ~F.coalesce(F.col("observe_mode"), observed.isNotNull())
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
        count(enforced).alias("enforced_records"),
        count(refused).alias("rejected_records"),
        count(observed == "rejected").alias("would_reject_records"),
        count(observed == "transformed").alias("would_transform_records"),
        F.when(refused, F.lit("rejected"))
        .when(observed == "rejected", F.lit("would_reject")).alias("verdict"),
        F.when(refused, F.col("link"))
        .when(observed == "rejected", F.coalesce("observed_link", "link")).alias("link"),
        F.when(refused, F.col("error_code"))
        .otherwise(F.coalesce("observed_error_code", "error_code")).alias("error_code"),
        F.coalesce(F.when(refused, F.col("error_message"))
                   .otherwise(F.coalesce("observed_error_message", "error_message")),
                   F.lit("")).alias("reason"),
    )


def _metrics(F: Any) -> list[Any]:
    return [F.count(F.lit(1)).alias("events"), F.sum("records").alias("records"),
            F.sum("observed_records").alias("observed_records"),
            F.sum("enforced_records").alias("enforced_records"),
            F.sum("rejected_records").alias("rejected_records"),
            F.sum("would_reject_records").alias("would_reject_records"),
            F.sum("would_transform_records").alias("would_transform_records")]


def _with_rates(F: Any, df: Any) -> Any:
    enforced = F.col("enforced_records")
    return df.select(
        "*",
        F.round(F.when(enforced > 0, F.col("rejected_records") / enforced), 6)
        .alias("rejected_rate"),
        F.round(F.when(F.col("observed_records") > 0,
                       F.col("would_reject_records") / F.col("observed_records")), 6)
        .alias("would_reject_rate"))


_ROLLUPS: dict[str, tuple[str, ...]] = {
    "policy_by_route": ("route",),
    "policy_by_link": ("route", "link"),
    "policy_by_client": ("route", "principal", "client_id"),
    "policy_by_topic": ("route", "topic"),
    "policy_by_hour": ("hour", "route"),
}
"""Each roll-up table and its keys; all are computed in one Spark job (``policy_rollups``)."""
ROLLUP_TABLES = tuple(_ROLLUPS)
_KEYS = ("route", "link", "principal", "client_id", "topic", "hour")
_COUNTS = ("events", "records", "observed_records", "enforced_records", "rejected_records",
           "would_reject_records", "would_transform_records")


def _rollups(F: Any, base: Any) -> Any:
    """Every roll-up of :data:`_ROLLUPS` as one frame: a ``rollup`` column names the table,
    the keys it does not group by are null."""
    m = _metrics(F)
    window = [F.min("ts").alias("first_ts"), F.max("ts").alias("last_ts")]
    frames = [base.groupBy(*keys).agg(*m, *window).select(
        F.lit(name).alias("rollup"),
        *(F.col(k) if k in keys else F.lit(None).cast("string").alias(k) for k in _KEYS),
        *_COUNTS, "first_ts", "last_ts") for name, keys in _ROLLUPS.items()]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return _with_rates(F, union)


def _split(out: Path, rows: tuple[list[str], list[tuple[Any, ...]]]) -> Rows:
    """The roll-ups' rows, table by table (each also written as ``NAME.csv``)."""
    columns, data = rows
    by_name: dict[str, list[dict[str, Any]]] = {name: [] for name in _ROLLUPS}
    for row in data:
        record = dict(zip(columns, row, strict=True))
        by_name[record["rollup"]].append(record)
    totals = {r["route"]: r["records"] for r in by_name["policy_by_route"]}
    tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    for name, keys in _ROLLUPS.items():
        found = sorted(by_name[name], key=lambda r: tuple(str(r[k] or "") for k in keys))
        if name == "policy_by_link":
            cols = ["route", "link", "rejected_records", "would_reject_records",
                    "route_records", "rejected_share", "would_reject_share"]
            table_rows = [
                (r["route"], r["link"] or "", r["rejected_records"], r["would_reject_records"],
                 totals[r["route"]], round(r["rejected_records"] / totals[r["route"]], 6),
                 round(r["would_reject_records"] / totals[r["route"]], 6))
                for r in found if r["rejected_records"] or r["would_reject_records"]]
        else:
            window = ["first_ts", "last_ts"] if name == "policy_by_route" else []
            cols = [*keys, *_COUNTS, *window, "rejected_rate", "would_reject_rate"]
            table_rows = [tuple(r[c] for c in cols) for r in found]
        with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(cols)
            writer.writerows(table_rows)
        tables[name] = (cols, table_rows)
    return tables


def aggregate_policy(spark: Any, F: Any, produce: Any, write: WriteTable,
                     replays: Sequence[ReplaySpec], out: Path) -> tuple[dict[str, Any], Rows]:
    """Compute and write the policy tables from the windowed produce events; returns the
    summary's ``policy`` part and each table's rows."""
    base = _base(F, produce).cache()
    rows: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    rows.update(_split(out, write("policy_rollups", _rollups(F, base), ["rollup", *_KEYS])))
    decided = base.where(F.col("verdict").isNotNull())
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
                                             "enforced_records", "rejected_records",
                                             "would_reject_records",
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
                                       F.max("ts").alias("last"),
                                       F.min(F.when(F.col("enforced_records") > 0, F.col("ts")))
                                       .alias("enforced_first")).collect()}
    route = pick_route(spec, replay, {name: r["events"] for name, r in per_route.items()})
    t = per_route[route]
    live = LiveFigures(route=route, records=int(t["records"] or 0),
                       rejected_records=int(t["rejected_records"] or 0),
                       would_reject_records=int(t["would_reject_records"] or 0),
                       observed_records=int(t["observed_records"] or 0),
                       enforced_records=int(t["enforced_records"] or 0),
                       first_ts=t["first"], last_ts=t["last"],
                       enforced_from=t["enforced_first"])
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
        parquet = "policy_rollups" if name in ROLLUP_TABLES else name
        return (f'<p class="note">Data: <a href="{name}.csv">{name}.csv</a>, '
                f'<a href="parquet/{parquet}/">parquet/{parquet}/</a></p>')

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
