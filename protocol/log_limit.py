"""Log lines that do not flood: at most one per key per interval, the rest counted.

A fault that repeats on every batch or every connection (a plugin bug, a client
host sending bad batches, an unreachable broker) must cost an operator one line
per interval, not one per occurrence. :class:`RateLimitedLog` keys lines by what
repeats (a plugin and fault, a client host, a broker address): the first line
for a key is written at once, later ones within ``interval`` seconds are held
back and counted, and the next line written for the key says how many were.
:meth:`RateLimitedLog.summary` serves a caller that writes the count on a
timer instead of with the next line.

Contract: standard library only (``logging``, a monotonic clock); no event loop,
no thread, no I/O beyond the logger's own. It holds one small entry per key and
forgets them all past ``max_keys``, so a flood of distinct keys cannot grow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping

__all__ = ["MORE_IN_INTERVAL", "RateLimitedLog"]

MORE_IN_INTERVAL = " ({count} more in the last {interval:g} s)"
"""The usual ``more`` of :meth:`RateLimitedLog.warning`: how many lines were held back."""


class RateLimitedLog:
    """At most one line per key per ``interval`` seconds on ``logger`` (see the module)."""

    __slots__ = ("_clock", "_max_keys", "_windows", "interval", "logger")

    def __init__(self, logger: logging.Logger, interval: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000) -> None:
        self.logger = logger
        """Where the lines go."""
        self.interval = interval
        """Seconds after a line during which lines for the same key are held back."""
        self._clock = clock
        self._max_keys = max_keys
        self._windows: dict[Hashable, list[float | int]] = {}  # key -> [opened at, held back]

    def allow(self, key: Hashable) -> int | None:
        """``None`` if a line for ``key`` is held back now (and counted), else how many were
        held back since the last line for it (the caller writes the line)."""
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now - window[0] < self.interval:
            window[1] += 1
            return None
        if window is None and len(self._windows) >= self._max_keys:
            self._windows.clear()
        self._windows[key] = [now, 0]
        return 0 if window is None else int(window[1])

    def summary(self, key: Hashable) -> int:
        """How many lines for ``key`` were held back since the last line, for a summary line.

        The count starts again from zero and the window from now; when nothing was held
        back the key is forgotten, so its next line is written at once.
        """
        window = self._windows.get(key)
        if window is None or not window[1]:
            self._windows.pop(key, None)
            return 0
        held = int(window[1])
        self._windows[key] = [self._clock(), 0]
        return held

    def log(self, level: int, key: Hashable, msg: str, *args: object, more: str = "",
            exc_info: BaseException | None = None,
            extra: Mapping[str, object] | None = None) -> bool:
        """Write ``msg % args`` at ``level`` unless held back; ``True`` if it was written.

        ``more`` (a ``str.format`` template with ``{count}`` and ``{interval}``) is appended
        when lines were held back since the last one; ``exc_info`` adds that exception's
        traceback.
        """
        held = self.allow(key)
        if held is None:
            return False
        if held and more:
            msg += more.format(count=held, interval=self.interval).replace("%", "%%")
        self.logger.log(level, msg, *args, exc_info=exc_info, extra=extra)
        return True

    def warning(self, key: Hashable, msg: str, *args: object, more: str = "",
                exc_info: BaseException | None = None,
                extra: Mapping[str, object] | None = None) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args, more=more, exc_info=exc_info,
                        extra=extra)
