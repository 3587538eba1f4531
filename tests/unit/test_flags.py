"""The command-line flags come from one declaration each.

``kiproxy run``/``dev``'s flags are the config model's fields that carry a
``Flag`` (kiproxy.interceptors.flags): their dests are the config keys, their
help the fields' docstrings with the fields' defaults, and a flag given sets
exactly its key. The plugin flags that ``replay`` and ``check`` share with
``run`` are the same declarations. ``replay``/``report``'s job options and
``dev``'s broker options are the fields of small settings models, built from the
parsed flags through the model (its errors naming the flag).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kiproxy.cli import build_parser, main
from kiproxy.interceptors.flags import PLUGINS_DIR, FlagError, model_flags, model_from_flags
from kiproxy.pipelines.settings import ReplaySettings, ReportSettings
from kiproxy.proxy.cli import _overrides
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy_dev.cli import DevSettings


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
    assert dev - run == {"broker", "broker_port", "kafka_home", "kafka_nodes",
                         "registry", "registry_port", "registry_jar",
                         "kms", "kms_port", "kms_key"}


def test_replay_and_check_share_the_plugin_flags_with_run() -> None:
    for command in ("run", "dev", "replay", "check"):
        (action,) = [a for a in _command(command)._actions if "--plugins-dir" in a.option_strings]
        assert action.help == PLUGINS_DIR.help, command
    check = {a.option_strings[-1]: a for a in _command("check")._actions if a.option_strings}
    assert check["--timeout-ms"].default == 5000 and check["--config"].metavar == "JSON/FILE"
    replay = {a.option_strings[-1]: a for a in _command("replay")._actions
              if a.option_strings}
    assert replay["--interceptor"].required
    assert replay["--interceptor-timeout-ms"].help.endswith("(default 5000)")


def test_a_bad_flag_value_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--upstream", "b:9092", "--node-port", "one=2"]) == 2
    assert "--node-port 'one=2': expected NODE=PORT" in capsys.readouterr().err
    assert main(["run", "--upstream", "b:9092", "--interceptor-config", "[1]"]) == 2
    assert ("--interceptor-config: no file [1] (a value that does not start with '{' is the "
            "path of a JSON or YAML file)") in capsys.readouterr().err


_REPLAY = ["replay", "--bootstrap", "b:9092", "--topic", "orders", "--interceptor", "uppercase"]


def _parse(words: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(words)


@pytest.mark.parametrize(("command", "model"), [
    ("replay", ReplaySettings), ("report", ReportSettings), ("dev", DevSettings)])
def test_job_flags_are_the_settings_fields(command: str, model: Any) -> None:
    dests = {a.dest for a in _command(command)._actions}
    keys = {key for key, _, _ in model_flags(model)}
    assert keys <= dests
    if command != "dev":  # dev adds the proxy's flags and --config
        assert dests - keys == {"help"}


def test_replay_defaults_are_the_fields_defaults() -> None:
    settings = model_from_flags(_parse(_REPLAY), ReplaySettings)
    assert (settings.bootstrap, settings.topic, settings.interceptor) == (
        "b:9092", "orders", "uppercase")
    assert settings.from_offsets == "earliest" and settings.to_offsets == "latest"
    assert settings.reader == "auto" and settings.isolation_level == "read_committed"
    assert (settings.max_records_per_task, settings.chunk_records) == (100_000, 500)
    assert settings.interceptor_timeout_ms == 5000 and settings.interceptor_config == {}
    assert settings.report == Path("kiproxy-replay-report")
    assert settings.spark_conf == {} and settings.consumer_property == []
    assert settings.progress is None and settings.verbose is False
    assert settings.output_topic is None and settings.output_path is None


def test_replay_flags_reach_the_settings() -> None:
    settings = model_from_flags(_parse([
        *_REPLAY, "--plugins-dir", "plugins", "--interceptor-config", '{"a": 1}',
        "--interceptor-timeout-ms", "250", "--from-offsets", "latest-10",
        "--to-offsets", "1763848800000", "--output-path", "/tmp/out", "--report", "r",
        "--reader", "consumer", "--isolation-level", "read_uncommitted",
        "--max-records-per-task", "7", "--chunk-records", "3",
        "--spark-conf", "spark.a=1", "--spark-conf", "spark.b=x=y", "--master", "local[2]",
        "--no-progress", "--verbose", "--command-config", "client.properties",
        "--consumer-property", "security.protocol=SSL",
        "--consumer-property", "ssl.ca.location=ca.pem"]), ReplaySettings)
    assert settings.plugins_dir == Path("plugins")
    assert settings.interceptor_config == {"a": 1} and settings.interceptor_timeout_ms == 250
    assert (settings.from_offsets, settings.to_offsets) == ("latest-10", "1763848800000")
    assert settings.output_path == "/tmp/out" and settings.report == Path("r")
    assert (settings.reader, settings.isolation_level) == ("consumer", "read_uncommitted")
    assert (settings.max_records_per_task, settings.chunk_records) == (7, 3)
    assert settings.spark_conf == {"spark.a": "1", "spark.b": "x=y"}
    assert settings.master == "local[2]" and settings.progress is False and settings.verbose
    assert settings.command_config == Path("client.properties")
    assert settings.consumer_property == ["security.protocol=SSL", "ssl.ca.location=ca.pem"]


def test_report_flags_reach_the_settings() -> None:
    settings = model_from_flags(_parse([
        "report", "--audit", "a.jsonl", "--audit", "b.jsonl*", "--out", "o",
        "--audit-topic", "kiproxy-audit", "--bootstrap", "b:9092",
        "--since", "2026-11-01", "--until", "2026-11-02"]), ReportSettings)
    assert settings.audit == ["a.jsonl", "b.jsonl*"] and settings.out == Path("o")
    assert (settings.audit_topic, settings.bootstrap) == ("kiproxy-audit", "b:9092")
    assert (settings.since, settings.until) == ("2026-11-01", "2026-11-02")


@pytest.mark.parametrize("words", [
    ["replay", "--topic", "t", "--interceptor", "uppercase"],  # no --bootstrap
    [*_REPLAY, "--output-topic", "t2", "--output-path", "/tmp/out"],
    [*_REPLAY, "--reader", "kafka"],
    [*_REPLAY, "--chunk-records", "many"],
    ["report", "--audit", "a.jsonl"],  # no --out
    ["dev", "--broker", "redpanda"],
])
def test_parse_errors_of_the_job_flags(words: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(words)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("words", "model", "message"), [
    ([*_REPLAY, "--chunk-records", "0"], ReplaySettings,
     "--chunk-records: Input should be greater than 0"),
    ([*_REPLAY, "--max-records-per-task", "-1"], ReplaySettings,
     "--max-records-per-task: Input should be greater than 0"),
    ([*_REPLAY, "--interceptor-timeout-ms", "0"], ReplaySettings,
     "--interceptor-timeout-ms: Input should be greater than 0"),
    ([*_REPLAY, "--spark-conf", "spark.a"], ReplaySettings,
     "--spark-conf 'spark.a': expected KEY=VALUE"),
    ([*_REPLAY, "--interceptor-config", "{1}"], ReplaySettings,
     "--interceptor-config: not valid JSON (Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1))"),
    (["report", "--out", "o", "--spark-conf", "=1"], ReportSettings,
     "--spark-conf '=1': expected KEY=VALUE"),
    (["dev", "--kafka-nodes", "0", "--broker", "kafka"], DevSettings,
     "--kafka-nodes: Input should be greater than 0"),
    (["dev", "--registry-port", "70000", "--registry"], DevSettings,
     "--registry-port: Input should be less than or equal to 65535"),
    (["dev", "--kafka-nodes", "1"], DevSettings,
     "--kafka-home and --kafka-nodes need --broker kafka"),
    (["dev", "--registry-jar", "r.jar"], DevSettings,
     "--registry-jar and --registry-port need --registry"),
])
def test_a_refused_job_setting_names_its_flag(words: list[str], model: Any,
                                              message: str) -> None:
    with pytest.raises(FlagError) as refused:
        model_from_flags(_parse(words), model)
    assert str(refused.value) == message


def test_dev_settings_defaults_and_flags() -> None:
    assert model_from_flags(_parse(["dev"]), DevSettings) == DevSettings()
    settings = model_from_flags(_parse([
        "dev", "--broker", "kafka", "--kafka-home", "/opt/kafka", "--kafka-nodes", "3",
        "--registry", "--registry-port", "18081", "--registry-jar", "r.jar"]), DevSettings)
    assert settings == DevSettings(broker="kafka", kafka_home=Path("/opt/kafka"), kafka_nodes=3,
                                   registry=True, registry_port=18081,
                                   registry_jar=Path("r.jar"))
    assert DevSettings().broker == "tansu" and DevSettings().registry_port == 8081


@pytest.mark.parametrize("command", ["run", "dev", "replay", "check"])
def test_the_plugin_config_flag_says_it_takes_inline_json_or_a_file(command: str) -> None:
    action = next(a for a in _command(command)._actions
                  if {"--interceptor-config", "--config"} & set(a.option_strings)
                  and a.metavar == "JSON/FILE")
    assert "(text starting with '{')" in (action.help or "")
    assert "JSON or YAML file" in (action.help or "")


@pytest.mark.parametrize(("name", "text"), [
    ("config.json", '{"registry": {"url": "http://r:8081"}, "topics": {}}'),
    ("config.yaml", "registry: {url: 'http://r:8081'}\ntopics: {}\n"),
])
def test_the_plugin_config_flag_reads_a_json_or_yaml_file(tmp_path: Path, name: str,
                                                          text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    expected = {"registry": {"url": "http://r:8081"}, "topics": {}}
    run = load_config(None, _overrides(_parse(["run", "--upstream", "b:9092",
                                               "--interceptor-config", str(path)])))
    assert run.interceptor.config == expected
    replay = model_from_flags(_parse([*_REPLAY, "--interceptor-config", str(path)]),
                              ReplaySettings)
    assert replay.interceptor_config == expected
    inline = model_from_flags(_parse([*_REPLAY, "--interceptor-config", f"  {text}"]),
                              ReplaySettings) if name.endswith(".json") else None
    assert inline is None or inline.interceptor_config == expected


def test_a_plugin_config_file_that_does_not_parse_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("registry:\n  url: x\n")  # YAML in a .json file
    with pytest.raises(FlagError) as refused:
        model_from_flags(_parse([*_REPLAY, "--interceptor-config", str(path)]), ReplaySettings)
    assert str(refused.value) == (f"--interceptor-config: {path} is not valid JSON (Expecting "
                                  "value: line 1 column 1 (char 0))")


@pytest.mark.parametrize(("words", "servers"), [
    (["--upstream", "127.0.0.1:9998,127.0.0.1:9999"], ["127.0.0.1:9998", "127.0.0.1:9999"]),
    (["--upstream", "a:1, b:2", "--upstream", "c:3"], ["a:1", "b:2", "c:3"]),
    (["--upstream", "[::1]:9092,a:1"], ["[::1]:9092", "a:1"]),
])
def test_upstream_takes_a_bootstrap_servers_list(words: list[str], servers: list[str]) -> None:
    config = load_config(None, _overrides(_parse(["run", *words])))
    assert config.upstream == servers
    assert config.upstream_addresses[0] == (servers[0].rpartition(":")[0].strip("[]"),
                                            int(servers[0].rpartition(":")[2]))


def test_upstream_and_the_dead_letter_bootstrap_take_a_string_in_the_config_file(
        tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("upstream: k1:9092,k2:9092\n"
                    "dead_letter_sink: {bootstrap: 'd1:9092, d2:9092'}\n")
    config = load_config(path, {})
    assert config.upstream == ["k1:9092", "k2:9092"]
    assert config.dead_letter_sink.bootstrap == ("d1:9092", "d2:9092")


@pytest.mark.parametrize(("value", "message"), [
    ("a:1,,b:2", "upstream: 'a:1,,b:2' has an empty entry; write HOST:PORT,HOST:PORT"),
    ("a:1,b", "upstream: 'b' is not HOST:PORT"),
])
def test_a_bad_server_in_the_list_is_named(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, {"upstream": [value]})
    assert refused.value.message == message


@pytest.mark.parametrize(("kms", "said"), [
    ({"type": "aws", "endpoint": "http://127.0.0.1:24566", "region": "us-east-1"}, []),
    ({"type": "aws", "endpoint": "http://127.0.0.1:4566", "region": "us-east-1"},
     ["record_encryption's kms.endpoint is http://127.0.0.1:4566, not the stand-in at "
      "http://127.0.0.1:24566 (--kms-port); set one to the other"]),
    ({"type": "aws", "region": "us-east-1"},
     ["record_encryption's kms.endpoint is unset, so it calls AWS itself, not the stand-in "
      'at http://127.0.0.1:24566; set "endpoint": "http://127.0.0.1:24566"']),
    ({"type": "key_file", "path": "keys.yaml"}, []),
    ({"type": "aws", "endpoint": "http://localhost:24566"}, []),  # the same place
])
def test_dev_kms_says_when_the_proxy_would_not_call_its_stand_in(
        kms: dict[str, str], said: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kiproxy.proxy.config.model import load_config
    from kiproxy_dev.cli import kms_endpoint_problems

    monkeypatch.delenv("AWS_ENDPOINT_URL_KMS", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)

    config = load_config(None, {"upstream": ["127.0.0.1:9092"],
                                "interceptor.class": "record_encryption",
                                "interceptor.config": {"kms": kms, "key": "alias/KEK"}})
    assert kms_endpoint_problems(config, "http://127.0.0.1:24566") == said


def test_dev_kms_takes_the_endpoint_the_sdk_reads_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiproxy.proxy.config.model import load_config
    from kiproxy_dev.cli import kms_endpoint_problems

    monkeypatch.setenv("AWS_ENDPOINT_URL_KMS", "http://127.0.0.1:24566")
    config = load_config(None, {"upstream": ["127.0.0.1:9092"],
                                "interceptor.class": "record_encryption",
                                "interceptor.config": {"kms": {"type": "aws"},
                                                       "key": "alias/KEK"}})
    assert kms_endpoint_problems(config, "http://127.0.0.1:24566") == []
    assert kms_endpoint_problems(config, "http://127.0.0.1:4566") == [
        "AWS_ENDPOINT_URL_KMS is http://127.0.0.1:24566, not the stand-in at "
        "http://127.0.0.1:4566 (--kms-port); set one to the other"]
