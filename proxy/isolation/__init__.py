"""Interceptors run in worker processes (the pool, its wire format and the worker
side); may import :mod:`kiproxy.proxy.observe` only."""
