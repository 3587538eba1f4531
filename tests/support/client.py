"""A requesting client without a socket, for tests that call the router or the produce
pipeline directly: what :class:`kiproxy.proxy.net.client.RequestingClient` asks for."""

from __future__ import annotations

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.proxy.net.sasl import SaslRound, SaslTracker, identity_after_sasl

__all__ = ["Client"]


class Client:
    """What the router and the produce pipeline read of a client connection."""

    def __init__(self, principal: str | None = None, client_id: str = "unit") -> None:
        self.identity = ClientIdentity(client_host="127.0.0.1", client_port=9,
                                       client_id=client_id, principal=principal)
        self.sasl = SaslTracker()
        self.log_context: dict[str, object] = {"client_address": "127.0.0.1:9",
                                               "client_id": client_id}

    @property
    def principal(self) -> str | None:
        return self.identity.principal

    def sasl_answered(self, sasl_round: SaslRound | None, version: int, flexible: bool,
                      frame: bytes) -> bytes:
        self.identity = identity_after_sasl(self.identity, self.sasl, sasl_round, version,
                                            flexible, frame, self.log_context)
        return frame
