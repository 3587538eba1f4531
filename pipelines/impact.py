"""A replay over history beside the live figures: one verdict for a rule, two windows.

``kiproxy report --replay [ROUTE=]DIR`` reads the ``summary.json`` that
``kiproxy replay`` wrote into ``DIR`` (a dry run of the rule over a topic's
history) and sets it beside what the audit events say the route did live on
the same topics: records seen, records refused (``rejected``: the route
enforced) and records it would have refused (``would_reject``: observe mode).
Without ``ROUTE=`` the route is the one with the most produce events on the
replay's topics. This module is pure (no Spark): the report computes the live
figures (:class:`LiveFigures`) and this module reads the replay, picks the
route and words the comparison::

    over 7.0 days of history (2026-11-20 to 2026-11-27) it would have refused 0.40%
    (412 of 103,000 records); live since 2026-11-24 09:00 UTC it would have refused
    0.38% (95 of 25,000 records)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiproxy.pipelines.errors import PipelineError

__all__ = ["COLUMNS", "LiveFigures", "ReplaySpec", "ReplaySummary", "compare",
           "parse_replay_arg", "pick_route", "read_replay"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySpec:
    """One ``--replay [ROUTE=]DIR`` argument."""

    directory: Path
    route: str | None = None


def parse_replay_arg(text: str) -> ReplaySpec:
    """``DIR`` or ``ROUTE=DIR``; a ``=`` inside a path that exists is taken as the path."""
    route, sep, directory = text.partition("=")
    if sep and route and not Path(text).exists():
        return ReplaySpec(directory=Path(directory), route=route)
    return ReplaySpec(directory=Path(text))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaySummary:
    """What one replay dry run found, as the comparison needs it."""

    directory: str
    interceptor: str
    topics: tuple[str, ...]
    records: int
    rejected_records: int
    transformed_records: int
    first_timestamp: int | None
    """Earliest record timestamp replayed (ms), when the replay recorded it."""
    last_timestamp: int | None
    from_offsets: str
    to_offsets: str
    reasons: tuple[Mapping[str, Any], ...]


def read_replay(spec: ReplaySpec) -> ReplaySummary:
    """Read ``summary.json`` of a ``kiproxy replay`` report directory."""
    path = spec.directory / "summary.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PipelineError(f"--replay {spec.directory}: cannot read {path} "
                            f"({exc.strerror or exc}); give the --report directory of a "
                            "kiproxy replay run") from None
    except ValueError as exc:
        raise PipelineError(f"--replay {spec.directory}: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != "kiproxy-replay":
        raise PipelineError(f"--replay {spec.directory}: {path} is not a kiproxy replay "
                            "summary (no \"kind\": \"kiproxy-replay\")")
    return ReplaySummary(
        directory=str(spec.directory), interceptor=str(data["interceptor"]),
        topics=tuple(data["topic_list"]), records=int(data["records"]),
        rejected_records=int(data["rejected_records"]),
        transformed_records=int(data["transformed_records"]),
        first_timestamp=data.get("first_timestamp"), last_timestamp=data.get("last_timestamp"),
        from_offsets=str(data.get("from_offsets")), to_offsets=str(data.get("to_offsets")),
        reasons=tuple(data.get("reasons", ())))


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveFigures:
    """What the audit events say one route did on some topics."""

    route: str
    records: int
    rejected_records: int
    """Records the route refused (it enforced)."""
    would_reject_records: int
    """Records it would have refused (observe mode)."""
    observed_records: int
    """Records judged in observe mode, by the route or a link (the would-reject rate's
    base)."""
    enforced_records: int
    """Records of the route when it was not in observe mode (the rejected rate's base)."""
    first_ts: int | None
    last_ts: int | None
    enforced_from: int | None = None
    """The first event of the route enforcing (None: it never did)."""


def pick_route(spec: ReplaySpec, replay: ReplaySummary,
               events_by_route: Mapping[str, int]) -> str:
    """The route to compare with: ``ROUTE=`` or the one with most events on the topics."""
    if spec.route is not None:
        if spec.route not in events_by_route:
            raise PipelineError(
                f"--replay {spec.route}={spec.directory}: no produce event of route "
                f"{spec.route!r} on {', '.join(replay.topics)} in the audit input; routes "
                f"there: {', '.join(sorted(events_by_route)) or 'none'}")
        return spec.route
    if not events_by_route:
        raise PipelineError(f"--replay {spec.directory}: no produce event of any route on "
                            f"{', '.join(replay.topics)} in the audit input")
    return max(sorted(events_by_route), key=lambda r: events_by_route[r])


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "n/a (no records)"


def _day(ms: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ms / 1000))


def _minute(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000))


def _history(replay: ReplaySummary) -> str:
    if replay.first_timestamp is not None and replay.last_timestamp is not None:
        days = (replay.last_timestamp - replay.first_timestamp) / 86_400_000
        return (f"over {days:.1f} days of history ({_day(replay.first_timestamp)} to "
                f"{_day(replay.last_timestamp)})")
    return f"over the history from {replay.from_offsets} to {replay.to_offsets}"


def compare(replay: ReplaySummary, live: LiveFigures) -> dict[str, Any]:
    """One comparison row (for ``policy_replay``) with its ``sentence``."""
    history = (f"{_history(replay)} it would have refused "
               f"{_pct(replay.rejected_records, replay.records)} "
               f"({replay.rejected_records:,} of {replay.records:,} records)")
    since = f"since {_minute(live.first_ts)}" if live.first_ts is not None else "(no events)"
    parts = []
    if live.observed_records:
        parts.append(f"live {since} it would have refused "
                     f"{_pct(live.would_reject_records, live.observed_records)} "
                     f"({live.would_reject_records:,} of {live.observed_records:,} records)")
    enforced = live.enforced_records
    if enforced or not parts:
        if live.enforced_from is not None:
            since = f"since {_minute(live.enforced_from)}"
        parts.append(f"live {since} it refused {_pct(live.rejected_records, enforced)} "
                     f"({live.rejected_records:,} of {enforced:,} records)")
    return {
        "route": live.route, "interceptor": replay.interceptor,
        "topics": ",".join(replay.topics), "replay": replay.directory,
        "history_from": replay.first_timestamp, "history_until": replay.last_timestamp,
        "history_records": replay.records, "history_rejected_records": replay.rejected_records,
        "history_rejected_rate": _rate(replay.rejected_records, replay.records),
        "live_from": live.first_ts, "live_until": live.last_ts, "live_records": live.records,
        "live_observed_records": live.observed_records,
        "live_would_reject_records": live.would_reject_records,
        "live_would_reject_rate": _rate(live.would_reject_records, live.observed_records),
        "live_rejected_records": live.rejected_records,
        "live_rejected_rate": _rate(live.rejected_records, enforced),
        "sentence": f"Route {live.route} on {', '.join(replay.topics)}: {history}; "
                    + "; ".join(parts) + ".",
    }


def _rate(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


COLUMNS: Sequence[str] = (
    "route", "interceptor", "topics", "replay", "history_from", "history_until",
    "history_records", "history_rejected_records", "history_rejected_rate", "live_from",
    "live_until", "live_records", "live_observed_records", "live_would_reject_records",
    "live_would_reject_rate", "live_rejected_records", "live_rejected_rate", "sentence")
"""The columns of the ``policy_replay`` table, in order."""
