"""The typed settings of ``wasm``, ``extism`` and ``schema_registry``: a topic's entry takes
the keys it leaves out from the top level, topics are picked as ``TopicSelector`` picks them,
and every error names its key."""

from __future__ import annotations

from typing import Any

import pytest

from kiproxy.interceptors.builtin.extism import ExtismSettings
from kiproxy.interceptors.builtin.schema_registry.settings import parse_settings as registry
from kiproxy.interceptors.builtin.wasm.interceptor import WasmSettings
from kiproxy.interceptors.settings import SettingsError, parse_settings

BOTH = "set max_memory_bytes or max_pages, not both"


def problems(model: Any, config: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as info:
        parse_settings(model, config)
    return info.value.problems


def test_a_wasm_topic_takes_the_top_level_keys_it_does_not_set() -> None:
    settings = parse_settings(WasmSettings, {
        "module": "a.wasm", "fuel": 7, "abi": "v2", "encoding": "BINARY",
        "topics": {"t": {"fuel": 9, "error": "POLICY_VIOLATION"}, "u": "u.wat"}})
    t, u = settings.entry("t"), settings.entry("u")
    assert (t.module, t.fuel, t.abi, t.encoding, t.error) == \
        ("a.wasm", 9, 2, "binary", "POLICY_VIOLATION")
    assert (u.module, u.fuel, u.abi, u.error) == ("u.wat", 7, 2, "INVALID_RECORD")
    assert problems(WasmSettings, {"topics": {"t": {"fuel": 1}}}) == (
        "topics.t: module (path to a .wasm or .wat file) is required",)


@pytest.mark.parametrize(("config", "problem"), [
    ({"plugin": "p.wasm", "max_pages": 4, "max_memory_bytes": 2**20}, BOTH),
    ({"max_memory_bytes": 2**20, "topics": {"t": {"plugin": "p.wasm", "max_pages": 4}}},
     f"topics.t: {BOTH}"),
    ({"patterns": [{"pattern": "(", "plugin": "p.wasm"}]},
     "patterns[0].pattern: '(' is not a regular expression"),
    ({"topics": {"t": {"function": "check"}}},
     "topics.t: plugin (a .wasm file or an Extism manifest) is required"),
    ({"topics": {"t": 5}}, "topics.t: expected a plugin file or a mapping of settings, got 5"),
    ({"plugin": "p.wasm", "pool_size": 0}, "pool_size: must be greater than 0, got 0"),
])
def test_extism_errors_name_the_key(config: dict[str, Any], problem: str) -> None:
    assert problems(ExtismSettings, config)[0].startswith(problem)


def test_an_extism_topic_takes_the_defaults_but_not_the_default_plugin() -> None:
    settings = parse_settings(ExtismSettings, {
        "plugin": "default.wasm", "max_pages": 8, "config": {"level": 3},
        "topics": {"t": "t.wasm", "u": {"plugin": "u.wasm", "max_pages": 2}}})
    t, problem = settings.merged(settings.topics["t"])
    assert (t.plugin, t.max_pages, t.config, problem) == ("t.wasm", 8, {"level": "3"}, "")
    assert settings.merged(settings.topics["u"])[0].max_pages == 2


def test_registry_topics_exact_names_first_then_expressions_in_order() -> None:
    settings = registry({"topics": {
        "orders.*": {"tombstones": "reject"},
        "orders": {"rules": [{"name": "r", "expr": "value.amount > 0"}]},
        "or.*": {"allow_unframed": True, "value": {"subject_strategy": "RecordName"}},
    }})
    assert settings.policy_for("orders").pattern == "orders"  # exact, though listed second
    assert settings.policy_for("orders-eu").pattern == "orders.*"
    other = settings.policy_for("ore")
    assert other is not None and other.pattern == "or.*"
    assert (other.value.allow_unframed, other.value.strategy, other.key.strategy) == \
        (True, "RecordName", "TopicName")
    assert settings.policy_for("payments") is None


def test_registry_rule_and_header_errors_name_the_key() -> None:
    with pytest.raises(SettingsError) as info:
        registry({"topics": {"o": {"rules": [{"name": "r", "expr": "true"},
                                             {"name": "r", "expr": " "}]}}})
    assert info.value.problems == ("topics.o.rules[1].expr: rule 'r' needs a CEL expression",)
    with pytest.raises(SettingsError) as info:
        registry({"topics": {"o": {"rules": [{"name": "r", "expr": "true"}] * 2}}})
    assert info.value.problems == ("topics.o.rules: rule 'r' is named twice ([0] and [1])",)
    with pytest.raises(SettingsError) as info:
        registry({"topics": {"o": {"value": "id", "rules": [{"name": "r", "expr": "true"}]}},
                  "registry": {"url": "http://r/apis/ccompat/v7"}})
    assert info.value.problems[0].startswith(
        "topics.o: rules read the decoded value, so value must be payload")
    header = registry({"registry": {"url": "http://r/apis/ccompat/v7"}, "topics": {"o": {
        "value": {"check": "id", "header": "apicurio.value.globalId"}}}})
    policy = header.policy_for("o")
    assert policy is not None and policy.value.header is not None
    assert (policy.value.header.id, header.global_ids) == ("global_id", True)
