"""How replay and report connect to a secured cluster: client settings as Kafka's tools take them.

Contract: ``--command-config FILE`` (a Java ``client.properties``) and
``--consumer-property KEY=VALUE`` (repeatable, applied after the file) are read
on the driver into one :class:`ClientSecurity` value, which the raw Fetch
client (:mod:`pipelines.broker_connection`), the confluent-kafka consumer, the
backfill producer and the admin client all use. Every file it names is read on
the driver and carried as PEM text, so executors on other machines need none of
those files. Executors receive the value through a Spark broadcast (never Spark
conf or command-line arguments); its ``repr`` hides the secrets, and no error
message here ever quotes a value that may hold one.

Understood keys (anything else is an error naming the key): see
:data:`UNDERSTOOD_KEYS` and docs/replay-security.md. Supported: PLAINTEXT, SSL
(with a client certificate: mTLS), SASL_PLAINTEXT and SASL_SSL with PLAIN,
SCRAM-SHA-256 and SCRAM-SHA-512. Stores: PEM files, and PKCS12 (read with
``cryptography``); JKS cannot be read by Python, and the error says how to
convert it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import ssl
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiproxy.pipelines.errors import PipelineError

__all__ = [
    "PLAINTEXT",
    "PROTOCOLS",
    "SASL_MECHANISMS",
    "UNDERSTOOD_KEYS",
    "ClientSecurity",
    "load_client_security",
    "parse_properties",
]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
STORE_TYPES = ("PEM", "PKCS12", "JKS")

UNDERSTOOD_KEYS: dict[str, str] = {
    "security.protocol": "PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL",
    "ssl.truststore.location": "CA certificates to trust: a PEM or PKCS12 file",
    "ssl.truststore.type": "PEM, PKCS12 or JKS (JKS is refused with how to convert it)",
    "ssl.truststore.password": "password of a PKCS12 truststore",
    "ssl.truststore.certificates": "CA certificates as PEM text (instead of a file)",
    "ssl.ca.location": "CA certificates to trust: a PEM file (librdkafka's name)",
    "ssl.keystore.location": "client certificate and key: a PEM or PKCS12 file",
    "ssl.keystore.type": "PEM, PKCS12 or JKS (JKS is refused with how to convert it)",
    "ssl.keystore.password": "password of a PKCS12 keystore",
    "ssl.keystore.certificate.chain": "client certificate chain as PEM text",
    "ssl.keystore.key": "client private key as PEM text",
    "ssl.key.password": "password of an encrypted private key",
    "ssl.certificate.location": "client certificate: a PEM file (librdkafka's name)",
    "ssl.key.location": "client private key: a PEM file (librdkafka's name)",
    "ssl.endpoint.identification.algorithm": "https (default: check the broker's host name) "
                                             "or empty/none (do not)",
    "sasl.mechanism": "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
    "sasl.username": "SASL user (librdkafka's name)",
    "sasl.password": "SASL password (librdkafka's name)",
    "sasl.jaas.config": "PlainLoginModule or ScramLoginModule required username=\"...\" "
                        "password=\"...\";",
}
"""Every key ``--command-config`` and ``--consumer-property`` understand, with what it takes."""

_LOGIN_MODULES = {
    "org.apache.kafka.common.security.plain.PlainLoginModule": ("PLAIN",),
    "org.apache.kafka.common.security.scram.ScramLoginModule": ("SCRAM-SHA-256",
                                                                "SCRAM-SHA-512"),
}
_UNSUPPORTED = {
    "GSSAPI": "Kerberos (GSSAPI) is not supported by kiproxy replay",
    "OAUTHBEARER": "OAUTHBEARER is not supported by kiproxy replay yet (see "
                   "docs/replay-security.md for what it needs)",
}
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----\s*", re.S)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSecurity:
    """The resolved connection settings of one cluster (picklable; secrets kept out of repr)."""

    protocol: str = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``."""
    ca_pem: str | None = None
    """CA certificates to trust (PEM); None: the system's trust store."""
    certificate_pem: str | None = None
    """The client certificate chain for mTLS (PEM), or None."""
    key_pem: str | None = field(default=None, repr=False)
    """The client private key (PEM), or None."""
    key_password: str | None = field(default=None, repr=False)
    """Password of an encrypted ``key_pem``."""
    check_hostname: bool = True
    """Whether the broker's certificate must name the host connected to."""
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        """Whether connections speak TLS."""
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        """Whether connections authenticate with SASL."""
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    def secrets(self) -> list[str]:
        """The secret values this holds (for checks that none of them leaked)."""
        return [s for s in (self.sasl_password, self.key_password, self.key_pem) if s]

    def describe(self) -> str:
        """A one-line description with no secret in it, for reports and logs."""
        parts = [self.protocol]
        if self.tls:
            parts.append("client certificate" if self.certificate_pem else
                         "no client certificate")
            if not self.check_hostname:
                parts.append("host name not checked")
        if self.sasl:
            parts.append(f"{self.sasl_mechanism} as {self.sasl_username}")
        return ", ".join(parts)

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context: the configured CAs (or the system's), the client certificate."""
        ctx = ssl.create_default_context(cadata=self.ca_pem) if self.ca_pem \
            else ssl.create_default_context()
        ctx.check_hostname = self.check_hostname
        if self.certificate_pem and self.key_pem:
            # The ssl module loads a certificate chain from files only: a private
            # directory that lives just as long as the loading.
            with _private_files(self.certificate_pem, self.key_pem) as (cert, key):
                ctx.load_cert_chain(cert, key, password=self.key_password)
        return ctx

    def librdkafka(self) -> dict[str, str]:
        """The same settings as confluent-kafka (librdkafka) configuration."""
        conf = {"security.protocol": self.protocol.lower()}
        if self.tls:
            conf["ssl.endpoint.identification.algorithm"] = \
                "https" if self.check_hostname else "none"
            if self.ca_pem:
                conf["ssl.ca.pem"] = self.ca_pem
            if self.certificate_pem and self.key_pem:
                conf["ssl.certificate.pem"] = self.certificate_pem
                conf["ssl.key.pem"] = self.key_pem
                if self.key_password:
                    conf["ssl.key.password"] = self.key_password
        if self.sasl:
            assert self.sasl_mechanism and self.sasl_username is not None
            conf.update({"sasl.mechanism": self.sasl_mechanism,
                         "sasl.username": self.sasl_username,
                         "sasl.password": self.sasl_password or ""})
        return conf

    def spark_kafka_options(self) -> dict[str, str]:
        """Options for Spark's Kafka data source, which can only take settings without secrets.

        Its options become part of the query plan (Spark UI, event log), so a
        client key or a SASL password never goes there: such settings are refused.
        """
        if self.sasl or self.certificate_pem:
            raise PipelineError(
                "--reader spark-kafka cannot use SASL or a client certificate: Spark's Kafka "
                "source takes them only as DataFrame options, which appear in the query plan "
                "(Spark UI, event log). Use --reader fetch or --reader consumer")
        if not self.tls:
            return {}
        options = {"kafka.security.protocol": "SSL",
                   "kafka.ssl.endpoint.identification.algorithm":
                       "https" if self.check_hostname else ""}
        if self.ca_pem:
            options |= {"kafka.ssl.truststore.type": "PEM",
                        "kafka.ssl.truststore.certificates": self.ca_pem}
        return options


PLAINTEXT = ClientSecurity()
"""No TLS, no SASL."""


@contextlib.contextmanager
def _private_files(*contents: str) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory(prefix="kiproxy-tls-") as directory:
        paths = []
        for i, text in enumerate(contents):
            path = os.path.join(directory, f"{i}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(text)
            paths.append(path)
        yield paths


# ---------------------------------------------------------------------------- parsing


def parse_properties(command_config: str | Path | None,
                     consumer_properties: Sequence[str] = ()) -> dict[str, str]:
    """The file's properties, then each ``KEY=VALUE`` over them; unknown keys are errors."""
    props: dict[str, str] = {}
    if command_config is not None:
        path = Path(command_config)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PipelineError(f"--command-config {path}: cannot read it: "
                                f"{exc.strerror or exc}") from None
        try:
            import javaproperties
        except ImportError:
            raise PipelineError("--command-config needs the javaproperties package: pip "
                                "install '.[pipelines]' (from a kiproxy checkout)") from None
        try:
            loaded = javaproperties.loads(text)
        except Exception as exc:
            raise PipelineError(f"--command-config {path} is not a Java properties file "
                                f"({type(exc).__name__})") from None
        for key, value in loaded.items():
            _check_key(key, f"--command-config {path}")
            props[key] = value
    for item in consumer_properties:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:  # never echoed: it may hold a password
            raise PipelineError("--consumer-property: expected KEY=VALUE, got "
                                + ("an empty key" if sep else "no '='"))
        _check_key(key, "--consumer-property")
        props[key] = value
    return props


def _check_key(key: str, where: str) -> None:
    if key in UNDERSTOOD_KEYS:
        return
    hint = ("a Kerberos setting: GSSAPI is not supported" if "kerberos" in key else
            "an OAuth setting: OAUTHBEARER is not supported yet" if "oauth" in key or
            "login.callback" in key else "not understood by kiproxy")
    raise PipelineError(f"{where}: {key} is {hint}; the understood keys are "
                        f"{', '.join(UNDERSTOOD_KEYS)} (docs/replay-security.md)")


def _jaas(value: str) -> tuple[str, dict[str, str]]:
    """``(login module, options)`` of a ``sasl.jaas.config`` value (never echoed: secret)."""
    try:
        words = shlex.split(value.strip().rstrip(";").strip(), posix=True)
    except ValueError:
        raise PipelineError("sasl.jaas.config does not parse (unbalanced quotes?); expected "
                            '<LoginModule> required username="..." password="...";') from None
    if len(words) < 2 or words[1] not in ("required", "requisite", "sufficient", "optional"):
        raise PipelineError("sasl.jaas.config does not parse; expected <LoginModule> required "
                            'username="..." password="...";')
    options = {}
    for word in words[2:]:
        name, sep, val = word.partition("=")
        if not sep:
            raise PipelineError(f"sasl.jaas.config: option {name!r} has no value")
        options[name] = val
    return words[0], options


def _read_file(key: str, location: str) -> bytes:
    try:
        return Path(location).expanduser().read_bytes()
    except OSError as exc:
        raise PipelineError(f"{key} {location}: cannot read it: {exc.strerror or exc}") from None


def _store_format(key: str, location: str, data: bytes, declared: str | None) -> str:
    if declared is not None and declared.upper() not in STORE_TYPES:
        raise PipelineError(f"{key.replace('location', 'type')} {declared}: use one of "
                            f"{', '.join(STORE_TYPES)}")
    if b"-----BEGIN " in data[:4096]:
        return "PEM"
    if data[:4] == b"\xfe\xed\xfe\xed" or (declared or "").upper() == "JKS":
        store = "truststore" if "truststore" in key else "keystore"
        raise PipelineError(
            f"{key} {location} is a JKS store, which Python cannot read. Convert it to "
            f"PKCS12 with `keytool -importkeystore -srckeystore {location} -srcstoretype JKS "
            f"-destkeystore {store}.p12 -deststoretype PKCS12` and point {key} at the .p12 "
            f"(with ssl.{store}.type=PKCS12), or export PEM files and use "
            + ("ssl.ca.location" if store == "truststore" else
               "ssl.certificate.location and ssl.key.location"))
    return "PKCS12"


def _pem_blocks(data: bytes, kind: str) -> list[bytes]:
    return [m.group(0).strip() + b"\n" for m in _PEM_BLOCK.finditer(data)
            if (b"PRIVATE KEY" in m.group(1)) == (kind == "key")]


def _pkcs12(key: str, location: str, data: bytes, password: str | None
            ) -> tuple[bytes | None, list[bytes]]:
    """``(private key PEM, certificate PEMs)`` of a PKCS12 store."""
    try:
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
            pkcs12,
        )
    except ImportError:
        raise PipelineError(f"{key} {location}: reading PKCS12 needs the cryptography package "
                            "(pip install cryptography), or use PEM files") from None
    try:
        store = pkcs12.load_pkcs12(data, password.encode() if password else None)
    except (ValueError, TypeError):
        raise PipelineError(f"{key} {location}: cannot open it as PKCS12 (wrong "
                            f"{key.replace('location', 'password')}, or not a PKCS12 "
                            "file)") from None
    certs = [c.certificate for c in ([store.cert] if store.cert else [])
             + list(store.additional_certs)]
    pems = [c.public_bytes(Encoding.PEM) for c in certs]
    private = None if store.key is None else store.key.private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    return private, pems


def _truststore(props: Mapping[str, str]) -> str | None:
    given = [k for k in ("ssl.truststore.location", "ssl.ca.location",
                         "ssl.truststore.certificates") if props.get(k)]
    if len(given) > 1:
        raise PipelineError(f"give one of {' and '.join(given)}, not both")
    if not given:
        return None
    key = given[0]
    if key == "ssl.truststore.certificates":
        pems = _pem_blocks(props[key].encode(), "cert")
        location = "(inline)"
    else:
        location = props[key]
        data = _read_file(key, location)
        fmt = _store_format(key, location, data, props.get("ssl.truststore.type")
                            if key == "ssl.truststore.location" else "PEM")
        pems = _pem_blocks(data, "cert") if fmt == "PEM" else \
            _pkcs12(key, location, data, props.get("ssl.truststore.password"))[1]
    if not pems:
        raise PipelineError(f"{key} {location} holds no certificate")
    return b"".join(pems).decode("ascii")


def _keystore(props: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    """``(certificate chain PEM, key PEM, key password)`` for mTLS, or Nones."""
    password = props.get("ssl.key.password") or None
    if props.get("ssl.keystore.location"):
        for other in ("ssl.certificate.location", "ssl.key.location", "ssl.keystore.key"):
            if props.get(other):
                raise PipelineError(f"give ssl.keystore.location or {other}, not both")
        key = "ssl.keystore.location"
        location = props[key]
        data = _read_file(key, location)
        fmt = _store_format(key, location, data, props.get("ssl.keystore.type"))
        if fmt == "PEM":
            keys, certs = _pem_blocks(data, "key"), _pem_blocks(data, "cert")
            private = keys[0] if keys else None
        else:
            private, certs = _pkcs12(key, location, data,
                                     props.get("ssl.keystore.password"))
            password = None  # the key comes out of PKCS12 unencrypted
        if private is None or not certs:
            raise PipelineError(f"{key} {location} must hold a private key and its "
                                "certificate")
        return b"".join(certs).decode("ascii"), private.decode("ascii"), password
    cert_text = props.get("ssl.keystore.certificate.chain") or (
        _read_file("ssl.certificate.location", props["ssl.certificate.location"]).decode()
        if props.get("ssl.certificate.location") else None)
    key_text = props.get("ssl.keystore.key") or (
        _read_file("ssl.key.location", props["ssl.key.location"]).decode()
        if props.get("ssl.key.location") else None)
    if (cert_text is None) != (key_text is None):
        raise PipelineError("a client certificate needs both ssl.certificate.location and "
                            "ssl.key.location (or ssl.keystore.certificate.chain and "
                            "ssl.keystore.key)")
    return cert_text, key_text, password


def _sasl(props: Mapping[str, str], protocol: str) -> tuple[str | None, str | None, str | None]:
    mechanism = props.get("sasl.mechanism", "").strip().upper() or None
    if protocol not in ("SASL_PLAINTEXT", "SASL_SSL"):
        stray = [k for k in ("sasl.mechanism", "sasl.username", "sasl.password",
                             "sasl.jaas.config") if props.get(k)]
        if stray:
            raise PipelineError(f"{stray[0]} is set but security.protocol is {protocol}; use "
                                "SASL_SSL (or SASL_PLAINTEXT) to authenticate with SASL")
        return None, None, None
    if mechanism in _UNSUPPORTED:
        raise PipelineError(f"sasl.mechanism {mechanism}: {_UNSUPPORTED[mechanism]}")
    if mechanism not in SASL_MECHANISMS:
        raise PipelineError(f"security.protocol {protocol} needs sasl.mechanism set to one of "
                            f"{', '.join(SASL_MECHANISMS)}"
                            + (f", not {mechanism}" if mechanism else ""))
    username, password = props.get("sasl.username"), props.get("sasl.password")
    if props.get("sasl.jaas.config"):
        if username is not None or password is not None:
            raise PipelineError("give sasl.jaas.config or sasl.username/sasl.password, not both")
        module, options = _jaas(props["sasl.jaas.config"])
        if "OAuthBearer" in module:
            raise PipelineError(f"sasl.jaas.config: {_UNSUPPORTED['OAUTHBEARER']}")
        if module not in _LOGIN_MODULES:
            raise PipelineError(f"sasl.jaas.config: login module {module} is not supported; "
                                f"use {' or '.join(_LOGIN_MODULES)}")
        if mechanism not in _LOGIN_MODULES[module]:
            raise PipelineError(f"sasl.jaas.config: {module.rsplit('.', 1)[1]} does not do "
                                f"sasl.mechanism {mechanism}")
        username, password = options.get("username"), options.get("password")
    if not username or password is None:
        raise PipelineError(f"sasl.mechanism {mechanism} needs a user name and password: "
                            "sasl.username and sasl.password, or sasl.jaas.config")
    return mechanism, username, password


def load_client_security(command_config: str | Path | None = None,
                         consumer_properties: Sequence[str] = ()) -> ClientSecurity:
    """Read ``--command-config`` and ``--consumer-property`` into a :class:`ClientSecurity`
    (every named file is read now, on the driver)."""
    props = parse_properties(command_config, consumer_properties)
    protocol = props.get("security.protocol", "PLAINTEXT").strip().upper()
    if protocol not in PROTOCOLS:
        raise PipelineError(f"security.protocol {protocol}: use one of {', '.join(PROTOCOLS)}")
    if protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
        stray = [k for k in props if k.startswith("ssl.") and props[k]]
        if stray:
            raise PipelineError(f"{stray[0]} is set but security.protocol is {protocol}; use "
                                f"{'SSL' if protocol == 'PLAINTEXT' else 'SASL_SSL'} to "
                                "connect with TLS")
    mechanism, username, password = _sasl(props, protocol)
    ca = certificate = key = key_password = None
    check_hostname = True
    if protocol in ("SSL", "SASL_SSL"):
        ca = _truststore(props)
        certificate, key, key_password = _keystore(props)
        algorithm = props.get("ssl.endpoint.identification.algorithm", "https").strip().lower()
        if algorithm not in ("https", "", "none"):
            raise PipelineError(f"ssl.endpoint.identification.algorithm {algorithm}: use "
                                "https, or an empty value to not check host names")
        check_hostname = algorithm == "https"
    security = ClientSecurity(
        protocol=protocol, ca_pem=ca, certificate_pem=certificate, key_pem=key,
        key_password=key_password, check_hostname=check_hostname,
        sasl_mechanism=mechanism, sasl_username=username, sasl_password=password)
    if security.tls:
        try:
            security.ssl_context()
        except ssl.SSLError as exc:
            raise PipelineError(f"the TLS settings do not load: {exc.reason or exc} (check "
                                "the certificates, the key and ssl.key.password)") from None
    return security
