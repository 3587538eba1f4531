"""Helpers shared by the test plugins (a plugin may import its siblings)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["topic_pattern"]


def topic_pattern(config: Mapping[str, Any], default: str = ".*") -> re.Pattern[str]:
    """The regex of ``config["topics"]`` (matched against the whole topic name)."""
    return re.compile(str(config.get("topics", default)))
