"""Small, dependency-free HTML pages for the reports: headings, tables and images.

(Not ``html.py``: ``spark-submit .../kiproxy/pipelines/__main__.py`` puts this folder
first on ``sys.path``, where a module named like the standard library's hides it.)"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["page", "table"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: .6em 0; font-size: .92em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
.note { color: #666; font-size: .9em; } code { background: #f6f6f6; padding: 0 .2em; }
"""


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"<td>{html.escape(str(value if value is not None else ''))}</td>"
    if isinstance(value, int):
        return f'<td class="n">{value:,}</td>'
    if isinstance(value, float):
        return f'<td class="n">{value:,.2f}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, limit: int = 200) -> str:
    """An HTML table; at most ``limit`` rows, with a note saying how many were left out."""
    body = []
    total = 0
    for row in rows:
        total += 1
        if total <= limit:
            body.append("<tr>" + "".join(_cell(v) for v in row) + "</tr>")
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"
    note = f'<p class="note">{total - limit:,} more rows in the data files.</p>' \
        if total > limit else ""
    if not total:
        return '<p class="note">None.</p>'
    return f"<table>{head}{''.join(body)}</table>{note}"


def page(title: str, sections: Iterable[tuple[str, str]], *, intro: str = "") -> str:
    """A whole page: ``sections`` are ``(heading, inner HTML)`` pairs."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
             f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    if intro:
        parts.append(intro)
    for heading, inner in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>{inner}")
    parts.append("</body></html>\n")
    return "".join(parts)
