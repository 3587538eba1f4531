"""Command-line flags declared once: on a settings model's fields, or here when shared.

Contract. A :class:`Flag` is an ``Annotated`` marker on a pydantic model field
(``plugins_dir: Annotated[str | None, PLUGINS_DIR] = None``): the field is the
one declaration of the setting, and :func:`add_model_flags` turns every marked
field (nested models walked) into an ``argparse`` option - its name (default:
``--`` and the dotted key with dashes), its type and choices from the field's
annotation, its help from the field's docstring (first sentence) with the
field's default; a field without a default is a required option. The option's
``dest`` is the dotted key and its argparse default ``None``, so
:func:`model_overrides` gives ``{key: value}`` for the flags given only, ready to
lay over a config file, and :func:`model_from_flags` validates them into the
model itself (a command's settings that have no file), its errors naming the flag.

The flags that ``kiproxy run``/``dev``, ``kiproxy replay`` and ``kiproxy
check`` share (:data:`PLUGINS_DIR`, :data:`INTERCEPTOR`,
:data:`INTERCEPTOR_CONFIG`, :data:`INTERCEPTOR_TIMEOUT`) are declared here, in
the plugin API package that the proxy and the pipelines may both import; a
command adds one with :func:`add_flag` (renamed where its spelling differs,
as ``check``'s ``--config``). This module imports nothing of the proxy or the
pipelines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "INTERCEPTOR",
    "INTERCEPTOR_CONFIG",
    "INTERCEPTOR_TIMEOUT",
    "PLUGINS_DIR",
    "Flag",
    "FlagError",
    "add_flag",
    "add_model_flags",
    "json_object",
    "model_flags",
    "model_from_flags",
    "model_overrides",
]


class FlagError(ValueError):
    """A flag's value cannot be used; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How one setting is spelled on the command line."""

    name: str | None = None
    """The option, e.g. ``--audit-log``; default: ``--`` and the dotted key, dashed."""
    metavar: str | None = None
    help: str | None = None
    """Default: the field's docstring, first sentence, and its default."""
    set_to: Any = None
    """A switch: the flag stores this value (``True``, or ``False`` for a ``--no-...``)."""
    repeat: bool = False
    """Repeatable: the values are collected in a list."""
    parse: Callable[[Any], Any] | None = None
    """Turns what argparse read into the setting's value; raises :class:`FlagError`."""
    commands: frozenset[str] | None = None
    """The commands that offer it (None: every command the model's flags go on)."""
    group: str | None = None
    """The help section (argparse argument group) it is listed in."""
    type: Callable[[str], Any] | None = None
    """What argparse converts the text with; default: from the field's annotation."""
    exclusive: str | None = None
    """Flags with the same ``exclusive`` name cannot be given together."""

    def renamed(self, name: str) -> Flag:
        """The same flag under another option name."""
        return dataclasses.replace(self, name=name)


def json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """A ``parse`` for a JSON object given inline or as a file's path; errors name ``flag``.

    The rule: text that starts with ``{`` is the object itself, inline JSON;
    anything else is the path of a file holding it, JSON (a ``.json`` file) or
    YAML (any other). A path that does not exist says so, and a file that does
    not parse is named with the parser's message.
    """
    def parse(text: str) -> dict[str, Any]:
        if text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise FlagError(f"{flag}: not valid JSON ({exc})") from None
            where = "inline"
        else:
            value, where = _object_file(flag, text), text
        if not isinstance(value, dict):
            raise FlagError(f"{flag}: {where} must hold a JSON object ({{\"key\": value}}) or "
                            f"a YAML mapping, not {type(value).__name__}")
        return value
    return parse


