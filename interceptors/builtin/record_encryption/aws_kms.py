"""``AwsKmsProvider``: KEKs and data keys from the AWS KMS API, through boto3.

Contract. ``resolve_key`` is ``DescribeKey`` (an alias, key id or ARN; the answer's ARN
is the id, and a key that is not an enabled symmetric encryption key is
:class:`~.kms.UnresolvedKey`), ``generate_data_key`` is ``GenerateDataKey``
(``AES_256``) and ``decrypt_data_key`` is ``Decrypt`` naming the KEK (so a wrapped key
is only unwrapped by the key the envelope names). Anything that speaks the API
answers: AWS itself, LocalStack, moto's server (``endpoint``).

Credentials, region and CA bundle are found as every AWS SDK finds them
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``
and ``~/.aws/config``, ``AWS_DEFAULT_REGION``, ``AWS_CA_BUNDLE``, container and instance
roles); the settings below override them.

Bounds. Each call has a connect and a read timeout and at most ``max_attempts``
attempts (botocore's ``standard`` retry mode, set explicitly, so SDK defaults never
multiply a stall), and the whole call - queueing for a thread included - is cut
off after :attr:`AwsKmsSettings.call_timeout_s`. boto3 is blocking, so calls run in a
thread pool of ``max_calls_in_flight`` threads (the same number of HTTP
connections): a KMS that stalls holds at most that many threads, never the event
loop. What is sent is bounded (a wrapped key over 6 KiB, KMS's own limit, is refused
before any call) and what is accepted is checked (a data key is 32 bytes, a wrapped
key at most 6 KiB); an answer of any other shape is :class:`~.kms.KmsUnavailable`.
botocore reads an answer whole before kiproxy sees it, so the size of an answer is
bounded only by the read timeout: point ``endpoint`` only at a KMS you trust.

An alias is checked before it is sent: AWS KMS accepts an alias name only if it is
``alias/`` then at most 250 characters of ``^[a-zA-Z0-9:/_-]+$`` (so a Kafka topic's
``.`` cannot appear in one); any other is :class:`~.kms.InvalidKeyReference`, naming the
character and the rule (:meth:`AwsKmsProvider.reference_problem`, also used at load).

Errors: ``NotFoundException``, ``DisabledException``, ``KMSInvalidStateException``
and ``InvalidKeyUsageException`` are :class:`~.kms.UnresolvedKey` when encrypting
and :class:`~.kms.Undecryptable` when decrypting, as are ``InvalidCiphertextException``
and ``IncorrectKeyException``; throttling, KMS-internal and 5xx answers, timeouts,
refused or broken connections, a credential source that cannot be reached and
malformed answers are :class:`~.kms.KmsUnavailable` (retriable); refused credentials,
a missing or malformed region, any other setting the SDK refuses and a certificate the
CA bundle does not trust are a plain :class:`~.kms.KmsError` naming what to set.

Why boto3 in threads rather than aiobotocore: aiobotocore pins botocore to a narrow
range (an installation with boto3 elsewhere breaks), and KMS is called once per data
key rotation or cache miss, so a thread per call costs nothing that matters.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import boto3
import botocore.config
import botocore.exceptions
import botocore.parsers
import botocore.utils
import pydantic
from pydantic import Field, field_validator

from kiproxy.interceptors.builtin._daemon_threads import DaemonThreads
from kiproxy.interceptors.settings import PluginSettings

from .kms import (
    DATA_KEY_BYTES,
    DataKey,
    InvalidKeyReference,
    KmsError,
    KmsProvider,
    KmsUnavailable,
    Undecryptable,
    UnresolvedKey,
)

log = logging.getLogger(__name__)

__all__ = ["AwsKmsProvider", "AwsKmsSettings", "alias_problem", "alias_safe"]

_SETUP_HINTS = {
    "NoRegionError": "set kms.region of record_encryption (or AWS_REGION, or a "
                     "profile's region)",
    "NoCredentialsError": "give credentials as AWS SDKs read them: AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, kms.profile (or AWS_PROFILE) naming a "
                          "profile that has them, or a role of the instance or container",
    "ProfileNotFound": "kms.profile (or AWS_PROFILE) names a profile that is in neither "
                       "~/.aws/config nor ~/.aws/credentials (AWS_CONFIG_FILE, "
                       "AWS_SHARED_CREDENTIALS_FILE)",
}
"""What to set when the AWS SDK finds no region, no credentials or no such profile."""

MAX_WRAPPED_BYTES = 6144
"""KMS's own bound on a ciphertext blob."""

ALIAS_RULE = "^[a-zA-Z0-9:/_-]+$"
"""AWS KMS's rule for an alias name (``AliasName`` in its API reference)."""
_MAX_ALIAS = 256
_NOT_IN_ALIAS = re.compile(r"[^a-zA-Z0-9:/_-]")


