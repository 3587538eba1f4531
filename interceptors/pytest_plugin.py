"""pytest fixtures for plugin authors (entry point ``pytest11``, active where kiproxy is installed).

* ``make_batch`` / ``make_record``: :func:`kiproxy.interceptors.testing.make_batch`
  and :func:`~kiproxy.interceptors.testing.make_record`.
* ``kiproxy_run``: :func:`~kiproxy.interceptors.testing.run_interceptor` - the
  proxy's verdict on one batch, as an :class:`~kiproxy.interceptors.testing.Outcome`
  (``mode="observe"``: as a route in observe mode, the verdict in ``Outcome.would``).
* ``kiproxy_load``: :func:`~kiproxy.interceptors.testing.load` - a plugin loaded
  by spec as the proxy loads it; every plugin it loaded is closed after the test.
* ``make_consumed_batch`` and ``kiproxy_consume``: the fetch side's
  :func:`~kiproxy.interceptors.testing.make_consumed_batch` and
  :func:`~kiproxy.interceptors.testing.run_consume` - what a consumer through the proxy
  would read of a batch, or the partition's refusal.

Loaded by every pytest run where kiproxy is installed, so this module imports
nothing of kiproxy until a test asks for one of its fixtures. Turn it off
with ``-p no:kiproxy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["kiproxy_consume", "kiproxy_load", "kiproxy_run", "make_batch",
           "make_consumed_batch", "make_record"]


@pytest.fixture
def make_batch() -> Callable[..., Any]:
    """Build a RecordBatch: ``make_batch("a", "b", topic="orders")``."""
    from kiproxy.interceptors.testing import make_batch as build

    return build


@pytest.fixture
def make_record() -> Callable[..., Any]:
    """Build a Record: ``make_record("value", key="k", headers=[("h", "v")])``."""
    from kiproxy.interceptors.testing import make_record as build

    return build


@pytest.fixture
def kiproxy_run() -> Callable[..., Any]:
    """Run an interceptor on a batch by the proxy's rules: ``kiproxy_run(plugin, batch)``;
    ``kiproxy_run(plugin, batch, mode="observe")`` as a route in observe mode (the
    outcome's ``would`` holds the observed verdict)."""
    from kiproxy.interceptors.testing import run_interceptor

    return run_interceptor


@pytest.fixture
def make_consumed_batch() -> Callable[..., Any]:
    """A batch as a fetch-side hook gets it: ``make_consumed_batch(make_batch("a"),
    base_offset=40)``."""
    from kiproxy.interceptors.testing import make_consumed_batch as build

    return build


@pytest.fixture
def kiproxy_consume() -> Callable[..., Any]:
    """Run a fetch-side hook on a batch by the proxy's rules (block hooks first):
    ``kiproxy_consume(plugin, batch)``, the ``ConsumedBatch`` a consumer would read or
    the ``ConsumeRefusal`` of its partition."""
    from kiproxy.interceptors.testing import run_consume

    return run_consume


@pytest.fixture
def kiproxy_load() -> Iterator[Callable[..., Any]]:
    """Load a plugin by spec: ``kiproxy_load("mod:Class", plugins_dir=..., config={...})``."""
    from kiproxy.interceptors.testing import Plugin, load

    loaded: list[Plugin] = []

    def _load(spec: str, **kwargs: Any) -> Plugin:
        plugin = load(spec, **kwargs)
        loaded.append(plugin)
        return plugin

    yield _load
    for plugin in reversed(loaded):
        plugin.close()
