"""Build the compiled record codec as ``kiproxy.protocol._codec``; the rest is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("kiproxy.protocol._codec", ["kiproxy/protocol/_codec.pyx"],
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
