"""How a composite built-in (``chain``, ``topic_router``) names and loads what it runs.

:class:`Link` is one interceptor a composite runs: ``{interceptor: MODULE:CLASS,
config: {...}}``, or the name alone. :func:`link_loader` picks, in order: the
composite's own ``plugins_dir`` setting; the
:class:`~kiproxy.interceptors.api.PluginFactory` the loader passed to its
``configure`` (the plugins directory it was itself loaded from); otherwise
installed modules and entry points only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from kiproxy.interceptors.api import PluginFactory, PluginSettings
from kiproxy.interceptors.loader import load_interceptor

__all__ = ["Link", "LinkSettings", "link_loader"]


class LinkSettings(PluginSettings):
    """One interceptor a composite runs."""

    interceptor: str = Field(min_length=1)
    """``MODULE:CLASS`` (plugins dir first) or an entry-point name."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Passed to its ``configure()``."""


def _spec_alone(value: Any) -> Any:
    return {"interceptor": value} if isinstance(value, str) else value


Link = Annotated[LinkSettings, BeforeValidator(_spec_alone)]
"""A :class:`LinkSettings`, or its ``interceptor`` alone."""


def link_loader(plugins_dir: str | None, plugins: PluginFactory | None) -> PluginFactory:
    """The factory a composite with its own ``plugins_dir`` setting loads its links with."""
    if plugins_dir is None and plugins is not None:
        return plugins

    def load(spec: str, link_config: Mapping[str, Any]) -> Any:
        return load_interceptor(spec, plugins_dir, link_config)

    return load
