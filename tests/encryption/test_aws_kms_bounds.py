"""The AWS KMS provider's TLS settings (CA bundle, verification) against moto served over
HTTPS on loopback, and its thread pool bound."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from support.registry import Pki, make_pki
from werkzeug.serving import make_server

from encryption.conftest import StandIn, aws_provider
from kiproxy.interceptors.builtin.record_encryption import KmsError, KmsUnavailable

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def moto_https(pki: Pki) -> Iterator[str]:
    """moto's KMS (the same keys as ``moto_kms``: one backend per process) over HTTPS,
    its certificate for 127.0.0.1 signed by ``pki.ca``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app),
                         True, request_handler=MotoRequestHandler, ssl_context=ctx)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


async def test_a_kms_over_tls_is_trusted_through_the_ca_bundle(
        moto_https: str, pki: Pki, kek: tuple[str, str]) -> None:
    provider = aws_provider(moto_https, ca_bundle=str(pki.ca))
    key = await provider.generate_data_key(await provider.resolve_key(kek[0]))
    assert await provider.decrypt_data_key(key.key_id, key.wrapped) == key.plaintext
    await provider.close()


async def test_aws_ca_bundle_is_read_as_the_sdks_read_it(
        moto_https: str, pki: Pki, kek: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(pki.ca))
    provider = aws_provider(moto_https)
    assert await provider.resolve_key(kek[0]) == kek[1]
    await provider.close()


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
async def test_an_untrusted_certificate_names_the_ca_bundle_setting(
        moto_https: str, kek: tuple[str, str]) -> None:
    provider = aws_provider(moto_https)
    with pytest.raises(KmsError, match=r"TLS handshake failed.*; set kms\.ca_bundle") as caught:
        await provider.resolve_key(kek[0])
    assert not caught.value.retriable
    await provider.close()

    unchecked = aws_provider(moto_https, verify_tls=False)
    assert await unchecked.resolve_key(kek[0]) == kek[1]
    await unchecked.close()


async def test_at_most_max_calls_in_flight_threads_call_the_kms(
        stand_in: Callable[[Callable[[Any], None] | None], StandIn]) -> None:
    silent = stand_in(None)
    provider = aws_provider(silent.url, read_timeout_ms=200, max_calls_in_flight=2)
    calls = [provider.decrypt_data_key("arn:aws:kms:eu-west-1:1:key/k", b"w%d" % i)
             for i in range(6)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, KmsUnavailable) for r in results)
    mine = f"kiproxy-kms-{id(provider):x}_"  # the pool names its threads for the provider
    threads = [t for t in threading.enumerate() if t.name.startswith(mine)]
    assert 1 <= len(threads) <= 2
    await provider.close()


def test_ca_bundle_path_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no file"):
        aws_provider("https://127.0.0.1:1", ca_bundle=str(tmp_path / "ca.pem"))
