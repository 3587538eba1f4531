"""bench/RESULTS.md: one current section per benchmark, each rewritten only by its bench.

RESULTS.md opens with the figures a reader wants today: for every benchmark one
section (its table, the exact command, the date and the machine) between two
markers named for it::

    <!-- bench:proxy -->
    ## Proxy: end to end (producer, proxy, broker)
    ...
    <!-- /bench:proxy -->

:func:`write_results` replaces what lies between a bench's markers (or appends
a new marked section when there is none) and leaves the rest of the file as it
was, so the benches can be re-run one at a time. A new benchmark picks a name
(lower case, ``-`` between words) and calls ``write_results(text, "name")``.

Older figures, the rounds of measuring and what was learned from them, are
kept in dated files under ``bench/results-archive/``; a round worth keeping is
written there by hand (with its command), never into RESULTS.md.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["ARCHIVE", "RESULTS", "markers", "replace_section", "write_results"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
"""The current results, next to the benches."""
ARCHIVE = Path(__file__).resolve().parent / "results-archive"
"""Where the earlier rounds are kept, one file per month (``2026-11.md``)."""

_NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def markers(name: str) -> tuple[str, str]:
    """The opening and closing marker lines of benchmark ``name``'s section."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"benchmark name {name!r}: use lower case letters, digits and '-'")
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def replace_section(document: str, name: str, text: str) -> str:
    """``document`` with the text between ``name``'s markers replaced by ``text``.

    A document without them gets a new marked section at its end; everything outside
    the markers is kept byte for byte.
    """
    opening, closing = markers(name)
    body = f"{opening}\n{text.strip()}\n{closing}"
    start = document.find(opening + "\n")
    end = document.find(closing, start + 1) if start >= 0 else -1
    if start < 0 or end < 0:
        return document.rstrip("\n") + "\n\n" + body + "\n"
    return document[:start] + body + document[end + len(closing):]


def write_results(text: str, name: str, path: Path = RESULTS) -> None:
    """Replace (or add) benchmark ``name``'s section of ``path`` with ``text``."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    path.write_text(replace_section(old, name, text))
