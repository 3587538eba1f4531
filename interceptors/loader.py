"""Finding and starting the configured interceptor.

``MODULE:CLASS`` is resolved, in order, from the plugins directory (a dropped-in
``.py`` file or package), from installed modules on ``sys.path``, and from the
entry-point group ``kiproxy.interceptors``; a bare entry-point name such as
``uppercase`` or ``json_schema`` names a built-in. A name from before the
``kiproxy`` namespace (``interceptors.builtin.uppercase:Uppercase``) is refused
with the new name in the message. Every failure is a :class:`PluginLoadError` whose
message says what was looked for, where, and what went wrong.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from kiproxy.interceptors.api import PluginFactory, ProduceRequestInterceptor
from kiproxy.interceptors.consume import FetchResponseInterceptor
from kiproxy.interceptors.extras import ENTRY_POINT_GROUP, interceptor_feature, missing_extras
from kiproxy.interceptors.observer import Observer
from kiproxy.interceptors.settings import SettingsError, parse_settings, settings_model

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginLoadError",
    "PluginSettingsError",
    "forget_plugin_modules",
    "load_interceptor",
    "load_observer",
    "resolve_class",
]

class PluginLoadError(Exception):
    """The interceptor could not be found, imported, created or configured."""


class PluginSettingsError(PluginLoadError):
    """The config given to an interceptor with typed settings does not fit its model.

    ``problems`` has one line per problem, ``KEY: what is wrong``, keys as written
    under the interceptor's ``config:``.
    """

    def __init__(self, spec: str, problems: tuple[str, ...]) -> None:
        super().__init__(f"{spec}: invalid config: {'; '.join(problems)}")
        self.spec = spec
        self.problems = problems


_PLUGIN_FAULTS = (Exception, SystemExit)
"""What a plugin's code may raise while it is imported, created or configured: its
fault, a load error (a ``sys.exit()`` in it included, which would stop the proxy)."""


def _plugin_file(plugins_dir: Path, module: str) -> tuple[Path, bool] | None:
    base = plugins_dir.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return None


def _load_from_dir(plugins_dir: Path, module: str) -> ModuleType | None:
    found = _plugin_file(plugins_dir, module)
    if found is None:
        return None
    path, is_package = found
    # Sibling modules of a plugin must be importable, so the dir goes on sys.path.
    if str(plugins_dir) not in sys.path:
        sys.path.insert(0, str(plugins_dir))
    if "." in module:
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location(
        module, path, submodule_search_locations=[str(path.parent)] if is_package else None
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(module, None)
        raise
    return mod


def _from_entry_points(spec: str) -> Any | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if spec in (ep.name, ep.value):
            return ep.load()
    return None


def _did_you_mean(name: str, candidates: list[str], form: str = " (did you mean {!r}?)") -> str:
    """``form`` filled with the candidate closest to a misspelt ``name`` (difflib), or
    nothing when none is close."""
    close = difflib.get_close_matches(name, candidates, n=1)
    return form.format(close[0]) if close else ""


def _builtin_names() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _plugin_modules(plugins_dir: Path) -> list[str]:
    """The modules a plugins dir offers: its ``.py`` files and packages."""
    with contextlib.suppress(OSError):
        return sorted({p.stem for p in plugins_dir.glob("*.py")}
                      | {p.parent.name for p in plugins_dir.glob("*/__init__.py")})
    return []


def _missing_extra(spec: str | None) -> PluginLoadError | None:
    """The error for a built-in whose extra is not installed (what to install), if so."""
    feature = interceptor_feature(spec) if spec is not None else None
    if feature is None:
        return None
    missing = missing_extras([(f"the {feature} interceptor", feature)])
    return PluginLoadError(missing[0]) if missing else None


def _import_failed(what: str, exc: BaseException, spec: str | None = None) -> PluginLoadError:
    missing = _missing_extra(spec)
    if missing is not None:
        return missing
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen ")]
    if isinstance(exc, ModuleNotFoundError) and exc.name and frames:
        # A package the plugin needs is missing: say which, and where it is imported.
        at = frames[-1]
        return PluginLoadError(
            f"importing interceptor module {what} failed: {at.filename} line {at.lineno} "
            f"imports {exc.name!r}, which is not installed ({detail}); install the package "
            f"that provides {exc.name!r} where kiproxy runs")
    return PluginLoadError(f"importing interceptor module {what} failed: {detail}")


def resolve_class(
    spec: str,
    plugins_dir: str | Path | None = None,
    check: Callable[[str, Any], type[Any]] | None = None,
) -> type[Any]:
    """Find the class named by ``spec`` (``MODULE:CLASS`` or an entry-point name).

    ``check`` validates the class found (default: it implements the interceptor API).
    """
    _check_class = check or _check_interceptor_class
    _refuse_old_name(spec)
    places = []
    if ":" not in spec:
        try:
            obj = _from_entry_points(spec)
        except _PLUGIN_FAULTS as exc:
            raise _import_failed(f"for entry point {spec!r}", exc, spec) from exc
        if obj is None:
            names = _builtin_names()
            raise PluginLoadError(
                f"interceptor {spec!r} is not MODULE:CLASS nor a known name"
                f"{_did_you_mean(spec, names)}; known names (the built-ins and the entry "
                f"points of group {ENTRY_POINT_GROUP!r}): {', '.join(names)}"
            )
        return _check_class(spec, obj)
    module_name, _, class_name = spec.partition(":")
    module: ModuleType | None = None
    if plugins_dir is not None:
        directory = Path(plugins_dir)
        if not directory.is_dir():
            raise PluginLoadError(f"plugins dir {directory} does not exist")
        places.append(f"plugins dir {directory}")
        try:
            module = _load_from_dir(directory.resolve(), module_name)
        except _PLUGIN_FAULTS as exc:
            raise _import_failed(f"{module_name!r} from {directory}", exc) from exc
    if module is None:
        places.append("sys.path")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing == module_name or module_name.startswith(missing + "."):
                module = None  # the module (or its package) does not exist
            else:
                raise _import_failed(repr(module_name), exc, spec) from exc
        except _PLUGIN_FAULTS as exc:
            raise _import_failed(repr(module_name), exc, spec) from exc
    if module is None:
        places.append(f"entry points ({ENTRY_POINT_GROUP})")
        try:
            obj = _from_entry_points(spec)
        except _PLUGIN_FAULTS as exc:
            raise _import_failed(f"for entry point {spec!r}", exc, spec) from exc
        if obj is None:
            nearby = _plugin_modules(Path(plugins_dir)) if plugins_dir is not None else []
            raise PluginLoadError(
                f"interceptor module {module_name!r} not found (looked in: {', '.join(places)})"
                + _did_you_mean(module_name, nearby, "; did you mean {!r}?")
            )
        return _check_class(spec, obj)
    obj = getattr(module, class_name, None)
    if obj is None:
        defined = sorted(n for n, v in vars(module).items()
                         if inspect.isclass(v) and v.__module__ == module.__name__)
        raise PluginLoadError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no class "
            f"{class_name!r}{_did_you_mean(class_name, defined)}; it defines: "
            f"{', '.join(defined) or 'no classes'}"
        )
    return _check_class(spec, obj)


def _refuse_old_name(spec: str) -> None:
    """Names from before the ``kiproxy`` namespace get an error that gives the new name."""
    if spec.startswith("interceptors.builtin."):
        raise PluginLoadError(
            f"{spec!r} is an old name: the built-ins are now under the kiproxy namespace, "
            f"so write 'kiproxy.{spec}' (or its short entry-point name)")


def _check_interceptor_class(spec: str, obj: Any) -> type[Any]:
    if not inspect.isclass(obj):
        raise PluginLoadError(f"{spec} is a {type(obj).__name__}, not a class")
    if issubclass(obj, (ProduceRequestInterceptor, FetchResponseInterceptor)):
        abstract: frozenset[str] = getattr(obj, "__abstractmethods__", frozenset())
        if abstract:
            raise PluginLoadError(
                f"{spec} does not implement the interceptor API: missing {', '.join(abstract)}"
            )
        return obj
    if not callable(getattr(obj, "intercept", None)) and \
            not callable(getattr(obj, "on_consume", None)):
        raise PluginLoadError(
            f"{spec} does not implement the interceptor API: it is not a "
            "ProduceRequestInterceptor or FetchResponseInterceptor subclass and has "
            "neither intercept(batch, ctx) nor on_consume(batch, ctx)"
        )
    return obj


def _check_observer_class(spec: str, obj: Any) -> type[Any]:
    if not inspect.isclass(obj):
        raise PluginLoadError(f"{spec} is a {type(obj).__name__}, not a class")
    if issubclass(obj, Observer) or callable(getattr(obj, "on_response", None)) or \
            callable(getattr(obj, "on_request", None)):
        return obj
    raise PluginLoadError(
        f"{spec} does not implement the observer API: it is not an Observer subclass and "
        "has neither on_request(info) nor on_response(info)"
    )


def load_observer(
    spec: str, plugins_dir: str | Path | None = None, config: Mapping[str, Any] | None = None
) -> Any:
    """Resolve, instantiate and configure the observer named by ``spec``."""
    cls = resolve_class(spec, plugins_dir, _check_observer_class)
    return _instantiate(spec, cls, config)


def _takes_plugins(configure: Callable[..., Any]) -> bool:
    """Whether ``configure`` declares the ``plugins`` keyword (a composite interceptor)."""
    try:
        parameter = inspect.signature(configure).parameters.get("plugins")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _call_failed(what: str, spec: str, exc: BaseException) -> PluginLoadError:
    # A built-in that imports its extra's package when configured (wasm, extism) says
    # what to install, as when the import of its module fails.
    missing = _missing_extra(spec) if isinstance(exc, ImportError) else None
    return missing or PluginLoadError(f"{what} failed: {type(exc).__name__}: {exc}")


def _instantiate(spec: str, cls: type[Any], config: Mapping[str, Any] | None,
                 plugins: PluginFactory | None = None) -> Any:
    try:
        instance = cls()
    except _PLUGIN_FAULTS as exc:
        raise _call_failed(f"creating {spec}", spec, exc) from exc
    _refuse_async_hooks(spec, instance)
    configure = getattr(instance, "configure", None)
    if configure is not None:
        # Typed settings are validated here, so their errors name the keys and nothing else.
        model = settings_model(cls)
        settings: Any = dict(config or {})
        if model is not None:
            try:
                settings = parse_settings(model, settings)
            except SettingsError as exc:
                raise PluginSettingsError(spec, exc.problems) from None
        try:
            if plugins is not None and _takes_plugins(configure):
                configure(settings, plugins=plugins)
            else:
                configure(settings)
        except _PLUGIN_FAULTS as exc:
            raise _call_failed(f"{spec}.configure()", spec, exc) from exc
    return instance


_PLAIN_METHODS = {
    "configure": "it runs once at load and at each reload, before any batch; open "
                 "connections or sessions on first use in intercept instead",
    "on_acknowledgement": "it is called on the event loop as each answer is matched; hand "
                          "slow work to a queue or task of the plugin's own",
    "metrics": "it is read on the event loop when /metrics is scraped; return counters "
               "the plugin keeps",
}
"""Hooks the proxy calls and does not await: an ``async def`` one would only make a
coroutine, and whatever it does would never happen."""


def _refuse_async_hooks(spec: str, instance: Any) -> None:
    for method, why in _PLAIN_METHODS.items():
        if inspect.iscoroutinefunction(getattr(instance, method, None)):
            raise PluginLoadError(f"{spec}.{method}() is async; it must be a plain def "
                                  f"({why})")


def load_interceptor(
    spec: str, plugins_dir: str | Path | None = None, config: Mapping[str, Any] | None = None
) -> Any:
    """Resolve, instantiate and configure the interceptor named by ``spec``.

    An interceptor whose ``configure`` takes ``plugins`` gets a
    :class:`~kiproxy.interceptors.api.PluginFactory` that loads from ``plugins_dir`` too.
    """

    def plugins(inner: str, inner_config: Mapping[str, Any]) -> Any:
        return load_interceptor(inner, plugins_dir, inner_config)

    return _instantiate(spec, resolve_class(spec, plugins_dir), config, plugins)


def forget_plugin_modules(plugins_dir: str | Path | None) -> list[str]:
    """Drop the modules loaded from ``plugins_dir`` so the next load imports them afresh.

    A reload calls this before it builds the new interceptors: a changed ``.py``
    file (or a module of a plugin package) then takes effect. Objects made from
    the old modules keep working; they hold their own module references.
    """
    if plugins_dir is None:
        return []
    base = Path(plugins_dir).resolve()
    dropped = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            if Path(path).resolve().is_relative_to(base):
                del sys.modules[name]
                dropped.append(name)
    importlib.invalidate_caches()
    return dropped
