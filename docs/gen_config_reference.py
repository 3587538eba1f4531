"""Write ``docs/configuration.md`` and ``docs/builtin-settings.md`` from the models.

Every key of :class:`kiproxy.proxy.config.model.ProxyConfig` and its nested models
appears with its dotted path, type, default, the field's docstring, and the
``kiproxy run``/``kiproxy dev`` flag that sets it (read from the command's own
argparse parser). Every built-in interceptor with typed settings (its base's type
argument, :func:`kiproxy.interceptors.settings.settings_model`) gets a table of its
``config:`` keys the same way. A key without a docstring is an error: document it
under the field.

    python docs/gen_config_reference.py           # rewrite both pages
    python docs/gen_config_reference.py --check   # exit 1 if a page is stale

``tests/docs/test_docs_site.py`` runs the check in ``make test``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kiproxy.cli import build_parser
from kiproxy.interceptors.extras import ENTRY_POINT_GROUP
from kiproxy.interceptors.flags import model_flags
from kiproxy.interceptors.settings import settings_model
from kiproxy.proxy.config.model import ProxyConfig

PAGE = Path(__file__).resolve().parent / "configuration.md"
BUILTINS_PAGE = Path(__file__).resolve().parent / "builtin-settings.md"
REGENERATE = "python docs/gen_config_reference.py (or: make docs-config)"


@dataclass(frozen=True)
class Key:
    """One row of the reference."""

    path: str
    type: str
    default: str
    flag: str
    description: str


def attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """The string literal under each annotated field of ``model``'s class body, and of its
    base models' for the fields it inherits."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, following in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _markdown(text: str) -> str:
    """Docstring text as one Markdown table cell: reST literals to code, one line."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map {_type_name(args[0])} → {_type_name(args[1])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any",
             bytes: "secret"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bare(annotation: Any) -> Any:
    """``Annotated[T, ...]`` as ``T``."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _optional_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a ``Model`` or ``Model | None`` annotation, else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = _bare(args[0]) if len(args) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _bounds(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for attr, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, list | dict):
        return f"`{value!r}`"
    return f"`{value}`"


def cli_flags() -> dict[str, str]:
    """Config key -> the ``kiproxy run``/``dev`` flag (with its metavar) that sets it.

    Read from the ``Flag`` on each field (:mod:`kiproxy.interceptors.flags`), the
    declaration the command line itself is built from, so a new flag shows up here
    by itself.
    """
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in commands.choices["run"]._actions}
    dev_dests = {a.dest for a in commands.choices["dev"]._actions}
    flags: dict[str, str] = {}
    for key, _, _ in model_flags(ProxyConfig):
        action = actions[key]
        flag = action.option_strings[-1]
        if action.metavar:
            flag += f" {action.metavar}"
        text = f"`{flag}`"
        if isinstance(action, argparse._AppendAction):
            text += " (repeatable)"
        if key not in dev_dests:
            text += " (`run` only)"
        flags[key] = text
    return flags


def keys(model: type[BaseModel], prefix: str, flags: dict[str, str],
         optional: bool = False) -> Iterator[Key]:
    """Every key of ``model`` under ``prefix``, nested models after their parent (with
    ``optional``, those of a ``Model | None`` key too)."""
    docs = attribute_docstrings(model)
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{prefix}{key}"
        annotation = info.annotation
        description = docs.get(name) or info.description
        if description is None:
            raise SystemExit(f"{model.__name__}.{name} ({path}) has no docstring: add one "
                             "under the field")
        args = [_bare(a) for a in typing.get_args(annotation)]
        item = args[0] if typing.get_origin(annotation) is list else None
        value = args[1] if typing.get_origin(annotation) is dict else None
        inner = _optional_model(annotation) if optional else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{path}.", annotation))
        elif inner is not None:
            nested.append((f"{path}.", inner))
        elif isinstance(item, type) and issubclass(item, BaseModel):
            nested.append((f"{path}[].", item))
        elif isinstance(value, type) and issubclass(value, BaseModel):
            nested.append((f"{path}.NAME.", value))
        yield Key(path=path, type=_type_name(annotation) + _bounds(info),
                  default=_default(info), flag=flags.get(path, "—"),
                  description=_markdown(description))
    for sub_prefix, sub in nested:
        yield from keys(sub, sub_prefix, flags, optional)


