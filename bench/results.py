"""bench/RESULTS.md: every benchmark owns one ``## `` section and rewrites only that one.

:func:`write_results` replaces (or appends) the section whose heading starts
``text`` and keeps every other section as it was, so the benches
(``bench.codec``, ``bench.isolation``, ``bench.proxy``) can be re-run one at a
time.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["RESULTS", "replace_section", "write_results"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
"""The recorded results, next to the benches."""


def replace_section(document: str, heading: str, text: str) -> str:
    """``document`` with the ``heading`` section (up to the next ``## ``) replaced by ``text``.

    The section is appended when the document has none; other sections are kept.
    """
    text = text.rstrip("\n") + "\n"
    start = document.find(heading + "\n")
    if start < 0:
        return document.rstrip("\n") + "\n\n" + text
    nxt = re.search(r"^## ", document[start + len(heading):], re.MULTILINE)
    if nxt is None:
        return document[:start] + text
    end = start + len(heading) + nxt.start()
    return document[:start] + text + "\n" + document[end:]


def write_results(text: str, heading: str, path: Path = RESULTS) -> None:
    """Replace (or add) the ``heading`` section of ``path`` with ``text``, keeping the others."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    path.write_text(replace_section(old, heading, text))
