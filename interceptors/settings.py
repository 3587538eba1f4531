"""Typed settings: a plugin's config validated by a pydantic model, errors in kiproxy's words.

Contract. An interceptor declares its settings as a model, the type argument of its
base class (``class Redact(ProduceRequestInterceptor[RedactSettings])``);
:func:`settings_model` finds it. :func:`parse_settings` validates a config mapping
against it and either returns the model or raises :class:`SettingsError`, one line
per problem, the same lines the proxy's own config gives (the proxy's
``load_config`` calls :func:`describe` too): the key path as the user writes it
(``rules.ids.action``, ``links[0].interceptor``), what is wrong, and the value
that was given::

    interceptor.timeout: unknown key; did you mean interceptor.timeout_ms?
    max_in_flight: expected an integer, got 'ten'

An unknown key is matched against the valid keys at the same level
(``difflib.get_close_matches``) so a typo names the key that was meant.
:class:`PluginSettings` is the base a settings model may use: unknown keys are
errors, the docstring under a field is its documentation (the reference of the
built-ins' settings is generated from it), and a validated value is frozen.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from kiproxy.interceptors.errors import error_code

__all__ = ["ErrorName", "PluginSettings", "SettingsError", "describe", "key_path", "parse_settings",
           "settings_model", "valid_keys"]


class PluginSettings(BaseModel):
    """Base of a plugin's settings model: strict keys, documented fields, frozen values."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True,
                              use_attribute_docstrings=True)


def _known_error(name: str) -> str:
    error_code(name)  # a ValueError naming the known names
    return name


ErrorName = Annotated[str, AfterValidator(_known_error)]
"""A Kafka error name a rejection carries (``POLICY_VIOLATION``, ``INVALID_RECORD``...)."""


