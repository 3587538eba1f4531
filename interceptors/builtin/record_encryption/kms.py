"""``KmsProvider``: where data keys come from, and the errors a KMS call ends in.

Contract. A provider knows key-encryption keys (KEKs) by a *reference* an operator
writes in configuration (``alias/KEK_orders``, a key id or ARN for AWS KMS; a key name
for a key file) and does three things, each a coroutine that never blocks the event
loop:

* :meth:`KmsProvider.resolve_key` turns a reference into the KEK's stable id (the one
  stored in every envelope; an alias may later point elsewhere, the id does not).
* :meth:`KmsProvider.generate_data_key` makes a fresh 256-bit data key under a KEK and
  returns it twice: in plaintext (kept in memory only) and wrapped by the KEK (stored
  in records).
* :meth:`KmsProvider.decrypt_data_key` unwraps a wrapped data key; a data key wrapped
  under an older version of the KEK still unwraps.

Every failure is one of three typed errors, each naming the key and what to do:
:class:`UnresolvedKey` (no usable KEK for the reference: fix the configuration or the
key; :class:`InvalidKeyReference`, a kind of it, when the reference is not even a name
the KMS accepts), :class:`Undecryptable` (this wrapped key will never unwrap: wrong, damaged, or its
KEK is disabled or being deleted) and :class:`KmsUnavailable` (throttled, 5xx, timed
out, unreachable or an answer that is not the API's: :attr:`KmsError.retriable`, try
again later). :class:`KmsError` is their common base; a provider raises nothing else.

:meth:`KmsProvider.reference_problem` tells, without calling the KMS, a reference that
can never name a usable KEK (a malformed alias, a name a key file lacks): the built-in
refuses such a reference at load when the configuration fixes it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

__all__ = [
    "DATA_KEY_BYTES",
    "DataKey",
    "InvalidKeyReference",
    "KmsError",
    "KmsProvider",
    "KmsUnavailable",
    "Undecryptable",
    "UnresolvedKey",
]

DATA_KEY_BYTES = 32
"""A data key is an AES-256 key."""


class KmsError(Exception):
    """A KMS call failed; the message names the key and the cause."""

    retriable = False
    """Whether the same call may succeed later (the KMS was unavailable)."""


class UnresolvedKey(KmsError):
    """The reference names no KEK that may encrypt: unknown alias or id, or a KEK that
    is disabled or scheduled for deletion."""


class InvalidKeyReference(UnresolvedKey):
    """The reference is not a name the KMS accepts (an AWS alias name with a character
    outside AWS's rule): no key can ever answer to it, whatever is created."""


class Undecryptable(KmsError):
    """A wrapped data key that cannot be unwrapped: damaged, wrapped by another key, or
    its KEK is disabled or scheduled for deletion."""


class KmsUnavailable(KmsError):
    """The KMS did not answer usefully in time (throttling, 5xx, timeout, refused
    connection, a malformed answer); the same call may succeed later."""

    retriable = True


@dataclass(frozen=True, slots=True, kw_only=True)
class DataKey:
    """A data key as the KMS generated it."""

    key_id: str
    """The KEK's id (as :meth:`KmsProvider.resolve_key` returns it) that wrapped it."""
    plaintext: bytes
    """The 32-byte AES-256 key; never stored or logged."""
    wrapped: bytes
    """The key encrypted under the KEK: what records carry."""

    def __repr__(self) -> str:  # keep the key out of logs and tracebacks
        return f"DataKey(key_id={self.key_id!r}, wrapped={len(self.wrapped)} bytes)"


class KmsProvider(abc.ABC):
    """A source of data keys (see the module docstring for the contract)."""

    @abc.abstractmethod
    async def resolve_key(self, reference: str) -> str:
        """The id of the KEK ``reference`` names. Raises :class:`UnresolvedKey` or
        :class:`KmsUnavailable`."""

    @abc.abstractmethod
    async def generate_data_key(self, key_id: str) -> DataKey:
        """A fresh data key wrapped under the KEK ``key_id``. Raises
        :class:`UnresolvedKey` or :class:`KmsUnavailable`."""

    @abc.abstractmethod
    async def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        """The plaintext of ``wrapped``, a data key wrapped under ``key_id``. Raises
        :class:`Undecryptable` or :class:`KmsUnavailable`."""

    def reference_problem(self, reference: str) -> str | None:
        """Why ``reference`` can never name a usable KEK, told without calling the KMS
        (a name it does not accept, a key file without that key); None: it may."""
        return None

    def form_problem(self, reference: str) -> str | None:
        """Why ``reference`` is not in a form the KMS accepts as a key's name (an AWS
        alias name it refuses), whatever keys exist; None: it may be. Unlike
        :meth:`reference_problem`, it says nothing of which keys exist."""
        return None

    async def close(self) -> None:  # noqa: B027 - a provider without resources needs none
        """Release what the provider holds (threads, connections)."""
