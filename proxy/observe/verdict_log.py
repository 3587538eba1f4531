"""How the proxy logs rejections: policy at INFO, plugin bugs at WARNING, rate-limited.

A policy rejection (the plugin raised ``RejectBatch``, or the proxy could not
decode the partition) is one INFO line naming the client address, client id,
topic-partition, the route (when routes are configured), error code and
reason: it is what the producer was told. The same line again (same client
host and client id, topic-partition, route, code and reason: a producer retrying a
batch that will never pass) is held back for :data:`WARNING_INTERVAL` seconds and
counted in the next one, or in a summary line once the interval has passed (below),
so a retry loop costs a line per interval, not one per attempt.

A plugin bug (an exception, a wrong return type, a broken record-count rule,
a missed deadline, records that cannot be encoded) is a WARNING, rate-limited
per route, plugin and kind of fault: the first occurrence is logged (with the
plugin's traceback for an exception), then at most one line per
:data:`WARNING_INTERVAL` seconds, saying how many were suppressed since the
last line. A plugin failing on every batch therefore costs a line every 10 s,
not one per batch. Lines held back are not left to a next one that may never come:
on the event loop, :data:`WARNING_INTERVAL` seconds after the first held back, one
summary line counts them and names the last (its topic-partition, client and
message), so every fault the producers were told of reaches the log within 10 s.

What a route or link in observe mode would have done (rejected or
transformed a batch that was forwarded as received) is an INFO line,
rate-limited the same way per route, link and outcome, summary included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from kiproxy.interceptors.verdict import Rejected
from kiproxy.protocol.log_limit import RateLimitedLog

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


_Text = tuple[str, tuple[object, ...]]
"""What a summary says of the last line held back: a format and its arguments (formatted
only when the summary is written, not for every batch held back)."""

_MORE = " ({count} more like it in the last {interval:.0f} s not logged)"


class VerdictLog:
    """Writes the proxy's rejection lines to ``log`` (see the module docstring)."""

    def __init__(self, log: logging.Logger, *, interval: float = WARNING_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval = interval
        self._faults = RateLimitedLog(log, interval, clock=clock)
        self._last_held: dict[Hashable, tuple[int, Subject, _Text]] = {}
        """Key -> (level, subject, text) of the last line held back, while a summary of
        them is due (see :meth:`_held_back`)."""
        self._summaries: dict[Hashable, asyncio.TimerHandle] = {}
        """Key -> its summary's timer, cancelled when a line for the key is written first
        (that line counts what was held back)."""

    def policy(self, subject: Subject, code: int, message: str) -> None:
        """One INFO line for a batch rejected by policy (or as undecodable), unless the same
        line for the same client host and client id was written lately (then counted, and
        summarized if no other line comes; see the module docstring)."""
        address, route = subject.client_address, subject.route
        host = address.rpartition(":")[0] or address
        self._line(("policy", host, subject.client_id, subject.where, route, code, message),
                   logging.INFO, subject, ("error %d: %s", (code, message)),
                   "rejected %s from %s (client_id %r)%s: error %d: %s", subject.where,
                   address, subject.client_id, _on(route), code, message)

    def fault(self, subject: Subject, kind: str, message: str,
              exception: BaseException | None = None) -> None:
        """A WARNING for a plugin bug, unless one for ``(subject.route, subject.link,
        kind)`` was written lately (a fault no link is named for is its route's)."""
        route = subject.route
        self._line((route, subject.link or "", kind), logging.WARNING, subject,
                   ("%s", (message,)), "rejected %s from %s (client_id %r)%s: %s",
                   subject.where, subject.client_address, subject.client_id, _on(route),
                   message, exception=exception)

    def observed(self, subject: Subject, outcome: str, detail: str) -> None:
        """An INFO line for a batch a route or link in observe mode would have rejected or
        transformed (it was forwarded), rate-limited per route, link and outcome like a
        fault."""
        route, link = subject.route, subject.link
        self._line(("observe", route, link, outcome), logging.INFO, subject,
                   ("would have %s it%s", (outcome, detail)),
                   "would have %s %s from %s (client_id %r) on route %s, link %s "
                   "(observe mode: forwarded as received)%s", outcome, subject.where,
                   subject.client_address, subject.client_id, route, link, detail)

    def _line(self, key: Hashable, level: int, subject: Subject, held_text: _Text, msg: str,
              *args: object, exception: BaseException | None = None) -> None:
        """Write ``msg % args`` for ``key`` at ``level`` (counting what it held back), or
        hold it back, ``held_text`` being what a summary says of it."""
        if self._faults.log(level, key, msg, *args, more=_MORE, exc_info=exception,
                            extra=_with_route(subject.extra, subject.route)):
            self._written(key)
        else:
            self._held_back(key, level, subject, held_text)

    def _held_back(self, key: Hashable, level: int, subject: Subject, text: _Text) -> None:
        """Remember the line held back for ``key``; the first one held back since the last
        line or summary has the summary written :attr:`interval` seconds later (on the
        running event loop; without one the count waits for the key's next line)."""
        if key not in self._summaries:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._summaries[key] = loop.call_later(self.interval, self._summarize, key)
        self._last_held[key] = (level, subject, text)

    def _written(self, key: Hashable) -> None:
        """A line for ``key`` was written, counting what it held back: no summary of it."""
        timer = self._summaries.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._last_held.pop(key, None)

    def _summarize(self, key: Hashable) -> None:
        """One line counting what ``key`` held back, naming the last of it."""
        self._summaries.pop(key, None)
        last = self._last_held.pop(key, None)
        if last is None:
            return
        held = self._faults.summary(key)
        if not held:
            return
        level, subject, (text, text_args) = last
        text = text % text_args  # formatted once, for the one line that says it
        route = subject.route
        self.log.log(level, "%d more like it in the last %.0f s not logged%s; the last: %s "
                     "from %s (client_id %r): %s", held, self.interval, _on(route),
                     subject.where, subject.client_address, subject.client_id, text,
                     extra=_with_route(subject.extra, route))

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
