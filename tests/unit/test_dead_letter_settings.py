"""``dead_letter_sink:`` in the config model: defaults, the connection it resolves, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.proxy.config.model import ConfigError, UpstreamTlsSettings, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(text)
    return path


def test_the_sink_defaults_to_the_upstream_cluster_and_its_tls(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "upstream: [b1:9092, b2:9092]\n"
                                         "upstream_tls: {ca: /etc/ca.pem}\n"), {})
    bootstrap, tls = config.dead_letter_sink.connection(config.upstream, config.upstream_tls)
    assert bootstrap == ("b1:9092", "b2:9092")
    assert tls == UpstreamTlsSettings(ca="/etc/ca.pem")
    assert config.dead_letter_sink.queue_records == 10_000


def test_a_cluster_of_its_own_has_its_own_tls_and_sasl(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    config = load_config(write(tmp_path, f"""
upstream: [b1:9092]
upstream_tls: {{enabled: true}}
dead_letter_sink:
  bootstrap: dlq1:9093
  sasl: {{mechanism: SCRAM-SHA-512, username: dlq-writer, password_file: {secret}}}
  queue_records: 500
"""), {})
    sink = config.dead_letter_sink
    assert sink.connection(config.upstream, config.upstream_tls) == (("dlq1:9093",), None)
    assert sink.sasl is not None and sink.sasl.secret() == "s3cret"
    assert sink.queue_records == 500


@pytest.mark.parametrize(("text", "message"), [
    ("dead_letter_sink: {bootstrap: [nohost]}", "dead_letter_sink.bootstrap"),
    ("dead_letter_sink: {queue_records: 0}", "dead_letter_sink.queue_records"),
    ("dead_letter_sink: {sasl: {username: u}}", "dead_letter_sink.sasl"),
    ("dead_letter_sink: {sasl: {username: u, password: p, password_file: f}}",
     "exactly one of password and password_file"),
    ("dead_letter_sink: {queue_size: 3}", "dead_letter_sink.queue_size"),
])
def test_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text + "\n"), {})
    assert message in caught.value.message
