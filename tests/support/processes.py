"""The environment of the kiproxy processes the tests start (``kiproxy run``, ``kiproxy dev``).

:func:`runtime_env` is this process's environment with unbuffered output and, first on
``PYTHONPATH``, :data:`RUNTIME_ONLY`: a folder whose ``hypothesis`` fails to import, so
that a started proxy imports what an installed one does and not the test extra's
Hypothesis (kio imports it when it is there: a third of a proxy's start-up). A test of a
proxy that needs Hypothesis would start it without this environment; none does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RUNTIME_ONLY", "runtime_env"]

RUNTIME_ONLY = Path(__file__).resolve().parent / "runtime_only"


def runtime_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``PYTHONUNBUFFERED=1``,
    :data:`RUNTIME_ONLY` first on ``PYTHONPATH``, and ``extra`` over it (an ``extra``
    ``PYTHONPATH`` goes before the rest)."""
    env = {**(os.environ if base is None else base), "PYTHONUNBUFFERED": "1"}
    path = [extra.pop("PYTHONPATH", ""), str(RUNTIME_ONLY), env.get("PYTHONPATH", "")]
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    return env