def _sections() -> Iterator[tuple[str, str, list[Key]]]:
    flags = cli_flags()
    groups: dict[str, list[Key]] = {}
    for key in keys(ProxyConfig, "", flags):
        section = key.path.rsplit(".", 1)[0] if "." in key.path else ""
        groups.setdefault(section, []).append(key)
    models: dict[str, type[BaseModel]] = {"": ProxyConfig}

    def collect(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            args = typing.get_args(annotation)
            inner = args[0] if typing.get_origin(annotation) is list else annotation
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                suffix = "[]" if inner is not annotation else ""
                path = f"{prefix}{info.alias or name}{suffix}"
                models[path] = inner
                collect(inner, f"{path}.")

    collect(ProxyConfig, "")
    for section, rows in groups.items():
        if section:
            intro = _markdown(inspect.cleandoc(models[section].__doc__ or "").split("\n\n")[0])
        else:
            intro = "Settings of the proxy itself; the nested mappings follow."
        yield section, intro, rows


def render() -> str:
    """The whole page, as committed in ``docs/configuration.md``."""
    out = [
        "<!-- Generated by docs/gen_config_reference.py from kiproxy.proxy.config.model; do not",
        f"     edit by hand. After changing a setting run: {REGENERATE} -->",
        "",
        "# Configuration reference",
        "",
        "kiproxy reads one YAML file (`--config FILE`), validated at start; command-line",
        "flags fill in or override it. Unknown keys are errors, and every error names",
        "the file and the key, e.g. `kiproxy: config error in k.yaml: interceptor.timeout:",
        "unknown key; did you mean interceptor.timeout_ms?` (see",
        "[Troubleshooting](troubleshooting.md#config-errors)). `kiproxy run` and",
        "`kiproxy dev` take the same flags, except that `dev` has none of the upstream",
        "ones (`--upstream`, `--upstream-tls*`, `--wait-for-upstream`) nor `--workers`: it",
        "starts an embedded broker (Tansu, memory storage) and uses it as the upstream.",
        "",
        "Nested keys are written with dots (`interceptor.timeout_ms` is `timeout_ms`",
        "under `interceptor:`); `[]` marks the keys of each item of a list.",
        "",
        "<!-- test: config -->",
        "```yaml",
        "# /etc/kiproxy/config.yaml",
        "upstream: [kafka-1:9092, kafka-2:9092]",
        "listen: 0.0.0.0:9192",
        "advertised_host: kiproxy.internal",
        "interceptor:",
        "  class: json_schema",
        "  timeout_ms: 2000",
        "  config: {schemas: {orders: {type: object}}}",
        "```",
        "",
    ]
    for section, intro, rows in _sections():
        title = f"`{section}`" if section else "Top-level keys"
        out += [f"## {title}", "", intro, "",
                "| key | type | default | flag | description |",
                "|---|---|---|---|---|"]
        out += [f"| `{k.path}` | {k.type} | {k.default} | {k.flag} | {k.description} |"
                for k in rows]
        out.append("")
    return "\n".join(out)


def builtin_models() -> list[tuple[str, str, str, type[BaseModel]]]:
    """``(short name, MODULE:CLASS, what it does, settings model)`` of every built-in with
    typed settings."""
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if not ep.value.startswith("kiproxy.interceptors.builtin."):
            continue
        cls = ep.load()
        model = settings_model(cls)
        if model is not None:
            summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
            found.append((ep.name, ep.value, summary, model))
    return found


def render_builtins() -> str:
    """The built-ins' settings page, as committed in ``docs/builtin-settings.md``."""
    out = [
        "<!-- Generated by docs/gen_config_reference.py from the built-ins' settings models; "
        "do not",
        f"     edit by hand. After changing a setting run: {REGENERATE} -->",
        "",
        "# Built-in interceptor settings",
        "",
        "The keys each [built-in interceptor](builtins.md) takes under `config:`, read from",
        "its settings model (see [typed settings](interceptors.md#typed-settings)). Unknown",
        "keys are errors and every error names the key, e.g. `pii_masker: invalid config:",
        "rules.ids.acton: unknown key; did you mean rules.ids.action?`. `[]` marks the keys",
        "of each item of a list, `NAME` any key of a mapping.",
        "",
    ]
    for name, spec, summary, model in builtin_models():
        out += [f"## `{name}`", "", f"`{spec}` — {_markdown(summary)}", "",
                "| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{k.path}` | {k.type} | {k.default} | {k.description} |"
                for k in keys(model, "", {}, optional=True)]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Write the pages, or with ``--check`` say whether the committed ones are current."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a page differs from the models")
    args = parser.parse_args(argv)
    pages = [(PAGE, render()), (BUILTINS_PAGE, render_builtins())]
    if args.check:
        stale = [p for p, text in pages
                 if not p.exists() or p.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path} is stale: regenerate it with {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
