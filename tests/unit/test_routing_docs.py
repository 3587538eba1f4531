"""The examples of docs/routing.md are valid configs that do what the text says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiproxy.interceptors import ClientIdentity
from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.routes.table import RouteTable

DOC = Path(__file__).resolve().parents[2] / "docs" / "routing.md"
ROUTES_PART = DOC.read_text().split("## The `topic_router` built-in")[0]
YAML_BLOCKS = re.findall(r"```yaml\n(.*?)```", ROUTES_PART, re.DOTALL)
ERROR_BLOCK = re.search(r"```text\n(routes\[2\].*?)```", DOC.read_text(), re.DOTALL)


def _load(text: str) -> ProxyConfig:
    data: dict[str, Any] = yaml.safe_load(text)
    return ProxyConfig.model_validate(data)


def _who(**facts: Any) -> ClientIdentity:
    return ClientIdentity(**({"client_host": "10.0.0.9", "client_port": 1} | facts))


def test_the_doc_has_its_examples() -> None:
    assert len(YAML_BLOCKS) == 4 and ERROR_BLOCK is not None


@pytest.mark.parametrize("block", YAML_BLOCKS)
def test_every_yaml_example_is_a_valid_config_without_warnings(block: str) -> None:
    config = _load(block)
    assert config.route_warnings() == []


def test_the_first_example_routes_as_described() -> None:
    table = RouteTable.from_config(_load(YAML_BLOCKS[0]))

    def route(identity: ClientIdentity, topic: str) -> str | None:
        chosen = table.select(identity, topic, -1, False)
        return None if chosen is None else chosen.name

    assert route(_who(principal="payments-svc"), "payments.eu") == "payments"
    assert route(_who(client_id="legacy-batch-3"), "payments.eu") == "legacy-exempt"
    assert route(_who(client_host="2001:db8::7"), "orders") == "outside-network"
    assert route(_who(), "orders") == "unknown-client"


def test_the_shorthand_example_is_one_route_named_default() -> None:
    route = RouteTable.from_config(_load(YAML_BLOCKS[2])).select(_who(), "any", 1, False)
    assert route is not None and route.name == "default"


def test_the_listed_errors_are_the_ones_the_config_gives(tmp_path: Path) -> None:
    assert ERROR_BLOCK is not None
    expected = ERROR_BLOCK.group(1).strip().splitlines()
    configs = [
        "routes: [{interceptors: [{class: a:B}]}, {match: {topic: a}, interceptors: "
        "[{class: a:B}]}, {match: {client_address: [10.0.0.0/33]}, interceptors: [{class: a:B}]}]",
        "routes: [{match: {client_address: [10.0.0.1/8]}, interceptors: [{class: a:B}]}]",
        "routes: [{interceptors: [{class: a:B}]}, {match: {topic: '('}, "
        "interceptors: [{class: a:B}]}]",
        "routes: [{match: {owner: x}, interceptors: [{class: a:B}]}]",
    ]
    for text, line in zip(configs, expected, strict=True):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_config(path, {})
        assert str(caught.value).endswith(line)
