"""The ``kiproxy`` command: one parser above the runtime and the pipelines.

``run`` belongs to :mod:`kiproxy.proxy.cli`; ``replay`` and ``report`` to
:mod:`kiproxy.pipelines.cli`; ``check`` (a plugin author's dry run, which needs
only the plugin API) to :mod:`kiproxy.interceptors.check`. This module only puts
them under one parser and dispatches, so the proxy never imports the pipelines
(nor pyspark) and the pipelines never import the proxy.

Other distributions add commands through the ``kiproxy.commands`` entry-point
group (:data:`COMMAND_GROUP`): each entry point names a module with ``COMMANDS``,
``add_parsers(subparsers)`` and ``run(args) -> int``. ``dev`` (a local broker with
the proxy in front of it) comes that way from ``kafka-interceptor-proxy-dev``
(``dev/`` in the checkout); without it, ``kiproxy dev`` prints one line naming
what to install (:func:`kiproxy.interceptors.extras.missing_companion`) and
exits 1. The runtime wheel carries no local broker.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import Any, Protocol, cast

from kiproxy import __version__
from kiproxy.interceptors import check as check_cli
from kiproxy.interceptors.extras import DEV, missing_companion
from kiproxy.pipelines import cli as pipelines_cli
from kiproxy.proxy import cli as proxy_cli

__all__ = ["COMMAND_GROUP", "build_parser", "main"]

COMMAND_GROUP = "kiproxy.commands"


class _Commands(Protocol):
    """What a ``kiproxy.commands`` entry point names (a module, as ``kiproxy_dev.cli``)."""

    COMMANDS: tuple[str, ...]

    def add_parsers(self, subparsers: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class _Missing:
    """A command whose distribution is not installed: it takes any arguments and says
    what to install."""

    def __init__(self, command: str, problem: str) -> None:
        self.COMMANDS: tuple[str, ...] = (command,)
        self.problem = problem

    def add_parsers(self, subparsers: Any) -> None:
        # No prefix characters: every argument, --help included, is taken as given.
        missing = subparsers.add_parser(self.COMMANDS[0], add_help=False, prefix_chars="\0",
                                        help=f"(not installed: {self.problem})")
        missing.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        print(f"kiproxy: {self.problem}", file=sys.stderr)
        return 1


def _installed_commands() -> list[_Commands]:
    """The command modules of the ``kiproxy.commands`` entry points; ``dev`` as a
    :class:`_Missing` when its distribution is absent or broken."""
    found: list[_Commands] = []
    for ep in entry_points(group=COMMAND_GROUP):
        try:
            found.append(cast(_Commands, ep.load()))
        except ImportError:
            continue  # said below, for dev; another distribution's problem otherwise
    names = {name for commands in found for name in commands.COMMANDS}
    for command in DEV.needed_by:
        name = command.removeprefix("kiproxy ")
        if name not in names:
            problem = missing_companion(command) or (
                f"{command}: {DEV.name} is installed but registers no `{name}` command "
                f"(reinstall it: pip install ./{DEV.folder} from a kiproxy checkout)")
            found.append(_Missing(name, problem))
    return found


def build_parser(commands: list[_Commands] | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``kiproxy``."""
    parser = argparse.ArgumentParser(
        prog="kiproxy",
        description="A Kafka proxy that passes every produced record batch through an "
                    "interceptor that may transform or reject it.",
    )
    parser.add_argument("--version", action="version", version=f"kiproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    proxy_cli.add_parsers(sub)
    for extra in _installed_commands() if commands is None else commands:
        extra.add_parsers(sub)
    pipelines_cli.add_parsers(sub)
    check_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kiproxy`` console script."""
    commands = _installed_commands()
    args = build_parser(commands).parse_args(argv)
    if args.command in pipelines_cli.COMMANDS:
        return pipelines_cli.run(args)
    if args.command in check_cli.COMMANDS:
        return check_cli.run(args)
    for extra in commands:
        if args.command in extra.COMMANDS:
            return extra.run(args)
    return proxy_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
