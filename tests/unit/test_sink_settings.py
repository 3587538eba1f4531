"""``dead_letter_sink:`` and ``audit_sink:`` in the config model: one shape for both sinks,
their defaults, the connection each resolves, errors; configs written before
``audit_sink`` existed still load and mean what they meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.proxy.config.model import ConfigError, UpstreamTlsSettings, load_config

SECTIONS = ("dead_letter_sink", "audit_sink")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("section", SECTIONS)
def test_the_sink_defaults_to_the_upstream_cluster_and_its_tls(tmp_path: Path,
                                                                section: str) -> None:
    config = load_config(write(tmp_path, "upstream: [b1:9092, b2:9092]\n"
                                         "upstream_tls: {ca: /etc/ca.pem}\n"), {})
    sink = getattr(config, section)
    bootstrap, tls = sink.connection(config.upstream, config.upstream_tls)
    assert bootstrap == ("b1:9092", "b2:9092")
    assert tls == UpstreamTlsSettings(ca="/etc/ca.pem")
    assert (sink.queue_records, sink.queue_bytes) == (10_000, 64 * 2**20)
    assert (sink.request_timeout_ms, sink.close_timeout_ms) == (10_000, 5_000)


@pytest.mark.parametrize("section", SECTIONS)
def test_a_cluster_of_its_own_has_its_own_tls_and_sasl(tmp_path: Path, section: str) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    config = load_config(write(tmp_path, f"""
upstream: [b1:9092]
upstream_tls: {{enabled: true}}
{section}:
  bootstrap: side1:9093
  tls: {{ca: /etc/side-ca.pem}}
  sasl: {{mechanism: SCRAM-SHA-512, username: side-writer, password_file: {secret}}}
  queue_records: 500
  queue_bytes: 1048576
"""), {})
    sink = getattr(config, section)
    bootstrap, tls = sink.connection(config.upstream, config.upstream_tls)
    assert bootstrap == ("side1:9093",) and tls is not None and tls.ca == "/etc/side-ca.pem"
    assert sink.sasl is not None and sink.sasl.secret() == "s3cret"
    assert (sink.queue_records, sink.queue_bytes) == (500, 1048576)


def test_an_audit_topic_written_before_audit_sink_keeps_its_meaning(tmp_path: Path) -> None:
    """``audit: {topic}`` alone: the events go to the upstream cluster, as the client id
    ``kiproxy-audit`` with a 50 ms linger, as they did."""
    config = load_config(write(tmp_path, "upstream: [b1:9092]\naudit: {topic: events}\n"), {})
    assert config.audit.topic == "events"
    assert config.audit_sink.connection(config.upstream, config.upstream_tls) == (
        ("b1:9092",), None)
    assert (config.audit_sink.client_id, config.audit_sink.linger_ms) == ("kiproxy-audit", 50)
    assert config.dead_letter_sink.client_id == "kiproxy-dead-letter"


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize(("text", "message"), [
    ("{bootstrap: [nohost]}", ".bootstrap"),
    ("{queue_records: 0}", ".queue_records"),
    ("{queue_bytes: 0}", ".queue_bytes"),
    ("{request_timeout_ms: 0}", ".request_timeout_ms"),
    ("{sasl: {username: u}}", ".sasl"),
    ("{sasl: {username: u, password: p, password_file: f}}",
     "exactly one of password and password_file"),
    ("{queue_size: 3}", ".queue_size"),
])
def test_errors_name_the_key(tmp_path: Path, section: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, f"{section}: {text}\n"), {})
    assert message in caught.value.message
    if message.startswith("."):
        assert section + message in caught.value.message
