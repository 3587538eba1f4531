"""Compiled per-record loops for plugins that seal values with a cipher of their own.

Contract: :func:`seal_values` replaces every non-null value of a run of records by
``nonce + encrypt(nonce, value, aad)`` and appends one marker header; :func:`open_values`
undoes it for records that all carry the same marker, or answers None so that the
plugin's own general path can say which record is not of that shape or does not open.
The cipher (``encrypt``/``decrypt``, e.g. ``cryptography``'s ``AESGCM``) and the nonces
are the caller's: these loops only spare each record the interpreter's per-record work
(the ``record_encryption`` built-in opens a 1 KiB record in about half the CPU with
them). Both are the record codec's (:mod:`kiproxy.protocol.records`), offered here so
that plugins, built-in ones included, need only the plugin API.
"""

from __future__ import annotations

from kiproxy.protocol.records import open_values, seal_values

__all__ = ["open_values", "seal_values"]
