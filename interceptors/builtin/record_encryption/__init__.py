"""Envelope encryption of record values: the ``record_encryption`` built-in
(:class:`RecordEncryption`, on both the produce and the fetch-side hook) and the library
under it.

What it owns, in the order data flows:

* :mod:`.settings` - the built-in's settings model and each topic's plan (its KEK
  reference, its policies); :mod:`.interceptor` - the two hooks and their policies.

* :mod:`.kms` - the :class:`KmsProvider` interface (resolve a KEK reference, generate a
  data key, unwrap one) and its typed errors; :mod:`.aws_kms` (the AWS KMS API through
  boto3; imported on its own, as it loads boto3) and :mod:`.key_file` (KEKs in a local
  file, for development) implement it.
* :mod:`.data_keys` - :class:`DataKeyCache`: the current data key per topic, rotated by
  use count and age; unwrapped keys cached with a bound and a lifetime; one KMS call in
  flight per key; failures remembered briefly.
* :mod:`.envelope` - the versioned, self-describing layout of a sealed record and the
  pure functions that seal and open one (AES-256-GCM from ``cryptography``).
* :mod:`.records` - :class:`RecordCipher`: a batch's records sealed or opened with the
  cache's keys; what the hooks call.

It may import the public plugin API (``kiproxy.interceptors``),
``cryptography``, ``boto3``/``botocore`` and ``pydantic``; never ``kiproxy.proxy``.
Everything it needs is in the ``encryption`` extra.
"""

from .data_keys import DataKeyCache, DataKeyPolicy, EncryptionKey
from .envelope import FORMAT_VERSION, MARKER_HEADER, Descriptor, EnvelopeError
from .interceptor import RecordEncryption
from .key_file import KeyFileKms
from .kms import (
    DataKey,
    InvalidKeyReference,
    KmsError,
    KmsProvider,
    KmsUnavailable,
    Undecryptable,
    UnresolvedKey,
)
from .records import RecordCipher
from .settings import RecordEncryptionSettings

__all__ = [
    "FORMAT_VERSION",
    "MARKER_HEADER",
    "DataKey",
    "DataKeyCache",
    "DataKeyPolicy",
    "Descriptor",
    "EncryptionKey",
    "EnvelopeError",
    "InvalidKeyReference",
    "KeyFileKms",
    "KmsError",
    "KmsProvider",
    "KmsUnavailable",
    "RecordCipher",
    "RecordEncryption",
    "RecordEncryptionSettings",
    "Undecryptable",
    "UnresolvedKey",
]
