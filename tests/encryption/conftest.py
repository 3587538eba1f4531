"""Fixtures of the record encryption tests: AWS KMS served by moto on loopback, driven
through boto3 as an AWS user drives it, stand-ins that hang or answer garbage, and a
provider that counts the calls it passes on.

* ``moto_kms``: one moto server (``ThreadedMotoServer``, port 0) for the session; its URL.
* ``aws_env``: the environment an AWS SDK reads (test credentials, region, no
  profile or config file of the machine's) for one test.
* ``kms_admin``: a boto3 KMS client of ``moto_kms``, as an operator's.
* ``kek``: a fresh KMS key with a fresh alias (``alias/KEK_<hex>``): ``(alias, arn)``.
* ``aws_key_states``: moto 5 wraps and unwraps under a disabled key, or one scheduled
  for deletion; AWS refuses both (``DisabledException``, ``KMSInvalidStateException``).
  This fixture gives moto AWS's rule, raised through moto's own error answers.
* ``counted``: wraps a provider, counting the calls of each operation.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from moto.core.exceptions import JsonRESTError
from moto.kms.models import KmsBackend
from moto.server import ThreadedMotoServer

from kiproxy.interceptors.builtin.record_encryption import DataKey, KmsProvider
from kiproxy.interceptors.builtin.record_encryption.aws_kms import (
    AwsKmsProvider,
    AwsKmsSettings,
)

REGION = "eu-west-1"


@pytest.fixture(scope="session")
def moto_kms() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_KMS", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAKIPROXYTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kiproxy-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def kms_admin(moto_kms: str, aws_env: None) -> Any:
    return boto3.client("kms", endpoint_url=moto_kms, region_name=REGION)


@pytest.fixture
def kek(kms_admin: Any) -> tuple[str, str]:
    meta = kms_admin.create_key(Description="kiproxy record encryption test")["KeyMetadata"]
    alias = f"alias/KEK_{uuid.uuid4().hex[:12]}"
    kms_admin.create_alias(AliasName=alias, TargetKeyId=meta["KeyId"])
    return alias, meta["Arn"]


def aws_provider(endpoint: str, **settings: Any) -> AwsKmsProvider:
    """A provider of ``endpoint`` with short, explicit bounds."""
    settings = {"connect_timeout_ms": 500, "read_timeout_ms": 1000, "max_attempts": 1,
                **settings}
    return AwsKmsProvider(AwsKmsSettings.from_config({"endpoint": endpoint, **settings}))


@pytest.fixture
def aws_key_states(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse_unusable(backend: KmsBackend, key_id: str) -> None:
        key = backend.keys[backend.any_id_to_key_id(key_id)]
        if key.key_state == "Disabled":
            raise JsonRESTError("DisabledException", f"{key.arn} is disabled.")
        if key.key_state == "PendingDeletion":
            raise JsonRESTError("KMSInvalidStateException", f"{key.arn} is pending deletion.")

    decrypt, generate = KmsBackend.decrypt, KmsBackend.generate_data_key

    def checked_decrypt(self: KmsBackend, **kwargs: Any) -> Any:
        plaintext, arn = decrypt(self, **kwargs)
        refuse_unusable(self, arn)
        return plaintext, arn

    def checked_generate(self: KmsBackend, **kwargs: Any) -> Any:
        refuse_unusable(self, kwargs["key_id"])
        return generate(self, **kwargs)

    monkeypatch.setattr(KmsBackend, "decrypt", checked_decrypt)
    monkeypatch.setattr(KmsBackend, "generate_data_key", checked_generate)


class CountingKms(KmsProvider):
    """Passes every call to ``inner``, counting them by operation."""

    def __init__(self, inner: KmsProvider) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    async def resolve_key(self, reference: str) -> str:
        self.calls["resolve_key"] += 1
        return await self.inner.resolve_key(reference)

    async def generate_data_key(self, key_id: str) -> DataKey:
        self.calls["generate_data_key"] += 1
        return await self.inner.generate_data_key(key_id)

    async def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        self.calls["decrypt_data_key"] += 1
        return await self.inner.decrypt_data_key(key_id, wrapped)

    async def close(self) -> None:
        await self.inner.close()


class StandIn:
    """A TCP server on loopback that accepts and does what ``answer`` says with each
    connection (``answer`` None: read and never answer). Counts connections."""

    def __init__(self, answer: Callable[[socket.socket], None] | None) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            self._held.append(conn)
            if self.answer is not None:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    self.answer(conn)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._held:
            conn.close()
        self.sock.close()


@pytest.fixture
def stand_in() -> Iterator[Callable[[Callable[[socket.socket], None] | None], StandIn]]:
    made: list[StandIn] = []

    def make(answer: Callable[[socket.socket], None] | None) -> StandIn:
        made.append(StandIn(answer))
        return made[-1]

    yield make
    for server in made:
        server.close()
