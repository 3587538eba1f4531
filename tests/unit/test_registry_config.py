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
    ({}, r"registry\.url: required key is missing"),
    ({"url": "127.0.0.1:8081"}, r"registry\.url: '127.0.0.1:8081' is not an http"),
    ({"url": URL, "cache_size": 0}, r"registry\.cache_size: must be greater than 0, got 0"),
    ({"url": URL, "max_requests_in_flight": 0},
     r"registry\.max_requests_in_flight: must be greater than 0, got 0"),
    ({"url": URL, "timeout": 5},
     r"registry\.timeout: unknown key; did you mean registry\.timeout_ms\?"),
    ({"url": URL, "timeout_ms": "soon"},
     r"registry\.timeout_ms: expected an integer, got 'soon'"),
    ({"url": URL, "basic_auth": {"username": "u"}},
     r"registry\.basic_auth: give exactly one of password, password_file"),
    ({"url": URL, "basic_auth": {"username": "u", "pass": "p"}},
     r"registry\.basic_auth\.pass: unknown key; valid keys here: username, password, "),
    ({"url": URL, "bearer_token": "a", "basic_auth": {"username": "u", "password": "p"}},
     r"give one kind of credentials"),
    ({"url": URL, "cert_file": "c.pem"},
     r"registry: cert_file and key_file: a client certificate needs both"),
    ({"url": URL, "ca_file": "/no/such/ca.pem"}, r"registry\.ca_file: no file at '/no/such"),
])
def test_errors_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RegistrySettings.from_config(raw)


def test_a_registry_that_is_not_a_mapping() -> None:
    with pytest.raises(ValueError, match="registry: expected a mapping"):
        RegistrySettings.from_config("http://x")  # type: ignore[arg-type]


def test_every_setting_is_in_the_docs() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "builtin-settings.md").read_text()
    missing = [name for name in RegistrySettings.model_fields
               if f"`registry.{name}`" not in docs]
    assert missing == [], "regenerate docs/builtin-settings.md (make docs-config)"
