"""Log lines that do not flood: at most one per key per interval, the rest counted.

A fault that repeats on every batch or every connection (a plugin bug, a client
host sending bad batches, an unreachable broker) must cost an operator one line
per interval, not one per occurrence. :class:`RateLimitedLog` keys lines by what
repeats (a plugin and fault, a client host, a broker address): the first line
for a key is written at once, later ones within ``interval`` seconds are held
back and counted, and the next line written for the key says how many were.
A burst that stops is not left uncounted: when lines are held back on a thread
running an asyncio event loop, :data:`SUMMARY` is written ``interval`` seconds after
the first of them, counting them and giving the last one's text - unless a line for
the key was written first (it counted them). Every line held back is so counted in
some line within about an interval; without a running loop (a plugin's own thread)
the count waits for the key's next line. :meth:`RateLimitedLog.summary` serves a
caller that writes counts of its own on a timer instead (and uses :meth:`allow`).

Contract: standard library only (``logging``, a monotonic clock, the running
``asyncio`` loop's timers for summaries); no thread, no I/O beyond the logger's own.
It holds one small entry per key (and the last line held back, while its summary is
due) and forgets them all past ``max_keys``, so a flood of distinct keys cannot
grow it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping

__all__ = ["MORE_IN_INTERVAL", "MORE_LIKE_IT", "SUMMARY", "RateLimitedLog"]

MORE_IN_INTERVAL = " ({count} more in the last {interval:g} s)"
"""The usual ``more`` of :meth:`RateLimitedLog.warning`: how many lines were held back."""

MORE_LIKE_IT = " ({count} more like it in the last {interval:g} s not logged)"
"""A ``more`` for lines whose text differs from one to the next (another client, another
topic-partition): the count is of lines *like* the one it ends."""

SUMMARY = MORE_LIKE_IT[2:-1] + "; the last: "
"""What starts the line that counts lines held back when no other line came to count
them; the last one's text follows."""

_Held = tuple[int, str, tuple[object, ...], Mapping[str, object] | None]
"""A line held back: its level, format, arguments and ``extra=`` fields."""


class RateLimitedLog:
    """At most one line per key per ``interval`` seconds on ``logger`` (see the module)."""

    __slots__ = ("_clock", "_held", "_max_keys", "_timers", "_windows", "interval", "logger")

    def __init__(self, logger: logging.Logger, interval: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000) -> None:
        self.logger = logger
        """Where the lines go."""
        self.interval = interval
        """Seconds after a line during which lines for the same key are held back."""
        self._clock = clock
        self._max_keys = max_keys
        self._windows: dict[Hashable, list[float | int]] = {}  # key -> [opened at, held back]
        self._held: dict[Hashable, _Held] = {}  # key -> the last line held back
        self._timers: dict[Hashable, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}

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
            self._held.clear()
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
            self._hold(key, (level, msg, args, extra))
            return False
        timer = self._timers.pop(key, None)
        if timer is not None:  # this line counts what was held back: no summary
            self._held.pop(key, None)
            if timer[0] is _running_loop():  # (else it finds nothing held, and ends)
                timer[1].cancel()
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

    def _hold(self, key: Hashable, line: _Held) -> None:
        """Keep ``line``, held back for ``key``; the first held back since the key's last
        line has the summary written :attr:`interval` seconds later, on the running loop
        (a timer left on another loop, closed since, is replaced)."""
        loop = _running_loop()
        if loop is None or not math.isfinite(self.interval):
            return  # no loop here (or no end to the window): the key's next line counts it
        self._held[key] = line
        timer = self._timers.get(key)
        if timer is None or timer[0] is not loop:
            self._timers[key] = (loop, loop.call_later(self.interval, self._summarize, key))

    def _summarize(self, key: Hashable) -> None:
        """The line counting what ``key`` held back, with the last one's text."""
        self._timers.pop(key, None)
        line = self._held.pop(key, None)
        if line is None:
            return
        count = self.summary(key)
        if not count:
            return
        level, msg, args, extra = line
        head = SUMMARY.format(count=count, interval=self.interval).replace("%", "%%")
        self.logger.log(level, head + msg, *args, extra=extra)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
