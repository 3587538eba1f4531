"""How the proxy logs rejections: policy at INFO, plugin bugs at WARNING, rate-limited.

A policy rejection (the plugin raised ``RejectBatch``, or the proxy could not
decode the partition) is one INFO line naming the client address, client id,
topic-partition, the route (when routes are configured), error code and
reason: it is what the producer was told. The same line again (same client
host, topic-partition, route, code and reason: a producer retrying a batch that
will never pass) is held back for :data:`WARNING_INTERVAL` seconds and counted
in the next one, so a retry loop costs a line per interval, not one per attempt.

A plugin bug (an exception, a wrong return type, a broken record-count rule,
a missed deadline, records that cannot be encoded) is a WARNING, rate-limited
per plugin and kind of fault: the first occurrence is logged (with the
plugin's traceback for an exception), then at most one line per
:data:`WARNING_INTERVAL` seconds, saying how many were suppressed since the
last line. A plugin failing on every batch therefore costs a line every 10 s,
not one per batch.

What a route or link in observe mode would have done (rejected or
transformed a batch that was forwarded as received) is an INFO line,
rate-limited the same way per route, link and outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from kiproxy.interceptors.verdict import Rejected
from kiproxy.protocol.log_limit import RateLimitedLog

__all__ = ["WARNING_INTERVAL", "VerdictLog"]

WARNING_INTERVAL = 10.0
"""Seconds between two WARNING lines for the same plugin and fault."""


class VerdictLog:
    """Writes the proxy's rejection lines to ``log`` (see the module docstring)."""

    def __init__(self, log: logging.Logger, *, interval: float = WARNING_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval = interval
        self._faults = RateLimitedLog(log, interval, clock=clock)

    def policy(self, where: str, client_address: str, client_id: str | None, code: int,
               message: str, extra: Mapping[str, object] | None = None, *,
               route: str | None = None) -> None:
        """One INFO line for a batch rejected by policy (or as undecodable), unless the same
        line for the same client host was written lately (see the module docstring)."""
        host = client_address.rpartition(":")[0] or client_address
        held = self._faults.allow(("policy", host, where, route, code, message))
        if held is None:
            return
        note = (f" ({held} more like it in the last {self.interval:.0f} s not logged)"
                if held else "")
        self.log.info("rejected %s from %s (client_id %r)%s: error %d: %s%s", where,
                      client_address, client_id, _on(route), code, message, note,
                      extra=_with_route(extra, route))

    def fault(self, plugin: str, kind: str, where: str, client_address: str,
              client_id: str | None, message: str, *, exception: BaseException | None = None,
              extra: Mapping[str, object] | None = None, route: str | None = None) -> None:
        """A WARNING for a plugin bug, unless one for ``(plugin, kind)`` was written lately."""
        self._faults.warning((plugin, kind), "rejected %s from %s (client_id %r)%s: %s", where,
                             client_address, client_id, _on(route), message,
                             more=" ({count} more like it in the last {interval:.0f} s not logged)",
                             exc_info=exception, extra=_with_route(extra, route))

    def observed(self, outcome: str, where: str, client_address: str, client_id: str | None,
                 route: str, link: str, detail: str,
                 extra: Mapping[str, object] | None = None) -> None:
        """An INFO line for a batch a route or link in observe mode would have rejected or
        transformed (it was forwarded), rate-limited per route, link and outcome like a
        fault."""
        suppressed = self._faults.allow(("observe", route, link, outcome))
        if suppressed is None:
            return
        note = (f" ({suppressed} more like it in the last {self.interval:.0f} s not logged)"
                if suppressed else "")
        self.log.info("would have %s %s from %s (client_id %r) on route %s, link %s "
                      "(observe mode: forwarded as received)%s%s", outcome, where,
                      client_address, client_id, route, link, detail, note,
                      extra=_with_route(extra, route))

    def rejected(self, verdict: Rejected, plugin: str, where: str, client_address: str,
                 client_id: str | None, extra: Mapping[str, object] | None = None, *,
                 route: str | None = None) -> None:
        """Log ``verdict`` as a policy rejection or a plugin fault."""
        if verdict.fault is None:
            self.policy(where, client_address, client_id, verdict.code, verdict.message, extra,
                        route=route)
        else:
            self.fault(plugin, verdict.fault, where, client_address, client_id,
                       verdict.message, exception=verdict.exception, extra=extra, route=route)


def _on(route: str | None) -> str:
    """`` on route NAME`` for a line about a routed batch, else nothing."""
    return "" if route is None else f" on route {route}"


def _with_route(extra: Mapping[str, object] | None,
                route: str | None) -> Mapping[str, object] | None:
    if route is None:
        return extra
    return {**(extra or {}), "route": route}
