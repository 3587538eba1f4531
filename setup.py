"""Build the compiled record codec (``kiproxy.protocol._codec``) and the Avro payload check
(``kiproxy.interceptors.builtin.schema_registry._avro_check``); the rest is in pyproject.toml.

The codec is required (the proxy has no pure-Python record path), so a build
without a working C compiler stops with a message that says what to install
instead of a compiler traceback.

``KIPROXY_EXTENSIONS=codec`` builds the codec alone: ``make run`` sets it, since
the demo never loads the Avro check (only the ``schema_registry`` built-in does,
and its extra is not installed there; installing that extra with pip builds both
again). Unset, both are built, as for a wheel and ``make test``.

``KIPROXY_EXT_CACHE=DIR`` keeps each compiled extension in DIR under a hash of
everything its compilation reads (its ``.pyx``, this file, Cython's version,
the Python ABI, the compiler and its flags), and a later build with the same
hash copies it instead of running Cython and the C compiler again. The docs
tests, which install the checkout into a fresh virtualenv for every page, set it
(``tests/docs/test_fresh_checkout.py``); unset, every build compiles.
"""

import hashlib
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

import Cython
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_COMPILER = (
    "kafka-interceptor-proxy: building the compiled record codec (kiproxy.protocol._codec) "
    "needs a C compiler and the Python headers, and none worked ({error}). Install them "
    "(Debian/Ubuntu: apt-get install gcc python3-dev; Fedora: dnf install gcc python3-devel; "
    "macOS: xcode-select --install), or install a prebuilt wheel of kafka-interceptor-proxy."
)
CYTHON_DIRECTIVES = {
    "language_level": "3",
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "embedsignature": True,
}
HERE = Path(__file__).resolve().parent
ALWAYS_INLINE = "inline __attribute__((always_inline))"


def _cache_key(ext: Extension) -> str:
    """A hash of what compiling ``ext`` reads: its sources, this file, the toolchain."""
    digest = hashlib.sha256()
    for source in sorted(ext.sources):
        folder = (HERE / source).parent
        for path in sorted([*folder.glob("*.pyx"), *folder.glob("*.pxd"), *folder.glob("*.pxi")]):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    toolchain = [Cython.__version__, sys.version, platform.platform(),
                 str(sysconfig.get_config_var("EXT_SUFFIX")), *ext.extra_compile_args,
                 *(os.environ.get(k, "") for k in ("CC", "CFLAGS", "LDFLAGS", "CPPFLAGS"))]
    digest.update("\0".join(toolchain).encode())
    return digest.hexdigest()[:32]


class BuildCodec(build_ext):
    """``build_ext`` that runs Cython per extension, reuses ``KIPROXY_EXT_CACHE``, and whose
    compiler failures name what is missing."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # distutils' CompileError/LinkError/PlatformError
            raise SystemExit(NO_COMPILER.format(error=f"{type(exc).__name__}: {exc}")) from exc

    def build_extension(self, ext: Any) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        cache = os.environ.get("KIPROXY_EXT_CACHE")
        cached = Path(cache) / _cache_key(ext) / target.name if cache else None
        if cached is not None and cached.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, target)
            return
        try:
            (compiled,) = cythonize([ext], compiler_directives=CYTHON_DIRECTIVES, quiet=True)
            ext.sources = compiled.sources  # the generated .c
            super().build_extension(ext)
        except Exception as exc:
            raise SystemExit(NO_COMPILER.format(error=f"{type(exc).__name__}: {exc}")) from exc
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.partial")
            shutil.copy2(target, partial)
            partial.replace(cached)  # whole or absent, when two builds share the cache


EXTENSIONS = {
    # Every ``cdef inline`` helper of the codec (varint reads, the record walker) is
    # inlined where the per-record loops call it: left to its size heuristics, the
    # compiler outlines some of them, and which ones moves as the module grows.
    "codec": Extension("kiproxy.protocol._codec", ["kiproxy/protocol/_codec.pyx"],
                       extra_compile_args=["-O3", f"-DCYTHON_INLINE={ALWAYS_INLINE}"]),
    "avro_check": Extension("kiproxy.interceptors.builtin.schema_registry._avro_check",
                            ["kiproxy/interceptors/builtin/schema_registry/_avro_check.pyx"],
                            extra_compile_args=["-O3"]),
}


def _selected() -> list[Extension]:
    """The extensions ``KIPROXY_EXTENSIONS`` names (comma-separated), all when it is unset."""
    wanted = [n.strip() for n in os.environ.get("KIPROXY_EXTENSIONS", "").split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(EXTENSIONS))
    if unknown or (wanted and "codec" not in wanted):
        raise SystemExit(f"kafka-interceptor-proxy: KIPROXY_EXTENSIONS={','.join(wanted)}: name "
                         f"extensions among {', '.join(EXTENSIONS)}, codec always (the proxy "
                         "has no record path without it); unset it to build them all.")
    return [EXTENSIONS[n] for n in wanted] if wanted else list(EXTENSIONS.values())


setup(cmdclass={"build_ext": BuildCodec}, ext_modules=_selected())
