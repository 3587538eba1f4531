"""Python's cyclic garbage collector: short full collections in a long-running proxy.

Contract:

* :func:`freeze_imported` runs once per process, after the configuration is read and
  before the proxy builds its first configuration generation, opens a connection or
  forks workers. It collects, then moves every object the collector tracks at that
  moment into its permanent generation (``gc.freeze()``): the modules, classes and
  functions of the proxy and its libraries, the protocol and configuration schemas,
  some 40,000 objects. A full collection afterwards walks only what the proxy made
  since (generations, plugins, connections, requests) instead of everything.
* Nothing a reload replaces or a client creates is frozen, so a retired generation's
  and a closed connection's reference cycles are collected as before; frozen objects
  are still freed by reference counting. In forked workers the collector no longer
  writes into the frozen objects' headers, so more of the parent's pages stay shared
  (reference counting still writes to the objects a worker uses).
* Why: a full collection holds the interpreter for its whole walk. In a proxy
  carrying 350,000 records/s it ran every 20 s or so and took 16-36 ms, and every
  connection's requests waited that long (``bench/RESULTS.md``, "Sixth round").
"""

from __future__ import annotations

import gc

__all__ = ["freeze_imported"]


def freeze_imported() -> int:
    """Collect, then freeze every object tracked now; return how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
