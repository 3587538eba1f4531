"""Importing ``bench`` (the benchmarks, not an installed package) in tests.

The repository root is not put on ``sys.path``: that would also make the bare
``protocol``, ``interceptors``, ``proxy`` and ``pipelines`` folders importable for the
rest of the session and hide an import that only works from a checkout. Instead the
``bench`` package alone is registered from its folder, once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> None:
    """Make ``import bench.…`` work (idempotent)."""
    if "bench" in sys.modules:
        return
    folder = ROOT / "bench"
    spec = importlib.util.spec_from_file_location(
        "bench", folder / "__init__.py", submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module
    spec.loader.exec_module(module)


load_bench()
