"""Config errors speak kiproxy's words: the file, the key path, what is wrong, and the
key that was probably meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.cli import main as kiproxy_main
from kiproxy.proxy.config.model import ConfigError, load_config


def _errors(tmp_path: Path, text: str, **overrides: object) -> list[str]:
    path = tmp_path / "proxy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, dict(overrides))
    return [line.replace(str(path), "proxy.yaml") for line in info.value.lines()]


@pytest.mark.parametrize(("text", "line"), [
    ("interceptor:\n  timeout: 100\n",
     "interceptor.timeout: unknown key; did you mean interceptor.timeout_ms?"),
    ("plugin_dir: plugins\n", "plugin_dir: unknown key; did you mean plugins_dir?"),
    ("max_in_flight: ten\n", "max_in_flight: expected an integer, got 'ten'"),
    ("workers: 1.5\n", "workers: expected an integer, got 1.5"),
    ("audit:\n  requests: maybe\n", "audit.requests: expected true or false, got 'maybe'"),
    ("interceptor: uppercase\n",
     "interceptor: expected a mapping of settings, got 'uppercase'"),
    ("interceptor:\n  timeout_ms: 0\n", "interceptor.timeout_ms: must be greater than 0, got 0"),
    ("tls:\n  min_version: TLSv1.1\n",
     "tls.min_version: expected 'TLSv1.2' or 'TLSv1.3', got 'TLSv1.1'"),
    ("upstream: [broker]\n", "upstream: 'broker' is not HOST:PORT"),
    ("max_inline_encode_ms: -1\n", "max_inline_encode_ms: must be at least 0, got -1"),
    ("max_inline_encode_ms: yes\n", "max_inline_encode_ms: expected a number, got true"),
    ("node_ports: {one: 9193}\n", "node_ports: key 'one': expected an integer"),
    # accepted before: /readyz then said to free a port the proxy held itself
    ("listen: 127.0.0.1:9192\nnode_ports: {111: 9192}\n",
     "node_ports: node 111 is given port 9192, the listen port; each node needs a port of "
     "its own"),
    ("node_ports: {1: 9300, 2: 9300}\n",
     "node_ports: node 2 is given port 9300, node 1's; each node needs a port of its own"),
    ("observers:\n  - class: audit\n    confg: {}\n",
     "observers[0].confg: unknown key; did you mean observers[0].config?"),
    ("upstream_tls:\n  zzz: 1\n",
     "upstream_tls.zzz: unknown key; valid keys here: enabled, ca, cert, key, verify_hostname"),
    # a route's one link is wrong, not its list: no second line saying the list is short
    ("routes:\n  - name: r\n    match: {topic: x}\n    interceptors:\n"
     "      - {class: uppercase, timeout: 100}\n",
     "routes[0].interceptors[0].timeout: unknown key; did you mean "
     "routes[0].interceptors[0].timeout_ms?"),
])
def test_one_problem_is_one_line_naming_file_key_and_what_is_wrong(
        tmp_path: Path, text: str, line: str) -> None:
    assert _errors(tmp_path, text) == [f"kiproxy: config error in proxy.yaml: {line}"]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    assert _errors(tmp_path, "interceptor:\n  timeout: 100\nplugin_dir: plugins\n") == [
        "kiproxy: config error in proxy.yaml: interceptor.timeout: unknown key; "
        "did you mean interceptor.timeout_ms?",
        "kiproxy: config error in proxy.yaml: plugin_dir: unknown key; "
        "did you mean plugins_dir?",
    ]


def test_a_bad_flag_next_to_a_file_says_it_came_from_the_command_line(tmp_path: Path) -> None:
    assert _errors(tmp_path, "listen: 127.0.0.1:9192\n", max_in_flight=0) == [
        "kiproxy: config error in proxy.yaml: max_in_flight: must be greater than 0, got 0 "
        "(set on the command line)"]


def test_flags_alone_name_no_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"interceptor.timeout_ms": -5})
    assert info.value.lines() == [
        "kiproxy: config error: interceptor.timeout_ms: must be greater than 0, got -5"]


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        load_config(tmp_path / "nope.yaml", {})
    assert missing.value.lines() == [
        f"kiproxy: config error in {tmp_path / 'nope.yaml'}: cannot read the file: "
        "No such file or directory"]
    assert _errors(tmp_path, "- a\n- b\n") == [
        "kiproxy: config error in proxy.yaml: the file must be a mapping of settings "
        "(KEY: VALUE lines), not list"]
    (broken,) = _errors(tmp_path, "upstream: [\n")
    assert broken.startswith("kiproxy: config error in proxy.yaml: not valid YAML: ")
    assert "line 2" in broken


@pytest.mark.parametrize("text", ["", "\n", "# every line commented out\n# upstream: [b:9092]\n"])
def test_a_file_that_holds_no_settings_is_refused(tmp_path: Path, text: str) -> None:
    # A file caught while it is being rewritten (truncated, then written) must not be read
    # as every setting's default: a reload would drop the interceptor and say "applied".
    assert _errors(tmp_path, text) == [
        "kiproxy: config error in proxy.yaml: the file holds no settings (it is empty, or "
        "only comments); a configuration file names at least one, so that a file caught "
        "while it is being rewritten is not read as every setting's default"]


def test_the_command_prints_the_lines_and_exits_2(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The command's main, in this process: a config error is answered before anything is set up.
    path = tmp_path / "proxy.yaml"
    path.write_text("upstream: [127.0.0.1:9092]\ninterceptor:\n  timeout: 100\n")
    assert kiproxy_main(["run", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"kiproxy: config error in {path}: interceptor.timeout: "
                                       "unknown key; did you mean interceptor.timeout_ms?\n")
