"""``kiproxy run``: the proxy in front of a cluster.

``add_parsers`` adds the subcommand to the ``kiproxy`` parser (:mod:`kiproxy.cli`);
``run`` executes it and returns the exit code. The flags are the config model's
(:func:`add_flags`: every setting with a :class:`~kiproxy.interceptors.flags.Flag`
on its field, its help and default from the field), and a flag given overrides
the config file's value (:func:`_overrides`). ``kiproxy dev``
(:mod:`kiproxy_dev.cli`) shares the flags, the start-up (:func:`run`
with its own ``body``) and :func:`~kiproxy.proxy.serve.serve_until_stopped`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kiproxy.interceptors.flags import FlagError, add_model_flags, model_overrides
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.proxy.brokers.discovery import UpstreamUnreachable, check_upstream
from kiproxy.proxy.collector import freeze_imported
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.observe.logs import setup_logging
from kiproxy.proxy.serve import run_loop as _run
from kiproxy.proxy.serve import serve_until_stopped
from kiproxy.proxy.workers import serve_workers

__all__ = ["COMMANDS", "add_flags", "add_parsers", "run"]

COMMANDS = ("run",)

Body = Callable[[ProxyConfig, argparse.Namespace, dict[str, Any]], int]
"""What runs once the configuration is loaded: returns the exit code."""


def add_flags(p: argparse.ArgumentParser, command: str) -> None:
    """``--config`` and the settings ``command`` (``run`` or ``dev``) offers as flags."""
    p.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    add_model_flags(p, ProxyConfig, command)


def add_parsers(subparsers: Any) -> None:
    """Add ``run`` to ``kiproxy``'s subcommands."""
    run = subparsers.add_parser("run", help="run the proxy in front of a Kafka cluster",
                                description="Run the proxy in front of a Kafka cluster.")
    add_flags(run, "run")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``{config key: value}`` of the flags in ``args`` (None where not given)."""
    try:
        return model_overrides(args, ProxyConfig)
    except FlagError as exc:
        raise ConfigError(str(exc)) from None


def run(args: argparse.Namespace, body: Body | None = None, **fixed: Any) -> int:
    """Load the configuration (the file, the flags over it, then ``fixed``), set up
    logging and run ``body`` (default: serve in front of the configured upstream);
    returns the exit code."""
    try:
        overrides = {**_overrides(args), **fixed}
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(*exc.lines(), sep="\n", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    freeze_imported()  # before any generation, connection or worker exists
    try:
        return (body or _serve_upstream)(config, args, overrides)
    except UpstreamUnreachable as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1
    except PluginLoadError as exc:
        print(f"kiproxy: plugin error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(*exc.lines(), sep="\n", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kiproxy: {exc}", file=sys.stderr)
        return 1


def _serve_upstream(config: ProxyConfig, args: argparse.Namespace,
                    overrides: dict[str, Any]) -> int:
    if not config.upstream:
        print("kiproxy: config error: upstream: at least one HOST:PORT is required "
              "(--upstream or the config file's upstream list)", file=sys.stderr)
        return 2
    if not config.wait_for_upstream:
        _run(check_upstream(config))
    if config.workers > 1:
        return serve_workers(config, args.config, overrides)
    serve_until_stopped(config, args.config, overrides)
    return 0
