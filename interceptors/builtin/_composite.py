"""How a composite built-in (``chain``, ``topic_router``) loads the interceptors it runs.

:func:`link_loader` picks, in order: the composite's own ``plugins_dir``
setting; the :class:`~kiproxy.interceptors.api.PluginFactory` the loader
passed to its ``configure`` (the plugins directory it was itself loaded
from); otherwise installed modules and entry points only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors.api import PluginFactory
from kiproxy.interceptors.loader import load_interceptor

__all__ = ["link_loader"]


def link_loader(config: Mapping[str, Any], plugins: PluginFactory | None) -> PluginFactory:
    """The factory a composite configured with ``config`` loads its links with."""
    own = config.get("plugins_dir")
    if own is None and plugins is not None:
        return plugins

    def load(spec: str, link_config: Mapping[str, Any]) -> Any:
        return load_interceptor(spec, own, link_config)

    return load
