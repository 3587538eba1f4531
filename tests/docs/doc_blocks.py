"""The fenced code blocks of the README and the documentation, with their test markers.

A block is tested according to the HTML comment on the nearest non-blank line
above it, ``<!-- test: KIND ARGS -->``; KIND is ``run``, ``plugin``, ``config``,
``config load`` or ``skip``. ARGS are words (``fails``, ``background``) and
``name="text"``, ``name={json}`` or ``name=number`` arguments. A page whose
text holds the line ``<!-- test: fresh-checkout -->`` before its first block
runs its ``run`` blocks in one fresh copy of the checkout
(``tests/docs/fresh_checkout.py``); the other pages' ``run`` blocks run in the
checkout itself (``tests/docs/test_examples.py``).

A ``skip`` marker's reason, on a block of any language, is one of two kinds
(:func:`skip_reason_problem`):

- it names, as a pytest node id (``tests/x/test_y.py::test_z``), an existing
  test that runs the same command line (a file name alone is not enough), or
- it begins with ``cannot run here:`` (:data:`CANNOT_RUN`) and says precisely
  what the block needs that a CI machine with only the package registries
  (PyPI, Debian, npm, Maven Central, crates.io for the host target, the Go
  proxy) cannot have: a cluster at an address of the reader's, a Docker engine,
  a Kubernetes cluster, a toolchain target none of them serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED_LANGUAGES = {"sh", "python", "yaml"}
MARKER = re.compile(r"<!--\s*test:\s*(?P<kind>run|plugin|config load|config|skip)\b"
                    r"(?P<args>.*?)-->")
PAGE_MARKER = "<!-- test: fresh-checkout -->"
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
FENCE = re.compile(r"^(`{3,})(\w*)")
#: A pytest node id in a skip reason: ``tests/x/test_y.py::test_z`` (``::Class::test_z``).
NODE_ID = re.compile(r"(?<![\w/.-])(?P<file>tests/[\w/.-]+\.py)(?:::(?P<names>[\w:]+))?")

#: How a skip reason that names no test begins.
CANNOT_RUN = "cannot run here:"


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with its test marker (if any)."""

    page: Path
    line: int
    language: str
    code: str
    kind: str | None
    args: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def arg(self, name: str) -> str | None:
        """A ``name="value"``, ``name={json}`` or ``name=number`` argument of the marker."""
        found = re.search(rf'\b{name}=("(?P<q>[^"]*)"|(?P<j>\{{.*\}})|(?P<n>[\d.]+))',
                          self.args)
        if found is None:
            return None
        return next(g for g in found.group("q", "j", "n") if g is not None)

    def flag(self, word: str) -> bool:
        """Whether the marker holds the bare word ``word`` (``fails``, ``background``)."""
        bare = re.sub(r'\w+=("[^"]*"|\{.*\}|[\d.]+)', "", self.args)
        return word in bare.split()


def _include_snippets(code: str) -> str:
    lines = []
    for line in code.splitlines():
        found = SNIPPET.match(line.strip())
        lines.append((ROOT / found.group("path")).read_text().rstrip("\n") if found else line)
    return "\n".join(lines) + "\n"


def blocks(page: Path) -> Iterator[Block]:
    """The fenced blocks of ``page``, top to bottom."""
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, language = i, fence.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(above)
        yield Block(page=page, line=start + 1, language=language,
                    code=_include_snippets("\n".join(lines[start + 1:end])),
                    kind=marker.group("kind") if marker else None,
                    args=marker.group("args") if marker else "")
        i = end + 1


def page_marker_line(page: Path) -> int | None:
    """The 1-based line of ``page``'s ``fresh-checkout`` marker, or None."""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() == PAGE_MARKER:
            return number
    return None


def is_fresh_checkout(page: Path) -> bool:
    return page_marker_line(page) is not None


def missing_node_ids(reason: str) -> list[str]:
    """The test files and pytest node ids a skip reason names that do not exist.

    ``tests/a/test_b.py::test_c`` needs the file and a ``def``/``class`` of each
    name; a bare ``tests/a/test_b.py`` needs the file.
    """
    missing = []
    for found in NODE_ID.finditer(reason):
        path = ROOT / found.group("file")
        names = (found.group("names") or "").split("::")
        if not path.is_file():
            missing.append(f"{found.group(0)} (no such file)")
            continue
        text = path.read_text(encoding="utf-8")
        for name in filter(None, names):
            if not re.search(rf"^\s*(async\s+def|def|class)\s+{re.escape(name)}\b", text, re.M):
                missing.append(f"{found.group(0)} ({path.name} defines no {name})")
                break
    return missing


def skip_reason_problem(reason: str) -> str | None:
    """What is wrong with a skip marker's ``reason``, or None if it is of a kind the module
    docstring allows."""
    reason = reason.strip()
    if missing := missing_node_ids(reason):
        return f"names tests that do not exist: {', '.join(missing)}"
    if reason.startswith(CANNOT_RUN):
        if len(reason) - len(CANNOT_RUN) < 20:
            return f"say after {CANNOT_RUN!r} what the block needs that CI cannot have"
        return None
    if not any(found.group("names") for found in NODE_ID.finditer(reason)):
        return ("name the test that runs the same command as tests/x/test_y.py::test_z "
                f"(a file is not enough), or begin with {CANNOT_RUN!r} and say why not")
    return None


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
