"""The ``kiproxy`` command: one parser above the runtime and the pipelines.

``run`` belongs to :mod:`kiproxy.proxy.cli`; ``dev`` (a local broker with the proxy
in front of it) to :mod:`kiproxy.localbrokers.dev`; ``replay`` and ``report`` to
:mod:`kiproxy.pipelines.cli`; ``check`` (a plugin author's dry run, which needs
only the plugin API) to :mod:`kiproxy.interceptors.check`. This module only puts
them under one parser and dispatches, so the proxy never imports the local
brokers nor the pipelines (nor pyspark) and the pipelines never import the proxy.
"""

from __future__ import annotations

import argparse
import sys

from kiproxy import __version__
from kiproxy.interceptors import check as check_cli
from kiproxy.localbrokers import dev as dev_cli
from kiproxy.pipelines import cli as pipelines_cli
from kiproxy.proxy import cli as proxy_cli

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kiproxy``."""
    parser = argparse.ArgumentParser(
        prog="kiproxy",
        description="A Kafka proxy that passes every produced record batch through an "
                    "interceptor that may transform or reject it.",
    )
    parser.add_argument("--version", action="version", version=f"kiproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    proxy_cli.add_parsers(sub)
    dev_cli.add_parsers(sub)
    pipelines_cli.add_parsers(sub)
    check_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kiproxy`` console script."""
    args = build_parser().parse_args(argv)
    if args.command in pipelines_cli.COMMANDS:
        return pipelines_cli.run(args)
    if args.command in check_cli.COMMANDS:
        return check_cli.run(args)
    if args.command in dev_cli.COMMANDS:
        return dev_cli.run(args)
    return proxy_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
