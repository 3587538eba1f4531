"""How the proxy logs rejections: policy at INFO, plugin bugs at WARNING, rate-limited.

A policy rejection (the plugin raised ``RejectBatch``, or the proxy could not
decode the partition) is one INFO line naming the client address, client id,
topic-partition, the route and the link that refused it (when routes are
configured), error code and reason: it is what the producer was told. The same
line again (same client host and client id, topic-partition, route, link, code and
reason: a producer retrying a batch that will never pass) is held back for
:data:`WARNING_INTERVAL` seconds and counted in the next one, or in a summary line
once the interval has passed (below), so a retry loop costs a line per interval, not
one per attempt.

A plugin bug (an exception, a wrong return type, a broken record-count rule,
a missed deadline, records that cannot be encoded) is a WARNING, rate-limited
per route, plugin and kind of fault: the first occurrence is logged (with the
plugin's traceback for an exception), then at most one line per
:data:`WARNING_INTERVAL` seconds, saying how many were suppressed since the
last line. A plugin failing on every batch therefore costs a line every 10 s,
not one per batch. Lines held back are not left to a next one that may never come:
on the event loop, :data:`WARNING_INTERVAL` seconds after the first held back, one
summary line counts them and gives the last one's text (its topic-partition, client and
message; :data:`~kiproxy.protocol.log_limit.SUMMARY`), so every fault the producers
were told of reaches the log within 10 s.

What a route or link in observe mode would have done (rejected or
transformed a batch) is an INFO line, rate-limited the same way per route, link and
outcome, summary included. It says what happened to the batch instead: a route in
observe mode forwarded it as received; a link in observe mode inside an enforcing
chain had its verdict left unapplied (the other links' verdicts stand).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from kiproxy.interceptors.verdict import Rejected
from kiproxy.protocol.log_limit import MORE_LIKE_IT, RateLimitedLog

__all__ = ["WARNING_INTERVAL", "Subject", "VerdictLog"]

WARNING_INTERVAL = 10.0
"""Seconds between two WARNING lines for the same plugin and fault."""


@dataclass(frozen=True, slots=True)
class Subject:
    """What one verdict line is about: the topic-partition, the client, the route and
    the link."""

    where: str
    """``topic[partition]``."""
    client_address: str
    client_id: str | None
    extra: Mapping[str, object] | None = None
    """The ``extra=`` fields of the line (the client's log context)."""
    route: str | None = None
    """The route (None for the ``interceptor:`` shorthand, whose lines name none)."""
    link: str | None = None
    """The link whose verdict it is (a fault's plugin, an observed verdict's link)."""


class VerdictLog:
    """Writes the proxy's rejection lines to ``log`` (see the module docstring)."""

    def __init__(self, log: logging.Logger, *, interval: float = WARNING_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval = interval
        self._faults = RateLimitedLog(log, interval, clock=clock)

    def policy(self, subject: Subject, code: int, message: str) -> None:
        """One INFO line for a batch rejected by policy (or as undecodable), unless the same
        line for the same client host and client id was written lately (then counted, and
        summarized if no other line comes; see the module docstring)."""
        address, route, link = subject.client_address, subject.route, subject.link
        host = address.rpartition(":")[0] or address
        by = f", link {link}" if route is not None and link else ""
        self._line(("policy", host, subject.client_id, subject.where, route, link, code,
                    message), logging.INFO, subject,
                   "rejected %s from %s (client_id %r)%s%s: error %d: %s", subject.where,
                   address, subject.client_id, _on(route), by, code, message)

    def fault(self, subject: Subject, kind: str, message: str,
              exception: BaseException | None = None) -> None:
        """A WARNING for a plugin bug, unless one for ``(subject.route, subject.link,
        kind)`` was written lately (a fault no link is named for is its route's)."""
        route = subject.route
        self._line((route, subject.link or "", kind), logging.WARNING, subject,
                   "rejected %s from %s (client_id %r)%s: %s",
                   subject.where, subject.client_address, subject.client_id, _on(route),
                   message, exception=exception)

    def observed(self, subject: Subject, outcome: str, detail: str, *,
                 route_observes: bool) -> None:
        """An INFO line for a batch a route or link in observe mode would have rejected or
        transformed, rate-limited per route, link and outcome like a fault.
        ``route_observes``: the route itself observes (the batch was forwarded as
        received), else a link of an enforcing chain does (its verdict not applied)."""
        route, link = subject.route, subject.link
        done = ("observe mode: forwarded as received" if route_observes
                else "link in observe mode: its verdict not applied")
        self._line(("observe", route, link, outcome), logging.INFO, subject,
                   "would have %s %s from %s (client_id %r) on route %s, link %s (%s)%s",
                   outcome, subject.where, subject.client_address, subject.client_id, route,
                   link, done, detail)

    def _line(self, key: Hashable, level: int, subject: Subject, msg: str, *args: object,
              exception: BaseException | None = None) -> None:
        """Write ``msg % args`` for ``key`` at ``level`` (counting what it held back), or
        hold it back (summarized if no other line comes)."""
        self._faults.log(level, key, msg, *args, more=MORE_LIKE_IT, exc_info=exception,
                         extra=_with_route(subject.extra, subject.route))

    def rejected(self, verdict: Rejected, plugin: str, where: str, client_address: str,
                 client_id: str | None, extra: Mapping[str, object] | None = None, *,
                 route: str | None = None) -> None:
        """Log ``verdict`` as a policy rejection or a plugin fault."""
        subject = Subject(where, client_address, client_id, extra, route, plugin)
        if verdict.fault is None:
            self.policy(subject, verdict.code, verdict.message)
        else:
            self.fault(subject, verdict.fault, verdict.message, verdict.exception)


def _on(route: str | None) -> str:
    """`` on route NAME`` for a line about a routed batch, else nothing."""
    return "" if route is None else f" on route {route}"


def _with_route(extra: Mapping[str, object] | None,
                route: str | None) -> Mapping[str, object] | None:
    if route is None:
        return extra
    return {**(extra or {}), "route": route}
