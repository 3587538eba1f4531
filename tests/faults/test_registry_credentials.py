"""A registry whose TLS or token material is wrong, or replaced.

The stand-in registry serves HTTPS with a certificate of the test CA, requires a client
certificate that CA signed, and a bearer token. The registry client, configured with a
CA that did not sign the server's certificate, an expired client certificate, one from
another CA, or a token the registry refuses, fails the lookup as "registry unavailable"
with a message naming the setting, and writes one WARNING per cause however many
lookups fail. Replacing the files the settings name (the client certificate and key,
the token) is picked up by the next lookup, with no reload; a replacement that cannot be
loaded keeps the material read before. Through a real proxy, a refused token, a wrong CA
or an expired client certificate is a retriable answer under ``reject`` and a stored
record under ``pass``, producers of other topics are served meanwhile, and putting the
right file back is picked up.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import launch_proxy
from integration.test_interception import _create_topics

from kiproxy.interceptors.builtin.schema_registry.registry import (
    RegistryUnavailable,
    SchemaRegistryClient,
)
from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings
from kiproxy_dev.tansu import EmbeddedBroker

from .pki import FaultPki, fault_pki
from .registry_standin import StandInRegistry
from .test_registry_faults import (
    ORDER,
    REQUEST_TIMED_OUT,
    OtherTopic,
    delivered_eventually,
    framed,
    produce_one,
)

pytestmark = pytest.mark.timeout(180)
TOKEN = "t0ken-2"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> FaultPki:
    return fault_pki(tmp_path_factory.mktemp("fault-pki"))


@pytest.fixture
def tls_standin(pki: FaultPki) -> Iterator[StandInRegistry]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    registry = StandInRegistry(tls=ctx, token=TOKEN)
    for schema_id in (5, 6, 7):
        registry.register(schema_id, ORDER, "orders-value")
    yield registry
    registry.close()


def replace(target: Path, source: Path | str) -> None:
    """Write ``source`` (a file, or text) over ``target``, with a new mtime however fast."""
    if isinstance(source, Path):
        shutil.copyfile(source, target)
    else:
        target.write_text(source)
    stamp = target.stat().st_mtime_ns + 1_000_000_000
    os.utime(target, ns=(stamp, stamp))


@pytest.fixture
def credentials(tmp_path: Path, pki: FaultPki) -> dict[str, Path]:
    """Files the settings name, to be replaced by a test: a good client certificate and
    key, and a good token."""
    files = {"cert": tmp_path / "client.pem", "key": tmp_path / "client.key",
             "token": tmp_path / "token", "ca": tmp_path / "ca.pem"}
    replace(files["cert"], pki.client_cert)
    replace(files["key"], pki.client_key)
    replace(files["token"], TOKEN + "\n")
    replace(files["ca"], pki.ca)
    return files


def client(url: str, files: dict[str, Path]) -> SchemaRegistryClient:
    return SchemaRegistryClient(RegistrySettings.from_config({
        "url": url, "ca_file": str(files["ca"]), "cert_file": str(files["cert"]),
        "key_file": str(files["key"]), "bearer_token_file": str(files["token"]),
        "timeout_ms": 2000}))


async def fails_twice_warns_once(c: SchemaRegistryClient, caplog: pytest.LogCaptureFixture,
                                 *needles: str) -> None:
    caplog.clear()
    for schema_id in (5, 6):  # two lookups, one line
        with pytest.raises(RegistryUnavailable) as failed:
            await c.schema_by_id(schema_id)
        assert all(n in str(failed.value) for n in needles), str(failed.value)
    lines = [r for r in caplog.records if r.name == "kiproxy.schema_registry"]
    assert [r.levelno for r in lines] == [logging.WARNING], [r.getMessage() for r in lines]
    assert all(n in lines[0].getMessage() for n in needles), lines[0].getMessage()


@pytest.mark.parametrize(("fault", "setting"), [
    ("wrong CA", "registry.ca_file"),
    ("expired client certificate", "registry.cert_file"),
    ("client certificate of another CA", "registry.cert_file"),
    ("refused token", "registry.bearer_token_file"),
])
async def test_wrong_material_names_the_setting_and_its_replacement_is_picked_up(
        fault: str, setting: str, tls_standin: StandInRegistry, pki: FaultPki,
        credentials: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    good: dict[str, Path | str] = {}
    if fault == "wrong CA":
        replace(credentials["ca"], pki.other_ca)
        good["ca"] = pki.ca
    elif fault == "refused token":
        replace(credentials["token"], "stale-token\n")
        good["token"] = TOKEN
    else:
        cert, key = ((pki.expired_cert, pki.expired_key) if fault.startswith("expired")
                     else (pki.stranger_cert, pki.stranger_key))
        replace(credentials["cert"], cert)
        replace(credentials["key"], key)
        good.update(cert=pki.client_cert, key=pki.client_key)
    c = client(tls_standin.url, credentials)
    try:
        with caplog.at_level(logging.WARNING, logger="kiproxy.schema_registry"):
            await fails_twice_warns_once(c, caplog, setting)
        for name, source in good.items():  # the files replaced, no reload
            replace(credentials[name], source)
        assert (await c.schema_by_id(5)).schema_id == 5
    finally:
        await c.close()


async def test_a_replacement_that_cannot_be_loaded_keeps_the_previous_material_and_says_so(
        tls_standin: StandInRegistry, credentials: dict[str, Path], pki: FaultPki,
        caplog: pytest.LogCaptureFixture) -> None:
    c = client(tls_standin.url, credentials)
    try:
        assert (await c.schema_by_id(7)).schema_id == 7
        replace(credentials["cert"], "not a certificate\n")  # a rotation half written
        credentials["token"].unlink()
        with caplog.at_level(logging.WARNING, logger="kiproxy.schema_registry"):
            assert (await c.schema_by_id(5)).schema_id == 5  # the previous material
        warned = " | ".join(r.getMessage() for r in caplog.records)
        assert "cannot load registry.cert_file" in warned, warned
        assert "cannot read registry.bearer_token_file" in warned, warned
        replace(credentials["token"], TOKEN + "\n")
        fresh = client(tls_standin.url, credentials)  # nothing read before: it cannot go on
        try:
            with pytest.raises(RegistryUnavailable, match=r"cannot load registry\.cert_file"):
                await fresh.schema_by_id(6)
            replace(credentials["cert"], pki.client_cert)
            assert (await fresh.schema_by_id(6)).schema_id == 6
        finally:
            await fresh.close()
    finally:
        await c.close()


@pytest.mark.parametrize(("fault", "file", "bad", "warning"), [
    ("refused token", "token", "stale-token\n", ("HTTP 401", "registry.bearer_token_file")),
    ("wrong CA", "ca", "other_ca", ("CERTIFICATE_VERIFY_FAILED", "registry.ca_file")),
    ("expired client certificate", "cert", "expired_cert", ("registry.cert_file",)),
])
def test_wrong_material_through_the_proxy_follows_the_policy_and_stalls_no_one(
        fault: str, file: str, bad: str, warning: tuple[str, ...], broker: EmbeddedBroker,
        tls_standin: StandInRegistry, credentials: dict[str, Path], pki: FaultPki) -> None:
    run = uuid.uuid4().hex[:6]
    topics = {"reject": f"rc{run}-strict", "pass": f"rc{run}-lenient"}
    plain = f"rc{run}-plain"
    _create_topics(broker.bootstrap, *topics.values(), plain)
    ids = {"reject": 11, "pass": 12}
    for policy, topic in topics.items():
        tls_standin.register(ids[policy], ORDER, f"{topic}-value")
    good = credentials[file].read_text()
    if file == "cert":  # the key goes with the certificate
        replace(credentials["key"], pki.expired_key)
    replace(credentials[file], getattr(pki, bad) if hasattr(pki, bad) else bad)
    procs: dict[str, Any] = {}
    try:
        for policy, topic in topics.items():
            procs[policy] = launch_proxy(broker.bootstrap, interceptor="schema_registry",
                                         interceptor_config={
                "registry": {"url": tls_standin.url, "ca_file": str(credentials["ca"]),
                             "cert_file": str(credentials["cert"]),
                             "key_file": str(credentials["key"]),
                             "bearer_token_file": str(credentials["token"]),
                             "negative_ttl_s": 0.5},
                "on_registry_unavailable": policy, "topics": {topic: {"value": "payload"}}})
        with OtherTopic(procs["reject"].bootstrap, plain) as other:
            err = produce_one(procs["reject"].bootstrap, topics["reject"], framed(11))
            assert err is not None and err.code() == REQUEST_TIMED_OUT, fault
            assert produce_one(procs["pass"].bootstrap, topics["pass"], framed(12)) is None
        assert other.errors == [] and other.delivered > 0
        for proc in procs.values():
            proc.wait_for_line("level=WARNING", *warning)
        if file == "cert":
            replace(credentials["key"], pki.client_key)
        replace(credentials[file], good)  # replaced, no reload: picked up
        assert delivered_eventually(procs["reject"].bootstrap, topics["reject"],
                                    framed(11)) is None
        for proc in procs.values():
            assert not [line for line in proc.lines if "level=ERROR" in line or "Traceback" in line]
    finally:
        for proc in procs.values():
            proc.stop()
