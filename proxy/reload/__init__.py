"""Reloading the configuration all or nothing (SIGHUP, ``POST /reload``, the file
watch); may import :mod:`kiproxy.proxy.config` only."""