def alias_safe(name: str) -> str:
    """``name`` with each character an AWS alias name cannot hold replaced by ``_``
    (for a Kafka topic name, each ``.``)."""
    return _NOT_IN_ALIAS.sub("_", name)


def alias_problem(reference: str) -> str | None:
    """Why ``reference``, if it is an alias (``alias/...`` or an alias ARN), is not a
    name AWS KMS accepts; None if it is, or if it is not an alias."""
    alias = reference
    if reference.startswith("arn:") and ":alias/" in reference:
        alias = "alias/" + reference.split(":alias/", 1)[1]
    elif not reference.startswith("alias/"):
        return None
    bad = _NOT_IN_ALIAS.search(alias)
    if bad is None and 6 < len(alias) <= _MAX_ALIAS:
        return None
    if bad is None:
        return (f"{reference!r} is not a valid AWS KMS alias name: it is {len(alias)} "
                f"characters long, AWS allows 7 to {_MAX_ALIAS}")
    what_to_do = "name the key by a valid alias, its key id or its ARN"
    if bad.group() == ".":  # a Kafka topic's name may hold '.', never another of these
        what_to_do = ("for a topic name with '.', write ${topic_alias} in record_encryption's "
                      "key template instead of ${topic} (the topic's name with each '.' as "
                      "'_'), or give the topic a key id or ARN in `topics:`")
    return (f"{reference!r} is not a valid AWS KMS alias name: {bad.group()!r} is not "
            f"allowed (an alias name is alias/ followed by letters, digits, '/', '_', '-' "
            f"and ':' only: {ALIAS_RULE}); {what_to_do}")


_KEY_PROBLEMS = frozenset({"NotFoundException", "DisabledException",
                           "KMSInvalidStateException", "InvalidKeyUsageException",
                           "InvalidArnException"})
_CIPHERTEXT_PROBLEMS = _KEY_PROBLEMS | {"InvalidCiphertextException",
                                        "IncorrectKeyException"}
_UNAVAILABLE = frozenset({"ThrottlingException", "LimitExceededException",
                          "KMSInternalException", "DependencyTimeoutException",
                          "KeyUnavailableException", "ServiceUnavailableException",
                          "InternalFailure", "RequestTimeout"})
_REFUSED_CREDENTIALS = frozenset({"AccessDeniedException", "UnrecognizedClientException",
                                  "InvalidSignatureException", "ExpiredTokenException",
                                  "IncompleteSignature", "InvalidClientTokenId"})


