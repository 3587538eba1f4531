"""Built-in interceptors. Each uses only the public API in :mod:`interceptors`."""
