"""What the two WebAssembly hosts (``wasm`` and ``extism``) share: the memory cap and the
backoff of a plugin that keeps crashing.

Contract:

* :data:`DEFAULT_MAX_MEMORY_BYTES` is the linear-memory cap of every Wasm instance
  that its config does not cap otherwise (``max_memory_bytes`` on both hosts; Extism's
  ``max_pages`` too). An instance lives in a pool of at most one per worker thread, so
  a plugin holds at most ``workers`` (``pool_size``) times the cap.
* :class:`Backoff` remembers a plugin's crashes (traps, out of memory, out of fuel).
  From the :data:`BACKOFF_AFTER`-th crash in a row on, the plugin is left alone for a
  period that starts at :data:`BACKOFF_FIRST_S` and doubles with each further crash
  up to :data:`BACKOFF_MAX_S`: meanwhile :meth:`Backoff.refusal` gives the message a
  batch is refused with at once (the last crash's reason), and no instance is built.
  A call that returns (whatever it answers) ends the backoff.
* :func:`mib` writes a byte count the way the messages do.
* Settings: a topic's entry is a file alone or a mapping of settings
  (:func:`file_or_settings`), and the keys it leaves out are the top level's
  (:func:`inherited`).

Thread-safe; standard library only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["BACKOFF_AFTER", "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "DEFAULT_MAX_MEMORY_BYTES",
           "Backoff", "file_or_settings", "inherited", "mib"]

DEFAULT_MAX_MEMORY_BYTES = 256 * 2**20
"""Linear memory of one Wasm instance, at most, unless its config says otherwise."""
BACKOFF_AFTER = 3
"""Crashes in a row before batches are refused without running the plugin: one or two
are the cost of a record that crashes it (the instance is rebuilt for the next batch)."""
BACKOFF_FIRST_S = 0.1
"""The first backoff period; each further crash doubles it."""
BACKOFF_MAX_S = 5.0
"""The longest backoff period."""


def mib(size: int) -> str:
    """``256 MiB`` (whole MiB), or ``1536 KiB``, or ``100 bytes``."""
    if size >= 2**20 and size % 2**20 == 0:
        return f"{size // 2**20} MiB"
    if size >= 2**10 and size % 2**10 == 0:
        return f"{size // 2**10} KiB"
    return f"{size} bytes"


def file_or_settings(key: str, what: str) -> Callable[[Any], Any]:
    """A settings model's before-validator: a file path alone is ``{key: PATH}``, a mapping
    is itself, anything else an error saying the entry is ``what`` or a mapping."""
    def entry(value: Any) -> Any:
        if isinstance(value, str):
            return {key: value}
        if not isinstance(value, Mapping):
            raise ValueError(f"expected {what} or a mapping of settings, got {value!r}")
        return value
    return entry


M = TypeVar("M", bound="BaseModel")


def inherited(entry: M, top: BaseModel, keys: Iterable[str]) -> M:
    """``entry`` with each of ``keys`` it does not set itself taken from ``top``."""
    return entry.model_copy(update={name: getattr(top, name) for name in keys
                                    if name not in entry.model_fields_set})


class Backoff:
    """A plugin's crashes in a row and, past :data:`BACKOFF_AFTER`, when it runs again."""

    __slots__ = ("_clock", "_crashes", "_lock", "_reason", "_until")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._crashes = 0
        self._reason = ""
        self._until = 0.0

    @property
    def crashes(self) -> int:
        """Crashes in a row so far."""
        return self._crashes

    def refusal(self) -> str | None:
        """Why a batch is refused now without running the plugin, or None: run it."""
        if not self._until:  # never backed off, or an answer ended it: no lock taken
            return None
        with self._lock:
            left = self._until - self._clock()
            if left <= 0:
                return None
            return (f"{self._reason} (it crashed {self._crashes} times in a row; its "
                    f"batches are refused without running it for {left:.1f} s more)")

    def crashed(self, reason: str) -> None:
        """The plugin crashed with ``reason`` (what the producer was told)."""
        with self._lock:
            self._crashes += 1
            self._reason = reason
            over = self._crashes - BACKOFF_AFTER
            if over >= 0:
                period = min(BACKOFF_FIRST_S * 2 ** min(over, 16), BACKOFF_MAX_S)
                self._until = self._clock() + period

    def answered(self) -> None:
        """A call returned: the crashes in a row are over."""
        if self._crashes:
            with self._lock:
                self._crashes = 0
                self._until = 0.0
