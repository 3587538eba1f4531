"""Log lines that do not flood, for plugins: :class:`RateLimitedLog`.

A plugin whose fault repeats on every batch (an outside service down, a bad answer)
writes one line per key per interval and counts the rest, as the proxy does for its
own faults; the class is :class:`kiproxy.protocol.log_limit.RateLimitedLog`, offered
here (with :data:`MORE_IN_INTERVAL`, the usual count of lines held back) so that
plugins, built-in ones included, need only the plugin API.
"""

from __future__ import annotations

from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog

__all__ = ["MORE_IN_INTERVAL", "RateLimitedLog"]
