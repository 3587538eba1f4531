"""Errors of the pipelines that a user can act on.

Each message says what was wrong and what to do; the CLI prints it and exits
non-zero without a traceback.
"""

from __future__ import annotations

__all__ = ["JavaMissing", "PipelineError"]


class PipelineError(Exception):
    """A replay or report cannot run as asked (bad input, unknown topic, broker error)."""


class JavaMissing(PipelineError):
    """No Java runtime that PySpark can use was found."""
