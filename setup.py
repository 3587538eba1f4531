"""Build the compiled record codec (``kiproxy.protocol._codec``) and the Avro payload check
(``kiproxy.interceptors.builtin.schema_registry._avro_check``); the rest is in pyproject.toml.

The codec is required (the proxy has no pure-Python record path), so a build
without a working C compiler stops with a message that says what to install
instead of a compiler traceback.
"""

from typing import Any

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_COMPILER = (
    "kafka-interceptor-proxy: building the compiled record codec (kiproxy.protocol._codec) "
    "needs a C compiler and the Python headers, and none worked ({error}). Install them "
    "(Debian/Ubuntu: apt-get install gcc python3-dev; Fedora: dnf install gcc python3-devel; "
    "macOS: xcode-select --install), or install a prebuilt wheel of kafka-interceptor-proxy."
)


class BuildCodec(build_ext):
    """``build_ext`` whose compiler failures name what is missing."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # distutils' CompileError/LinkError/PlatformError
            raise SystemExit(NO_COMPILER.format(error=f"{type(exc).__name__}: {exc}")) from exc

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            raise SystemExit(NO_COMPILER.format(error=f"{type(exc).__name__}: {exc}")) from exc


setup(
    cmdclass={"build_ext": BuildCodec},
    ext_modules=cythonize(
        [Extension("kiproxy.protocol._codec", ["kiproxy/protocol/_codec.pyx"],
                   extra_compile_args=["-O3"]),
         Extension("kiproxy.interceptors.builtin.schema_registry._avro_check",
                   ["kiproxy/interceptors/builtin/schema_registry/_avro_check.pyx"],
                   extra_compile_args=["-O3"])],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
)
