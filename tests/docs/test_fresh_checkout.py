"""Pages marked ``<!-- test: fresh-checkout -->`` work, block after block, in a fresh clone.

One test per page (its blocks depend on each other): its ``run`` blocks run top
to bottom in one copy of the checkout, from a clean environment, as
``tests/docs/fresh_checkout.py`` describes. The markers on such a page:

- ``run``: exits 0; ``expect="TEXT"``: TEXT is in its output (stdout and stderr).
- ``run fails expect="TEXT"``: exits non-zero, with TEXT in its output (a page
  that shows an error).
- ``run background ready="TEXT"``: started and left running for the following
  blocks once TEXT is in its output (``timeout=SECONDS``, 240 by default);
  stopped at the end of the page.
- ``timeout=SECONDS`` on any ``run`` block overrides the 900 s a block may take.

What it costs, and why it stays cheap. A page's copy takes well under a
second. Its installs (``python3 -m venv``, ``pip install '.[extra]'``) use
pip's cache under ``HOME``, so dependencies are not downloaded again, but pip
builds the checkout itself each time, and the build compiles the Cython
extensions (most of the build's CPU). ``setup.py`` keeps compiled extensions in
the folder ``KIPROXY_EXT_CACHE`` names, keyed by a hash of everything the
compiler reads (the ``.pyx`` and ``setup.py``'s text, Cython's version, the
Python ABI), and copies a cached one instead of compiling it again. This test
points it at one folder per pytest session (tests/conftest.py's
``extension_cache``, which the wheel the packaging tests build shares) unless
the environment already names one, so each session compiles each extension
once, for real, and every later build of the session reuses that result. The
pages' pip does not byte-compile what it installs (``PIP_COMPILE=false``):
that was half the CPU of an install (record-encryption.md's: 79 -> 41 s), for
modules a page mostly never imports; Python compiles the ones it imports. Measured on a
2-core Xeon VM (CPU seconds, the wall time varies with the machine's load): a
build of the checkout then costs about 10 s of CPU, most of it pip's isolated
build environment; the README's page about 20 s of CPU (40 to 130 s of wall
time), Getting started about 17 s. ``-rP`` prints each block's times.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from doc_blocks import PAGES, ROOT, blocks, is_fresh_checkout
from fresh_checkout import PageFailure, Workspace, clean_environment

FRESH_PAGES = [page for page in PAGES if is_fresh_checkout(page)]
#: A whole page: installs, a broker or two, Maven builds on a cold cache.
PAGE_TIMEOUT = 3600


@pytest.fixture(scope="session")
def page_environment(extension_cache: str) -> Iterator[dict[str, str]]:
    """The clean environment of every page, with one extension cache for the session."""
    env = clean_environment()
    env["KIPROXY_EXT_CACHE"] = extension_cache
    # pip byte-compiles every module it installs unless told not to; a page imports a few of
    # them, which Python compiles as it imports them. (``PIP_COMPILE``: the ``--compile``
    # option's setting; ``PIP_NO_COMPILE=1`` would read as ``--compile``.)
    env["PIP_COMPILE"] = "false"
    yield env


@pytest.mark.timeout(PAGE_TIMEOUT)
@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT)))
                                  for p in FRESH_PAGES])
def test_page_runs_as_written_in_a_fresh_checkout(page: Path, tmp_path: Path,
                                                  page_environment: dict[str, str]) -> None:
    runnable = [b for b in blocks(page) if b.kind == "run"]
    assert runnable, f"{page.name} is marked fresh-checkout but has no run block"
    failure: PageFailure | None = None
    with Workspace.create(tmp_path, dict(page_environment)) as workspace:
        for block in runnable:
            try:
                workspace.run(block)
            except PageFailure as exc:
                failure = exc
                break
            finally:  # shown with -rP, or when the page fails
                print(*(f"{seconds:6.1f} s, {cpu:5.1f} s CPU  {where}"
                        for where, seconds, cpu in workspace.timings[-1:]))
    if failure is not None:  # outside the handler: the report once, without a traceback
        pytest.fail(str(failure), pytrace=False)
    # Passed: its virtualenvs go (hundreds of MB with Spark); a failed page's stay to look into.
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_workspace_is_a_clean_shell_that_carries_state(tmp_path: Path) -> None:
    """The harness itself: state carries from block to block, the virtualenv does not leak in."""
    from doc_blocks import Block

    def block(code: str, args: str = "", language: str = "sh") -> Block:
        return Block(page=ROOT / "README.md", line=1, language=language, code=code,
                     kind="run", args=args)

    environ = {**os.environ, "VIRTUAL_ENV": "/nowhere", "MAKEFLAGS": "-j9",
               "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    with Workspace.create(tmp_path, clean_environment(environ)) as workspace:
        assert (workspace.root / "README.md").is_file()
        assert (workspace.root / "kiproxy" / "proxy").is_symlink()
        assert not (workspace.root / ".venv").exists()
        workspace.run(block('test -z "${VIRTUAL_ENV:-}"; test -z "${MAKEFLAGS:-}"\n'
                            'case ":$PATH:" in *"/.venv/bin:"*) exit 1;; esac\n'
                            "export GREETING=hello; mkdir sub; cd sub"))
        assert workspace.run(block('echo "$GREETING from $(basename "$PWD")"',
                                   'expect="hello from sub"')).strip() == "hello from sub"
        workspace.run(block("unset GREETING"))
        workspace.run(block('test -z "${GREETING:-}"'))
        workspace.run(block("echo no such thing >&2; exit 3", 'fails expect="no such thing"'))
        with pytest.raises(PageFailure, match="exited 0 but the page shows it failing"):
            workspace.run(block("true", "fails"))
        with pytest.raises(PageFailure, match="exited 1"):
            workspace.run(block("false; echo not reached"))
        workspace.run(block("echo starting; echo ready now; exec sleep 600",
                            'background ready="ready now" timeout=30'))
        with pytest.raises(PageFailure, match="output of the background block"):
            workspace.run(block("exit 4"))
        process = workspace.background[0].process
    assert process.poll() is not None  # stopped at the end of the page
