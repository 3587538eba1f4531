"""Who may reload a running proxy over HTTP (``proxy.admin.guard``).

A real ``kiproxy run`` in front of the session's Tansu broker, asked over real
HTTP: with ``admin.token_file`` set, ``POST /reload`` needs the file's token
(refusals answered 401, counted in ``kiproxy_admin_refused_total`` and logged
at most once per interval) while ``/metrics``, ``/healthz``, ``/livez`` and
``/readyz`` stay open; a rotated token takes effect without a restart. The
"on this host only" default cannot be tried from another host here, so its
decision is checked on the guard itself with the addresses a remote peer has.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import launch_proxy
from prometheus_client.parser import text_string_to_metric_families

from kiproxy.proxy.admin.guard import AdminGuard
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)


def _http(method: str, url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(url, method=method, headers=headers,
                                     data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:  # RFC 6750: a 401 names the scheme it wants
            assert exc.headers["WWW-Authenticate"].startswith("Bearer ")
        return exc.code, exc.read().decode()


def _refused(metrics: str, reason: str) -> float:
    _, text = _http("GET", f"http://{metrics}/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kiproxy_admin_refused_total" and sample.labels == {
                    "reason": reason}:
                return sample.value
    return 0.0


def test_reload_needs_the_token_and_the_health_endpoints_stay_open(
        tmp_path: Path, broker: EmbeddedBroker) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-one\n")
    config = tmp_path / "kiproxy.yaml"
    config.write_text(f"admin:\n  token_file: {token_file}\n")
    metrics = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(broker.bootstrap, "--metrics-listen", metrics, config_file=config)
    try:
        for path in ("/metrics", "/healthz", "/livez", "/readyz"):
            assert _http("GET", f"http://{metrics}{path}")[0] == 200, path

        status, body = _http("POST", f"http://{metrics}/reload")
        assert status == 401 and "Authorization: Bearer" in body
        for _ in range(20):
            assert _http("POST", f"http://{metrics}/reload", token="wrong")[0] == 401
        assert _refused(metrics, "bad_token") == 21
        # A flood of refusals is one log line per interval, not one per request.
        assert sum("refused" in line and "admin request" in line for line in proxy.lines) == 1

        status, body = _http("POST", f"http://{metrics}/reload", token="s3cret-one")
        assert status == 200 and '"ok": true' in body
        assert "reload (http) applied" in proxy.wait_for_line("reload (http) applied")

        token_file.write_text("s3cret-two")  # a rotated secret: read on every attempt
        assert _http("POST", f"http://{metrics}/reload", token="s3cret-one")[0] == 401
        assert _http("POST", f"http://{metrics}/reload", token="s3cret-two")[0] == 200
        token_file.unlink()
        status, body = _http("POST", f"http://{metrics}/reload", token="s3cret-two")
        assert status == 403 and "token file" in body
        assert _refused(metrics, "no_token_file") == 1
        assert proxy.alive()
    finally:
        proxy.stop()


def test_without_a_token_file_only_this_host_may_reload() -> None:
    guard = AdminGuard(None)
    assert guard.check("127.0.0.1", "0.0.0.0", None) is None
    assert guard.check("::1", "::", None) is None
    assert guard.check("::ffff:127.0.0.1", "::", None) is None
    assert guard.check("10.0.0.7", "10.0.0.7", None) is None  # a sibling worker on this host
    refusal = guard.check("10.0.0.8", "10.0.0.7", "Bearer anything")
    assert refusal is not None and refusal[0] == 403 and "admin.token_file" in refusal[1]
    assert guard.authorization() is None


def test_a_token_file_is_required_from_local_callers_too(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("abc")
    guard = AdminGuard(str(tmp_path / "t"))
    assert guard.check("127.0.0.1", "127.0.0.1", None) == (
        401, "an Authorization: Bearer <token> header is required")
    assert guard.check("10.0.0.8", "10.0.0.7", "bearer abc") is None
    assert guard.authorization() == "Bearer abc"
