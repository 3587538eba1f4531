"""Build the compiled record codec (protocol/_codec.pyx); everything else is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("protocol._codec", ["protocol/_codec.pyx"], extra_compile_args=["-O3"])],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
)