class SettingsError(ValueError):
    """A plugin's config does not fit its settings model; ``problems`` has one line each.

    A ``ValueError``, as the hand-written checks of plugin configs raised before.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


def settings_model(cls: type[Any]) -> type[BaseModel] | None:
    """The settings model ``cls`` declares as its base class's type argument, or None.

    The first pydantic model among the type arguments of the parametrized bases
    (``ProduceRequestInterceptor[Settings]``, or a generic built on it), searched
    along the method resolution order: a subclass may declare a model of its own.
    """
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    return arg
    return None


M = TypeVar("M", bound=BaseModel)


def parse_settings(model: type[M], config: Mapping[str, Any] | M | None) -> M:
    """``config`` validated by ``model`` (a model instance is returned as it is).

    Raises :class:`SettingsError` naming every key that is wrong and why.
    """
    if isinstance(config, model):
        return config
    given = dict(config or {})
    # Text converts to what a key declares ("5" to 5: a properties file holds only text),
    # but `true` or `false` where a number is declared is a mistake, not 1 or 0. Strict
    # mode says where (as a whole it would refuse that text too, and a list where a tuple
    # is declared: so the lists are also tried as tuples, to reach a tuple's items).
    numbers: dict[tuple[int | str, ...], ErrorDetails] = {}
    for shape in (given, _tupled(given)) if _holds_bool(given) else ():
        try:
            model.model_validate(shape, strict=True)
        except ValidationError as exc:
            numbers.update((item["loc"], item) for item in exc.errors()
                           if item["type"] in ("int_type", "float_type")
                           and isinstance(item["input"], bool))
    if numbers:
        raise SettingsError(_lines([numbers[loc] for loc in sorted(numbers, key=str)],
                                   model)) from None
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise SettingsError(describe(exc, model)) from None


def _holds_bool(value: Any) -> bool:
    """``value`` is or holds a ``bool``: only then is there a boolean to look for."""
    if isinstance(value, bool):
        return True
    if isinstance(value, dict):
        return any(map(_holds_bool, value.values()))
    return isinstance(value, (list, tuple)) and any(map(_holds_bool, value))


def _tupled(value: Any) -> Any:
    """``value`` with every list in it a tuple."""
    if isinstance(value, dict):
        return {k: _tupled(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


_EXPECTED = {
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "float_parsing": "a number", "float_type": "a number",
    "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list",
    "dict_type": "a mapping", "model_type": "a mapping of settings",
    "model_attributes_type": "a mapping of settings",
}
"""pydantic error type -> what the key expects."""

_BOUNDS = {"greater_than": ("gt", "greater than"),
           "greater_than_equal": ("ge", "at least"),
           "less_than": ("lt", "less than"),
           "less_than_equal": ("le", "at most")}


def key_path(loc: tuple[int | str, ...]) -> str:
    """``('observers', 0, 'class')`` -> ``observers[0].class``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":
            out += f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> str:
    """A value as the user wrote it in YAML (or on the command line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null (an empty value)"
    if isinstance(value, dict):
        return "a mapping" if value else "an empty mapping"
    if isinstance(value, list | tuple):
        return "a list" if value else "an empty list"
    return repr(value)


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The settings model that holds the keys at ``loc`` (``None`` if it is not a model).

    A list index and a key of a mapping of models (``rules.ids``) lead to the item's model.
    """
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for name, f in current.model_fields.items()
                          if part in (name, f.alias)), None)
            if field is None:
                return None
            current = field.annotation
        else:  # a list item or a mapping's key: go into the item type
            current = _item(current)
            if current is None:
                return None
        current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _item(annotation: Any) -> Any:
    """The model inside a list, tuple or mapping annotation (its values), or None."""
    for arg in reversed(typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        found = _item(arg)
        if found is not None:
            return found
    return None


def _unwrap(annotation: Any) -> Any:
    """``Model | None`` as ``Model``; other annotations as they are."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _unwrap(arg)
            if isinstance(found, type) and issubclass(found, BaseModel):
                return found
    return annotation


def valid_keys(model: type[BaseModel]) -> list[str]:
    """The keys a settings model accepts, as they are written in the file."""
    return [field.alias or name for name, field in model.model_fields.items()]


def _unknown_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    parent = _model_at(model, loc[:-1])
    if parent is None:
        return "unknown key"
    keys = valid_keys(parent)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.7)
    if close:
        return f"unknown key; did you mean {key_path((*loc[:-1], close[0]))}?"
    if len(keys) <= 12:
        return "unknown key; valid keys here: " + ", ".join(keys)
    return "unknown key (see the configuration reference for the valid keys)"


def _problem(model: type[BaseModel], item: ErrorDetails) -> str:
    kind, loc, given = item["type"], item["loc"], item.get("input")
    ctx = item.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_key(model, loc)
    if loc and loc[-1] == "[key]":
        return f"key {_shown(given)}: expected {_EXPECTED.get(kind, 'a valid key')}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_shown(given)}"
    if kind in _BOUNDS:
        name, words = _BOUNDS[kind]
        bound = ctx.get(name)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # a float key's bound as written: 0, not 0.0
        return f"must be {words} {bound}, got {_shown(given)}"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {_shown(given)}"
    if kind == "missing":
        return "required key is missing"
    if kind == "string_too_short":
        least = ctx.get("min_length")
        return ("must not be empty" if least == 1
                else f"needs at least {least} characters, got {_shown(given)}")
    if kind == "too_short":
        return f"needs at least {ctx.get('min_length')} item(s), got {_shown(given)}"
    if kind == "too_long":
        return f"takes at most {ctx.get('max_length')} item(s), got {_shown(given)}"
    if kind == "value_error":
        return str(ctx.get("error", item["msg"]))
    return f"{item['msg']}, got {_shown(given)}"


def describe(error: ValidationError, model: type[BaseModel],
             from_flags: frozenset[str] = frozenset()) -> list[str]:
    """One line per problem: ``KEY: what is wrong``.

    ``from_flags`` holds the dotted keys set on the command line; a problem with
    one of them says so, since the file does not contain it.
    """
    return _lines(error.errors(), model, from_flags)


def _lines(errors: list[ErrorDetails], model: type[BaseModel],
           from_flags: frozenset[str] = frozenset()) -> list[str]:
    lines = []
    for item in errors:
        loc = item["loc"]
        if item["type"] == "too_short" and any(
                other["loc"][:len(loc)] == loc and len(other["loc"]) > len(loc)
                for other in errors):
            continue  # counted after validation: an item of it failed, and is named
        where = key_path(loc[:-2] if loc and loc[-1] == "[key]" else loc)
        what = _problem(model, item)
        line = f"{where}: {what}" if where else what
        if any(where == key or where.startswith(key + ".") for key in from_flags):
            line += " (set on the command line)"
        lines.append(line)
    return lines
