"""The command-line flags come from one declaration each.

``kiproxy run``/``dev``'s flags are the config model's fields that carry a
``Flag`` (kiproxy.interceptors.flags): their dests are the config keys, their
help the fields' docstrings with the fields' defaults, and a flag given sets
exactly its key. The plugin flags that ``replay`` and ``check`` share with
``run`` are the same declarations.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kiproxy.cli import build_parser, main
from kiproxy.interceptors.flags import PLUGINS_DIR, model_flags
from kiproxy.proxy.cli import _overrides
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config


def _command(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _sample(key: str, action: argparse.Action) -> list[str]:
    """Command-line words that set ``key`` through ``action`` to a valid value."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[-1])]
    samples: dict[str, str] = {
        "listen": "127.0.0.1:9300", "advertised_host": "proxy.example",
        "upstream": "broker:9092", "node_ports": "1=9301", "plugins_dir": "plugins",
        "interceptor.class": "uppercase", "interceptor.config": '{"a": 1}',
        "metrics_listen": "127.0.0.1:9404", "log_level": "DEBUG", "log_format": "json",
        "audit.path": "/tmp/audit.jsonl", "interceptor.compression.lz4_level": "3",
        "interceptor.compression.zstd_level": "5", "max_inline_encode_ms": "2.5",
    }
    return [flag, samples.get(key, "7")]


def _at(config: ProxyConfig, key: str) -> Any:
    value: Any = config
    for part in key.replace("interceptor.class", "interceptor.class_name").split("."):
        value = getattr(value, part)
    return value


def test_every_run_flag_sets_exactly_its_config_key() -> None:
    actions = {a.dest: a for a in _command("run")._actions}
    declared = list(model_flags(ProxyConfig))
    assert len(declared) >= 40
    for key, _, _ in declared:
        words = _sample(key, actions[key])
        args = build_parser().parse_args(["run", *words])
        given = {k: v for k, v in _overrides(args).items() if v is not None}
        assert list(given) == [key], words
        try:
            config = load_config(None, given)
        except ConfigError as exc:  # a setting that needs its pair (tls.cert and tls.key)
            assert key.rpartition(".")[0] in str(exc), (words, exc)
            continue
        assert _at(config, key) != _at(ProxyConfig(), key), words


def test_help_is_the_field_docstring_with_its_default() -> None:
    actions = {a.dest: a for a in _command("run")._actions}
    assert actions["max_in_flight"].help == (
        "Responses owed to one client before the proxy stops reading its requests "
        "(default 100)")
    assert actions["interceptor.timeout_ms"].help is not None
    assert actions["interceptor.timeout_ms"].help.endswith("(default 5000)")
    assert actions["tls.min_version"].choices == ("TLSv1.2", "TLSv1.3")


def test_dev_offers_the_run_flags_but_the_upstream_ones() -> None:
    run = {a.dest for a in _command("run")._actions}
    dev = {a.dest for a in _command("dev")._actions}
    run_only = {k for k, _, f in model_flags(ProxyConfig)
                if f.commands is not None and "dev" not in f.commands}
    assert run_only == {"upstream", "wait_for_upstream", "upstream_startup_timeout_ms",
                        "workers", "upstream_tls.enabled", "upstream_tls.ca",
                        "upstream_tls.cert", "upstream_tls.key",
                        "upstream_tls.verify_hostname"}
    assert run - dev == run_only
    assert dev - run == {"broker", "kafka_home", "kafka_nodes",
                         "registry", "registry_port", "registry_jar"}


def test_replay_and_check_share_the_plugin_flags_with_run() -> None:
    for command in ("run", "dev", "replay", "check"):
        (action,) = [a for a in _command(command)._actions if "--plugins-dir" in a.option_strings]
        assert action.help == PLUGINS_DIR.help, command
    check = {a.option_strings[-1]: a for a in _command("check")._actions if a.option_strings}
    assert check["--timeout-ms"].default == 5000 and check["--config"].metavar == "JSON"
    replay = {a.option_strings[-1]: a for a in _command("replay")._actions
              if a.option_strings}
    assert replay["--interceptor"].required
    assert replay["--interceptor-timeout-ms"].default == 5000


def test_a_bad_flag_value_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--upstream", "b:9092", "--node-port", "one=2"]) == 2
    assert "--node-port 'one=2': expected NODE=PORT" in capsys.readouterr().err
    assert main(["run", "--upstream", "b:9092", "--interceptor-config", "[1]"]) == 2
    assert "--interceptor-config: must be a JSON object" in capsys.readouterr().err
