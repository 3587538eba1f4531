"""A local stand-in for AWS KMS (moto's server mode, in memory) for ``kiproxy dev --kms``.

Contract. :class:`LocalKms` serves the AWS KMS API on ``127.0.0.1:PORT`` from this
process (moto's ``ThreadedMotoServer``: CreateKey, CreateAlias, DescribeKey,
GenerateDataKey, Decrypt - what ``record_encryption`` calls), with empty storage;
keys live as long as the process. :meth:`LocalKms.create_key` makes a symmetric key
and points an alias at it (``alias/KEK_orders``), as an operator would with the AWS
CLI. Any AWS SDK reaches it with ``endpoint_url`` set to :attr:`LocalKms.url` and any
credentials (:data:`CREDENTIALS`, which ``kiproxy dev --kms`` puts in its own
environment when none are set, so the proxy it runs finds them).

moto and boto3 are the ``kms`` extra of this distribution (``pip install './dev[kms]'``);
:data:`MISSING` says so when they are absent.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

__all__ = ["CREDENTIALS", "MISSING", "KmsLaunchError", "LocalKms", "export_credentials"]

HOST = "127.0.0.1"

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "AWS_DEFAULT_REGION": "us-east-1"}
"""What an AWS SDK needs to call the stand-in (it accepts any key pair)."""

MISSING = ("--kms needs moto's server and boto3 (the kms extra of the dev distribution): "
           "pip install './dev[kms]' from a kiproxy checkout")


class KmsLaunchError(Exception):
    """The stand-in did not start: the message says why and what to do."""


class LocalKms:
    """The AWS KMS API on loopback (see the module docstring)."""

    def __init__(self, port: int = 4566, region: str = CREDENTIALS["AWS_DEFAULT_REGION"]
                 ) -> None:
        self.port = port
        self.region = region
        self._server: Any = None

    @property
    def url(self) -> str:
        """The endpoint an SDK is given (``http://127.0.0.1:4566``)."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Serve on the port (0: any free one); :class:`KmsLaunchError` if it cannot."""
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            raise KmsLaunchError(MISSING) from None
        if self.port:
            with socket.socket() as probe:
                if probe.connect_ex((HOST, self.port)) == 0:
                    raise KmsLaunchError(f"port {self.port} on {HOST} is taken: stop what "
                                         "serves it or choose another with --kms-port")
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request else
        self._server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]

    def create_key(self, alias: str) -> str:
        """A new symmetric KEK under ``alias`` (``alias/...``); its ARN."""
        if not alias.startswith("alias/"):
            raise KmsLaunchError(f"--kms-key {alias!r}: an alias starts with alias/ "
                                 "(alias/KEK_orders)")
        try:
            import boto3
        except ImportError:
            raise KmsLaunchError(MISSING) from None
        client = boto3.client("kms", endpoint_url=self.url, region_name=self.region,
                              aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        meta = client.create_key(Description=f"kiproxy dev KEK {alias}")["KeyMetadata"]
        client.create_alias(AliasName=alias, TargetKeyId=meta["KeyId"])
        return str(meta["Arn"])

    def stop(self) -> None:
        """Stop serving; the keys are gone."""
        if self._server is not None:
            self._server.stop()
            self._server = None


def export_credentials() -> dict[str, str]:
    """Put :data:`CREDENTIALS` in this process's environment where unset; what was set."""
    added = {name: value for name, value in CREDENTIALS.items() if name not in os.environ}
    os.environ.update(added)
    return added