class AwsKmsSettings(PluginSettings):
    """Where the AWS KMS API is and how long a call may take (unset: as the SDK finds it)."""

    region: str | None = None
    """The region (default: as the SDK finds it, ``AWS_DEFAULT_REGION`` or the profile's)."""
    endpoint: str | None = None
    """Another endpoint than the region's, an http(s) URL: LocalStack, a VPC endpoint,
    moto (``http://127.0.0.1:4566``)."""
    profile: str | None = None
    """A profile of ``~/.aws/config`` (default: ``AWS_PROFILE`` or ``default``)."""
    ca_bundle: str | None = None
    """Trust these CAs (default: ``AWS_CA_BUNDLE``, the profile's, or certifi's)."""
    verify_tls: bool = True
    """False turns certificate checks off (never in production)."""
    connect_timeout_ms: Annotated[int, Field(gt=0)] = 2000
    """Connect timeout of one attempt."""
    read_timeout_ms: Annotated[int, Field(gt=0)] = 5000
    """Read timeout of one attempt."""
    max_attempts: Annotated[int, Field(ge=1, le=5)] = 2
    """Attempts per call, the first included (botocore's ``standard`` retries)."""
    max_calls_in_flight: Annotated[int, Field(ge=1, le=64)] = 4
    """Threads (and HTTP connections) for KMS calls; more calls wait for one."""

    @field_validator("region")
    @classmethod
    def _region_has_the_form(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                botocore.utils.validate_region_name(value)
            except botocore.exceptions.InvalidRegionError:
                raise ValueError(f"{value!r} is not a region name (letters, digits and "
                                 "dashes, such as eu-west-1)") from None
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_a_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            url = urllib.parse.urlsplit(value)
            url.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a URL ({exc}); write an http(s) URL, "
                             "e.g. http://127.0.0.1:4566") from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL; write the scheme and the "
                             "host, e.g. http://127.0.0.1:4566 or "
                             "https://kms.eu-west-1.amazonaws.com")
        return value

    @field_validator("ca_bundle")
    @classmethod
    def _ca_bundle_exists(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"no file at {value!r}")
        return value

    @classmethod
    def from_config(cls, raw: Mapping[str, object]) -> AwsKmsSettings:
        """Parse the ``kms:`` mapping of an AWS KMS alone; errors name the key
        (``kms.region``)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"kms: expected a mapping, got {type(raw).__name__}")
        try:
            return cls.model_validate(dict(raw))
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            message = str(err["msg"]).removeprefix("Value error, ")
            raise ValueError(f"kms.{'.'.join(str(p) for p in err['loc'])}: "
                             f"{message}") from None

    @property
    def call_timeout_s(self) -> float:
        """The bound on one call: every attempt's connect and read timeouts, and a
        second per attempt for queueing and retry back-off."""
        return self.max_attempts * ((self.connect_timeout_ms + self.read_timeout_ms) / 1000
                                    + 1.0)


class AwsKmsProvider(KmsProvider):
    """The AWS KMS API as a :class:`~.kms.KmsProvider` (see the module docstring)."""

    def __init__(self, settings: AwsKmsSettings) -> None:
        self.settings = settings
        # Daemon threads: a call hung on a KMS that stopped answering must not hold a
        # stopping proxy's process open until its socket times out.
        self._pool = DaemonThreads(settings.max_calls_in_flight, f"kiproxy-kms-{id(self):x}")
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._where = settings.endpoint or f"AWS KMS ({settings.region or 'SDK region'})"

    def reference_problem(self, reference: str) -> str | None:
        """An alias that AWS KMS would refuse as a name (see :func:`alias_problem`)."""
        return alias_problem(reference)

    def form_problem(self, reference: str) -> str | None:
        """What a key template makes for a topic (``reference``) must be an alias, or an
        alias ARN, that AWS KMS accepts as a name: a key id or a key's ARN names one
        key whatever the topic."""
        if not reference.startswith("alias/") and not (
                reference.startswith("arn:") and ":alias/" in reference):
            return (f"{reference!r} is neither an alias (alias/...) nor an alias ARN; a key "
                    "template names each topic's key by its alias, such as "
                    "alias/KEK_${topic}")
        return alias_problem(reference)

    async def resolve_key(self, reference: str) -> str:
        problem = alias_problem(reference)
        if problem is not None:
            raise InvalidKeyReference(problem)
        answer = await self._call("DescribeKey", reference, UnresolvedKey, KeyId=reference)
        meta = answer.get("KeyMetadata")
        if not isinstance(meta, Mapping) or not isinstance(meta.get("Arn"), str):
            raise KmsUnavailable(f"{self._where} answered DescribeKey {reference!r} with no "
                                 "KeyMetadata.Arn: not an answer of AWS KMS (is kms.endpoint "
                                 "a KMS?)")
        state, usage = meta.get("KeyState"), meta.get("KeyUsage")
        if state != "Enabled" or usage not in (None, "ENCRYPT_DECRYPT"):
            what = f"{state}, for {usage}" if usage is not None else str(state)
            raise UnresolvedKey(f"KMS key {reference!r} ({meta['Arn']}) cannot wrap data "
                                f"keys: it is {what}; enable it or name an enabled "
                                "symmetric key")
        return str(meta["Arn"])

    async def generate_data_key(self, key_id: str) -> DataKey:
        answer = await self._call("GenerateDataKey", key_id, UnresolvedKey,
                                  KeyId=key_id, KeySpec="AES_256")
        plaintext, wrapped = answer.get("Plaintext"), answer.get("CiphertextBlob")
        if (not isinstance(plaintext, bytes) or len(plaintext) != DATA_KEY_BYTES
                or not isinstance(wrapped, bytes) or not 0 < len(wrapped) <= MAX_WRAPPED_BYTES):
            raise KmsUnavailable(f"{self._where} answered GenerateDataKey for {key_id!r} "
                                 f"with {_sized(plaintext)} Plaintext and {_sized(wrapped)} "
                                 f"CiphertextBlob (AWS KMS gives {DATA_KEY_BYTES} bytes and "
                                 f"1..{MAX_WRAPPED_BYTES} bytes)")
        return DataKey(key_id=key_id, plaintext=plaintext, wrapped=wrapped)

    async def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        if not 0 < len(wrapped) <= MAX_WRAPPED_BYTES:
            raise Undecryptable(f"a data key wrapped under {key_id!r} is {len(wrapped)} "
                                f"bytes; KMS wraps keys in 1..{MAX_WRAPPED_BYTES}")
        answer = await self._call("Decrypt", key_id, Undecryptable,
                                  KeyId=key_id, CiphertextBlob=wrapped)
        plaintext = answer.get("Plaintext")
        if not isinstance(plaintext, bytes) or len(plaintext) != DATA_KEY_BYTES:
            raise KmsUnavailable(f"{self._where} answered Decrypt under {key_id!r} "
                                 "without a 32-byte key")
        return plaintext

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._client_lock:
            if self._client is not None:
                self._client.close()

    # -- the blocking part, in the pool ------------------------------------------------

    async def _call(self, operation: str, key: str, key_error: type[KmsError],
                    **params: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if self._client is None:  # local work (botocore's service data), not timed
            await loop.run_in_executor(self._pool, functools.partial(
                self._invoke, "", key, key_error, {}))
        call = functools.partial(self._invoke, operation, key, key_error, params)
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, call),
                                          self.settings.call_timeout_s)
        except TimeoutError:
            raise KmsUnavailable(f"{self._where} did not answer {operation} for {key!r} "
                                 f"within {self.settings.call_timeout_s:g}s") from None

    def _kms(self) -> Any:
        with self._client_lock:
            if self._client is None:
                s = self.settings
                session = boto3.session.Session(profile_name=s.profile, region_name=s.region)
                verify: bool | str | None = s.ca_bundle or (None if s.verify_tls else False)
                self._client = session.client(
                    "kms", endpoint_url=s.endpoint, verify=verify,
                    config=botocore.config.Config(
                        connect_timeout=s.connect_timeout_ms / 1000,
                        read_timeout=s.read_timeout_ms / 1000,
                        retries={"total_max_attempts": s.max_attempts, "mode": "standard"},
                        max_pool_connections=s.max_calls_in_flight,
                        user_agent_extra="kiproxy-record-encryption"))
            return self._client

    def _invoke(self, operation: str, key: str, key_error: type[KmsError],
                params: dict[str, Any]) -> dict[str, Any]:
        what = f"{operation or 'Setting up the client'} for KMS key {key!r} at {self._where}"
        try:
            client = self._kms()
            if not operation:  # only the client was asked for
                return {}
            method = getattr(client, botocore.xform_name(operation))
            try:
                answer: dict[str, Any] = method(**params)
            except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
                raise  # said below
            except (ValueError, TypeError, AttributeError, KeyError,
                    botocore.parsers.ResponseParserError) as exc:
                # The SDK could not read what the endpoint answered (bad base64, a list
                # where a structure goes): its parser raises these, none of its own.
                log.debug("%s: the SDK could not read the answer", what, exc_info=exc)
                raise KmsUnavailable(f"{what}: the answer is not one of AWS KMS "
                                     f"({type(exc).__name__}: {exc}); is kms.endpoint a KMS?"
                                     ) from None
            return answer
        except botocore.exceptions.ClientError as exc:
            raise _client_error(exc, what, key_error) from None
        except (botocore.exceptions.NoRegionError,
                botocore.exceptions.NoCredentialsError,
                botocore.exceptions.ProfileNotFound) as exc:
            raise KmsError(f"{what}: {exc}; {_SETUP_HINTS[type(exc).__name__]}") from None
        except botocore.exceptions.SSLError as exc:
            raise KmsError(f"{what}: the TLS handshake failed ({exc}); set kms.ca_bundle "
                           "(or AWS_CA_BUNDLE) to the CA that signed the endpoint's "
                           "certificate") from None
        except _TRANSIENT as exc:  # timeouts, refused or broken connections, cut answers
            raise KmsUnavailable(f"{what}: {type(exc).__name__}: {exc}") from None
        except botocore.exceptions.BotoCoreError as exc:  # the settings: a bad region, ...
            raise KmsError(f"{what}: {type(exc).__name__}: {exc}; the SDK refused the "
                           "settings of kms (or the AWS_* variables): fix them") from None


def _sized(value: object) -> str:
    """``a 40-byte`` value, or what it is instead (``no``: missing)."""
    if value is None:
        return "no"
    return f"a {len(value)}-byte" if isinstance(value, bytes) else f"a {type(value).__name__}"


_TRANSIENT = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
              botocore.exceptions.IncompleteReadError,
              botocore.exceptions.CredentialRetrievalError,
              botocore.exceptions.MetadataRetrievalError)
"""What botocore raises for a KMS (or a credential source) it could not reach or
that did not answer whole: :class:`~.kms.KmsUnavailable`. Any other of its errors
says the settings are wrong (a malformed region, an endpoint it cannot resolve,
partial credentials): a plain :class:`~.kms.KmsError`, never retried into storing
plaintext (``on_kms_unavailable: pass`` applies to the first kind only)."""


def _client_error(exc: botocore.exceptions.ClientError, what: str,
                  key_error: type[KmsError]) -> KmsError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    message = f"{what}: {code or status}: {error.get('Message', '')}".rstrip(": ")
    if code in _UNAVAILABLE or status >= 500 or status == 429:
        return KmsUnavailable(message)
    if code in _CIPHERTEXT_PROBLEMS and key_error is Undecryptable:
        return Undecryptable(message)
    if code in _KEY_PROBLEMS:
        return key_error(message)
    if code in _REFUSED_CREDENTIALS:
        return KmsError(f"{message}; the credentials are refused or lack kms:{what.split()[0]}")
    return KmsError(message)
