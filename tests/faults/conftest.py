"""Fixtures of the fault suites: the stand-in registry (see ``registry_standin.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .registry_standin import StandInRegistry


@pytest.fixture
def standin() -> Iterator[StandInRegistry]:
    """A healthy stand-in registry on loopback (plain HTTP), closed after the test."""
    registry = StandInRegistry()
    yield registry
    registry.close()
