"""Learning the principal of a SASL-authenticated client from the traffic it sends.

The proxy forwards SASL exchanges unchanged (the broker authenticates); it
only reads the user name as it passes: from a PLAIN token
(``authzid NUL authcid NUL password``: the principal is the authorization id
when given, else the authentication id) or from a SCRAM client-first message
(``n,,n=user,r=nonce``). The name becomes the connection's principal once the
broker answers the SaslAuthenticate request with success. Other mechanisms
(GSSAPI, OAUTHBEARER) leave the principal unknown.
"""

from __future__ import annotations

from protocol.framing import parse_response_header
from protocol.messages import ApiKey, parse_request, parse_response

__all__ = ["SaslTracker", "user_from_token"]


def _scram_unescape(name: str) -> str:
    return name.replace("=2C", ",").replace("=3D", "=")


def user_from_token(mechanism: str | None, token: bytes) -> str | None:
    """The user a SASL client token names, for PLAIN and SCRAM; else ``None``."""
    mech = (mechanism or "").upper()
    if mech == "PLAIN":
        parts = token.split(b"\x00")
        if len(parts) != 3:
            return None
        authzid, authcid = parts[0], parts[1]
        name = authzid or authcid
        return name.decode("utf-8", "replace") or None
    if mech.startswith("SCRAM-"):
        text = token.decode("utf-8", "replace")
        # gs2-header "n,," or "n,a=authzid," then "n=user,r=nonce"
        fields = text.split(",")
        for field in fields[2:]:
            if field.startswith("n="):
                return _scram_unescape(field[2:]) or None
        return None
    return None


class SaslTracker:
    """Per-connection state of a SASL exchange."""

    __slots__ = ("candidate", "mechanism")

    def __init__(self) -> None:
        self.mechanism: str | None = None
        self.candidate: str | None = None

    def on_handshake(self, api_version: int, frame: bytes, body_offset: int) -> None:
        """Remember the mechanism a SaslHandshake request names."""
        try:
            request = parse_request(ApiKey.SASL_HANDSHAKE, api_version, frame, body_offset)
        except Exception:
            return
        self.mechanism = request.mechanism

    def on_authenticate(self, api_version: int, frame: bytes, body_offset: int) -> None:
        """Read the user name out of a SaslAuthenticate request, if the mechanism tells it."""
        try:
            request = parse_request(ApiKey.SASL_AUTHENTICATE, api_version, frame, body_offset)
        except Exception:
            return
        user = user_from_token(self.mechanism, bytes(request.auth_bytes))
        if user is not None:
            self.candidate = user

    def authenticated(self, api_version: int, flexible: bool, frame: bytes) -> str | None:
        """The principal, if this SaslAuthenticate response reports success."""
        if self.candidate is None:
            return None
        try:
            _, body_offset = parse_response_header(frame, 1 if flexible else 0)
            response = parse_response(ApiKey.SASL_AUTHENTICATE, api_version, frame, body_offset)
        except Exception:
            return None
        if int(response.error_code) != 0:
            self.candidate = None
            return None
        return self.candidate
