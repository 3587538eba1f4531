"""The one check of a plugin's config keys: a key it does not know is an error, not ignored.

A misspelt key (``sampeld: false``) silently ignored is a setting the operator
believes in and does not have. A plugin with typed settings (see
:mod:`kiproxy.interceptors.settings`) gets this from its model, with "did you
mean"; a plugin that reads a plain mapping can refuse unknown keys through
:func:`check_keys`, which names them and the keys it knows. Standard library only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["check_keys"]


def check_keys(config: Iterable[str], known: Collection[str], prefix: str = "") -> None:
    """Raise ``ValueError`` naming the keys of ``config`` that are not in ``known``.

    The message is ``{prefix}unknown key(s) a, b; known: c, d`` (both lists sorted);
    ``prefix`` says where the keys were (``"links[0]: "``).
    """
    unknown = set(config) - set(known)
    if unknown:
        raise ValueError(f"{prefix}unknown key(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(known))}")
