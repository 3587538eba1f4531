"""The pipelines tests' one in-process SparkSession.

Every module here that runs ``kiproxy replay`` or ``kiproxy report`` in this
process asks for ``spark``: one local session (two cores, two shuffle
partitions, on loopback) for the whole package, started when a test first asks
for it and stopped after the package's last test. A session per module would
pay the JVM's start-up again each time for the same settings; ``spark_session``
reuses an active session, so the CLI run in-process picks this one up.
Replays that run as their own driver process (``--master spark://...``,
``kiproxy replay`` as a subprocess) start a JVM of their own and do not see it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kiproxy.pipelines.session import spark_session


@pytest.fixture(scope="package")
def spark() -> Iterator[Any]:
    with spark_session("kiproxy-tests", "local[2]", {
        "spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2",
    }) as session:
        yield session
