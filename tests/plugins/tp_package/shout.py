"""A submodule of the ``tp_package`` plugin package."""

from __future__ import annotations


def shout(value: bytes, suffix: bytes) -> bytes:
    """``value`` upper-cased, with ``suffix``."""
    return value.upper() + suffix