def _object_file(flag: str, path: str) -> Any:
    """What the JSON or YAML file at ``path`` holds (an empty file: an empty mapping)."""
    try:
        with open(path, encoding="utf-8") as stream:  # YAML's errors then name the file
            if path.endswith(".json"):
                return json.load(stream)
            value = yaml.safe_load(stream)
    except FileNotFoundError:
        raise FlagError(f"{flag}: no file {path} (a value that does not start with '{{' is "
                        "the path of a JSON or YAML file)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FlagError(f"{flag}: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise FlagError(f"{flag}: {path} is not valid JSON ({exc})") from None
    except yaml.YAMLError as exc:
        raise FlagError(f"{flag}: {path} is not valid YAML ({' '.join(str(exc).split())})"
                        ) from None
    return {} if value is None else value


DEFAULT_TIMEOUT_MS = 5000
"""The per-batch deadline of an interceptor unless one is set: ``interceptor.timeout_ms``
and a route link's ``timeout_ms`` in the proxy, ``replay``'s and ``check``'s flag, the
plugin test kit."""

PLUGINS_DIR = Flag("--plugins-dir", metavar="DIR",
                   help="directory searched first for interceptor modules")
INTERCEPTOR = Flag("--interceptor", metavar="MODULE:CLASS",
                   help="the interceptor every batch goes through: produced batches, and "
                        "fetched ones when it has a fetch-side hook (MODULE:CLASS, found in "
                        "--plugins-dir first, or an entry-point name such as uppercase)")
INTERCEPTOR_CONFIG = Flag("--interceptor-config", metavar="JSON/FILE",
                          help="the interceptor's configure() argument: a JSON object inline "
                               "(text starting with '{'), or the path of a JSON or YAML file "
                               "holding it",
                          parse=json_object("--interceptor-config"))
INTERCEPTOR_TIMEOUT = Flag("--interceptor-timeout-ms", metavar="MS", type=int,
                           help="per-batch deadline; a batch not done by then is rejected")


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: Flag, *,
             dest: str | None = None, default: Any = None, required: bool = False,
             help: str | None = None, **extra: Any) -> argparse.Action:
    """Add ``flag`` to ``parser``; ``default`` is shown in the help when not None."""
    assert flag.name is not None, "a shared flag has a name"
    text = help if help is not None else flag.help or ""
    if default is not None and "(default" not in text:
        text += f" (default {default})"
    kwargs: dict[str, Any] = {"help": text, "default": default, **extra}
    if dest is not None:
        kwargs["dest"] = dest
    if flag.set_to is not None:
        kwargs.update(action="store_const", const=flag.set_to)
    else:
        kwargs["metavar"] = flag.metavar
        if flag.type is not None:
            kwargs["type"] = flag.type
        if flag.repeat:
            kwargs["action"] = "append"
        if required:
            kwargs["required"] = True
    return parser.add_argument(flag.name, **kwargs)


def model_flags(model: type[BaseModel],
                prefix: str = "") -> Iterator[tuple[str, FieldInfo, Flag]]:
    """``(dotted key, field, flag)`` of every field of ``model`` that has a :class:`Flag`,
    nested settings models walked (their fields' keys are ``parent.child``)."""
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            yield key, info, flag
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from model_flags(info.annotation, key + ".")


def _field_default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else info.default


def _first_sentence(text: str) -> str:
    """The docstring's first sentence, as plain text (reST literals unquoted)."""
    text = " ".join(re.sub(r":\w+:`~?([^`]+)`", r"\1", text.replace("``", "")).split())
    return re.split(r"(?<=[\w)])\.\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(".")


def _scalar(annotation: Any) -> Any:
    """``X`` of ``X | None``; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _derived(key: str, info: FieldInfo, flag: Flag) -> Flag:
    """``flag`` with its name, type, help and metavar filled in from the field."""
    scalar = _scalar(info.annotation)
    choices = typing.get_args(scalar) if typing.get_origin(scalar) is typing.Literal else None
    converter = flag.type
    if converter is None and flag.set_to is None and scalar in (int, float):
        converter = scalar
    text = flag.help if flag.help is not None else _first_sentence(info.description or key)
    default = _field_default(info)
    if flag.set_to is None and default not in (None, [], {}, ()):
        text += f" (default {default})"
    return dataclasses.replace(
        flag, name=flag.name or "--" + key.replace("_", "-").replace(".", "-"),
        type=converter, help=text,
        metavar=flag.metavar or (None if choices else key.rpartition(".")[2].upper()))


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel],
                    command: str) -> None:
    """Add the flags of ``model``'s fields that ``command`` offers to ``parser``."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for key, info, declared in model_flags(model):
        if declared.commands is not None and command not in declared.commands:
            continue
        flag = _derived(key, info, declared)
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = target.add_mutually_exclusive_group()
            target = exclusive[flag.exclusive]
        scalar = _scalar(info.annotation)
        extra: dict[str, Any] = {"required": info.is_required()}
        if typing.get_origin(scalar) is typing.Literal:
            extra["choices"] = typing.get_args(scalar)
        add_flag(target, flag, dest=key, **extra)


def model_overrides(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """``{dotted key: value}`` of ``model``'s flags in ``args`` (None where not given).

    Raises :class:`FlagError` when a flag's ``parse`` refuses its value.
    """
    out: dict[str, Any] = {}
    for key, _, flag in model_flags(model):
        value = getattr(args, key, None)
        if value is not None and flag.parse is not None:
            value = flag.parse(value)
        out[key] = value
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


_M = typing.TypeVar("_M", bound=BaseModel)


def model_from_flags(args: argparse.Namespace, model: type[_M]) -> _M:
    """``model`` from the flags given in ``args`` (the fields' defaults for the others).

    Raises :class:`FlagError` naming the flag (``--chunk-records: Input should be
    greater than 0``) when a value is refused, by its ``parse`` or by the model.
    """
    given = {k: v for k, v in model_overrides(args, model).items() if v is not None}
    try:
        return model.model_validate(_nested(given))
    except ValidationError as exc:
        names = {key: _derived(key, info, flag).name for key, info, flag in model_flags(model)}
        lines = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"])
            text = error["msg"].removeprefix("Value error, ")
            name = names.get(key) or key
            lines.append(text if not name or text.startswith(name) else f"{name}: {text}")
        raise FlagError("; ".join(lines)) from None
