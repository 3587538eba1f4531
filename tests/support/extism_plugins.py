"""The Extism test plugins, compiled from AssemblyScript once and cached.

The sources are ``tests/extism/plugins/*.ts``, built with Extism's official
AssemblyScript PDK (``@extism/as-pdk``) and the AssemblyScript compiler, both
pinned in ``tests/extism/package.json`` and its lock file. :func:`build` copies
the sources to ``~/.cache/kiproxy/extism/<hash of sources and lock>/``, runs
``npm ci`` there and compiles every plugin; a second run with the same sources
finds the modules and builds nothing. Without Node.js or npm it raises
:class:`NoToolchain`, which the fixtures turn into a skip saying so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["PLUGINS", "SOURCES", "NoToolchain", "build"]

SOURCES = Path(__file__).parent.parent / "extism"
PLUGINS = ("uppercase", "shouting", "loop", "twice", "config", "grow", "huge", "trap",
           "novalue")
"""uppercase (also exports transform_batch), the "stop shouting" validator, an
infinite loop, two records for one, one that reads the config value ``greeting``; and the
hostile ones: ``grow`` allocates without end, ``huge`` answers every record with a 50 MiB
value, ``trap`` traps on every call, ``novalue`` answers without a ``"value"``."""


class NoToolchain(Exception):
    """Node.js or npm is missing (the message says which)."""


def _inputs() -> list[Path]:
    return sorted([SOURCES / "package.json", SOURCES / "package-lock.json",
                   *(SOURCES / "plugins").glob("*.ts")])


def _key() -> str:
    digest = hashlib.sha256()
    for path in _inputs():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build(cache: Path | None = None) -> dict[str, Path]:
    """Plugin name -> compiled ``.wasm`` (built on first use, cached by source hash)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise NoToolchain(f"{tool} is not installed: the Extism test plugins are "
                              "compiled from AssemblyScript with npm packages")
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    out = root / "kiproxy" / "extism" / _key()
    wasm = {name: out / f"{name}.wasm" for name in PLUGINS}
    if all(p.is_file() for p in wasm.values()):
        return wasm
    work = out.with_name(out.name + f".build-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    (work / "plugins").mkdir(parents=True)
    for path in _inputs():
        target = work / ("plugins" if path.suffix == ".ts" else "") / path.name
        shutil.copyfile(path, target)
    _run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], work)
    for name in PLUGINS:
        _run([str(work / "node_modules" / ".bin" / "asc"), f"plugins/{name}.ts",
              "--outFile", f"{name}.wasm", "--use", "abort=plugins/common/abort",
              "--optimize", "--runtime", "stub"], work)
    if all(p.is_file() for p in wasm.values()):  # a build beside this one finished first
        shutil.rmtree(work, ignore_errors=True)
        return wasm
    shutil.rmtree(out, ignore_errors=True)  # what an interrupted build left
    try:
        work.rename(out)
    except OSError:  # one beside this one renamed its own meanwhile
        if not all(p.is_file() for p in wasm.values()):
            raise
        shutil.rmtree(work, ignore_errors=True)
    return wasm


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout}{done.stderr}")
