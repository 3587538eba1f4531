"""``RegistrySettings.from_config``: the ``registry:`` mapping of the schema_registry
interceptor, checked at load; every error names the key it is about."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings

URL = "http://127.0.0.1:8081/apis/ccompat/v7"


def test_defaults_and_every_key(tmp_path: Path) -> None:
    assert RegistrySettings.from_config({"url": URL}).timeout_s == 2.0
    for name in ("ca.pem", "c.pem", "c.key", "token"):
        (tmp_path / name).write_text("x")
    s = RegistrySettings.from_config({
        "url": URL, "bearer_token_file": str(tmp_path / "token"),
        "ca_file": str(tmp_path / "ca.pem"), "cert_file": str(tmp_path / "c.pem"),
        "key_file": str(tmp_path / "c.key"), "timeout_ms": 500, "cache_size": 3,
        "cache_ttl_s": 1.5, "negative_ttl_s": 0, "subject_ttl_s": 2, "max_connections": 4,
        "max_requests_in_flight": 8})
    assert (s.cache_size, s.cache_ttl_s, s.negative_ttl_s, s.timeout_s) == (3, 1.5, 0, 0.5)
    assert (s.max_connections, s.max_requests_in_flight) == (4, 8)
    assert RegistrySettings.from_config({"url": URL}).max_requests_in_flight == 2
    auth = RegistrySettings.from_config(
        {"url": URL, "basic_auth": {"username": "u", "password": "p"}}).basic_auth
    assert auth is not None and (auth.username, auth.password) == ("u", "p")


@pytest.mark.parametrize(("raw", "message"), [
    ({}, r"registry\.url: Field required"),
    ({"url": "127.0.0.1:8081"}, r"registry\.url: '127.0.0.1:8081' is not an http"),
    ({"url": URL, "cache_size": 0}, r"registry\.cache_size: Input should be greater than 0"),
    ({"url": URL, "max_requests_in_flight": 0},
     r"registry\.max_requests_in_flight: Input should be greater than 0"),
    ({"url": URL, "timeout": 5}, r"registry\.timeout: Unexpected keyword argument"),
    ({"url": URL, "timeout_ms": "soon"}, r"registry\.timeout_ms: Input should be a valid int"),
    ({"url": URL, "basic_auth": {"username": "u"}},
     r"registry\.basic_auth: give exactly one of password, password_file"),
    ({"url": URL, "basic_auth": {"username": "u", "pass": "p"}},
     r"registry\.basic_auth\.pass: Unexpected keyword argument"),
    ({"url": URL, "bearer_token": "a", "basic_auth": {"username": "u", "password": "p"}},
     r"give one kind of credentials"),
    ({"url": URL, "cert_file": "c.pem"}, r"registry\.cert_file / registry\.key_file"),
    ({"url": URL, "ca_file": "/no/such/ca.pem"}, r"registry\.ca_file: no file at '/no/such"),
])
def test_errors_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RegistrySettings.from_config(raw)


def test_a_registry_that_is_not_a_mapping() -> None:
    with pytest.raises(ValueError, match="registry: expected a mapping"):
        RegistrySettings.from_config("http://x")  # type: ignore[arg-type]


def test_every_setting_is_in_the_docs() -> None:
    import dataclasses
    docs = (Path(__file__).parents[2] / "docs" / "schema-registry.md").read_text()
    table = docs.split("## Registry connection settings")[1].split("## ")[0]
    missing = [f.name for f in dataclasses.fields(RegistrySettings) if f"`{f.name}`" not in table]
    assert missing == [], "add these keys to docs/schema-registry.md's settings table"
