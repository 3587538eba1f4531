"""Running a route's chain: the runner is :mod:`kiproxy.interceptors.chain`, shared with the
``chain`` built-in; the runtime names it from here.

Contract (see :mod:`kiproxy.interceptors.chain`): each link in order, judged by the verdict
after each one, a deadline of its own per link, links in observe mode only recorded, one
immutable :class:`ChainResult` out.
"""

from kiproxy.interceptors.chain import ChainResult, Judge, LoadedLink, Observed, run_chain

__all__ = ["ChainResult", "Judge", "LoadedLink", "Observed", "run_chain"]
