"""``DataKeyCache``: the data keys a :class:`~.kms.KmsProvider` hands out, kept and rotated.

Contract.

* **Encrypting.** Each ``(topic, KEK reference)`` has one current data key.
  :meth:`DataKeyCache.encryption_key` reserves ``uses`` encryptions (AES-GCM
  invocations, one per sealed field) from it; a key that would pass
  ``max_encryptions_per_key`` or is older than ``max_key_age_s`` is replaced by a
  fresh one (``resolve_key`` then ``generate_data_key``, so a re-pointed alias is
  followed at the next rotation). The count bound keeps random 96-bit GCM nonces far
  from colliding (NIST SP 800-38D allows 2^32 invocations per key).
* **Decrypting.** :meth:`DataKeyCache.decryption_key` unwraps a wrapped data key
  once and keeps it: at most ``decrypted_cache_size`` keys (least recently used out),
  each for ``decrypted_ttl_s``. A key this cache generated is kept for decrypting too.
* **One call in flight per key.** While a data key is being generated for a topic, or
  unwrapped, every other caller awaits the same call: N concurrent encryptions of a
  topic with no current key make one ``GenerateDataKey``. A caller that is cancelled
  (the interceptor's deadline) does not cancel the call for the others, and a call
  that fails after its last caller left is remembered like any failure, never left
  for asyncio to report as an exception nobody retrieved.
* **Waits end before the batch's deadline.** A caller that passes ``deadline`` (the
  hook's ``ctx.deadline``, ``time.monotonic()``) and must wait for a KMS call stops
  waiting :data:`DEADLINE_MARGIN_S` before it with :class:`~.kms.KmsUnavailable`, so the
  interceptor answers with its KMS policy (retriable refusal, or ``pass``) rather than
  being cut off by the proxy as a plugin that missed its deadline; the call goes on
  and its answer serves the next caller. A key already held is returned without a wait.
* **Failures are remembered** for ``negative_ttl_s``: callers in that window get the
  same :class:`~.kms.KmsError` without another KMS call, so an outage or a bad key
  does not turn every record into a KMS request.

One cache serves one event loop (the calls in flight are tasks of that loop).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Annotated, Any, Generic, TypeVar

import pydantic
from pydantic import Field

from kiproxy.interceptors.sealing import Aead, aes_gcm
from kiproxy.interceptors.settings import PluginSettings

from .kms import KmsError, KmsProvider, KmsUnavailable

__all__ = ["DEADLINE_MARGIN_S", "DataKeyCache", "DataKeyPolicy", "EncryptionKey"]

DEADLINE_MARGIN_S = 0.1
"""How long before its deadline a caller stops waiting for a KMS call: the time left to
answer with the KMS policy before the proxy's own cut-off."""

_T = TypeVar("_T")


class DataKeyPolicy(PluginSettings):
    """How long data keys are used to encrypt, and how unwrapped ones are kept."""

    max_encryptions_per_key: Annotated[int, Field(ge=1, le=2**32)] = 5_000_000
    """Sealed fields per data key before a new one is generated."""
    max_key_age_s: Annotated[float, Field(gt=0)] = 3600.0
    """Age after which a data key is no longer used to encrypt."""
    decrypted_cache_size: Annotated[int, Field(ge=1)] = 1000
    """Unwrapped data keys kept for decrypting."""
    decrypted_ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    """How long an unwrapped data key is kept."""
    negative_ttl_s: Annotated[float, Field(ge=0)] = 5.0
    """How long a failed KMS call is remembered before it is tried again."""

    @classmethod
    def from_config(cls, raw: Mapping[str, object]) -> DataKeyPolicy:
        """Parse the ``data_keys:`` mapping; errors name the key (``data_keys.x``)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"data_keys: expected a mapping, got {type(raw).__name__}")
        try:
            return cls.model_validate(dict(raw))
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            raise ValueError(f"data_keys.{'.'.join(str(p) for p in err['loc'])}: "
                             f"{err['msg']}") from None


class EncryptionKey:
    """A current data key: its cipher, its wrapped form and how much of it is used."""

    __slots__ = ("aead", "created", "key_id", "uses", "wrapped")

    def __init__(self, key_id: str, wrapped: bytes, aead: Aead, created: float) -> None:
        self.key_id = key_id
        self.wrapped = wrapped
        self.aead = aead
        self.created = created
        self.uses = 0

    def __repr__(self) -> str:
        return f"EncryptionKey(key_id={self.key_id!r}, uses={self.uses})"


class _Failure:
    __slots__ = ("error", "until")

    def __init__(self, error: KmsError, until: float) -> None:
        self.error = error
        self.until = until


class _SingleFlight(Generic[_T]):
    """One task per key; failures remembered until their deadline.

    A task's exception is retrieved when it ends: one whose callers were all cancelled
    (their deadline passed) would otherwise be logged as never retrieved."""

    def __init__(self, clock: Callable[[], float], negative_ttl_s: float) -> None:
        self._clock = clock
        self._negative_ttl_s = negative_ttl_s
        self._inflight: dict[Hashable, asyncio.Task[_T]] = {}
        self._failures: dict[Hashable, _Failure] = {}

    async def run(self, key: Hashable, call: Callable[[], Awaitable[_T]],
                  deadline: float | None) -> _T:
        failure = self._failures.get(key)
        if failure is not None:
            if self._clock() < failure.until:
                raise failure.error
            del self._failures[key]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._settle(key, call))
            task.add_done_callback(_retrieved)
            self._inflight[key] = task
        left = (None if deadline is None or math.isinf(deadline)
                else max(deadline - time.monotonic() - DEADLINE_MARGIN_S, 0.0))
        try:
            async with asyncio.timeout(left) as bound:  # None: waits as long as the call
                return await asyncio.shield(task)
        except TimeoutError:
            if not bound.expired():
                raise
            raise KmsUnavailable(
                "the KMS did not answer before the batch's deadline (the call goes on, "
                "and its answer serves the next batch)") from None

    async def _settle(self, key: Hashable, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            return await call()
        except KmsError as exc:
            if self._negative_ttl_s > 0:
                self._failures[key] = _Failure(exc, self._clock() + self._negative_ttl_s)
            raise
        finally:
            del self._inflight[key]


class DataKeyCache:
    """Data keys for encrypting and decrypting (see the module docstring)."""

    def __init__(self, kms: KmsProvider, policy: DataKeyPolicy | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kms = kms
        self.policy = policy or DataKeyPolicy()
        self._clock = clock
        self.generated = 0
        """Data keys generated (``GenerateDataKey`` calls that answered)."""
        self.unwrapped = 0
        """Wrapped data keys unwrapped (``Decrypt`` calls that answered)."""
        self._current: dict[tuple[str, str], EncryptionKey] = {}
        self._decrypted: OrderedDict[tuple[str, bytes], tuple[Aead, float]] = OrderedDict()
        self._generating: _SingleFlight[EncryptionKey] = _SingleFlight(
            clock, self.policy.negative_ttl_s)
        self._unwrapping: _SingleFlight[Aead] = _SingleFlight(
            clock, self.policy.negative_ttl_s)

    async def encryption_key(self, topic: str, reference: str, uses: int, *,
                             deadline: float | None = None) -> EncryptionKey:
        """The current data key of ``topic`` under the KEK ``reference``, with ``uses``
        encryptions reserved (1 <= uses <= ``max_encryptions_per_key``). Raises
        :class:`~.kms.KmsError`; waits for the KMS until ``deadline`` (see the module
        docstring)."""
        limit = self.policy.max_encryptions_per_key
        if not 0 < uses <= limit:
            raise ValueError(f"reserve 1..{limit} encryptions of a data key, not {uses}")
        slot = (topic, reference)
        while True:
            key = self._current.get(slot)
            if (key is not None and key.uses + uses <= limit
                    and self._clock() - key.created < self.policy.max_key_age_s):
                key.uses += uses
                return key
            fresh = await self._generating.run(
                slot, functools.partial(self._generate, slot, key), deadline)
            if fresh.uses + uses <= limit:  # else others used it up meanwhile: go round
                fresh.uses += uses
                return fresh

    async def _generate(self, slot: tuple[str, str], stale: EncryptionKey | None,
                        ) -> EncryptionKey:
        current = self._current.get(slot)
        if current is not None and current is not stale:  # rotated while we were queued
            return current
        key_id = await self.kms.resolve_key(slot[1])
        generated = await self.kms.generate_data_key(key_id)
        self.generated += 1
        aead = aes_gcm(generated.plaintext)
        key = EncryptionKey(generated.key_id, generated.wrapped, aead, self._clock())
        self._current[slot] = key
        self._remember((generated.key_id, generated.wrapped), aead)
        return key

    async def decryption_key(self, key_id: str, wrapped: bytes, *,
                             deadline: float | None = None) -> Aead:
        """The data key ``wrapped`` under KEK ``key_id``, unwrapped (cached). Raises
        :class:`~.kms.KmsError`; waits for the KMS until ``deadline``."""
        slot = (key_id, wrapped)
        cached = self._decrypted.get(slot)
        if cached is not None:
            if self._clock() < cached[1]:
                self._decrypted.move_to_end(slot)
                return cached[0]
            del self._decrypted[slot]
        return await self._unwrapping.run(
            slot, functools.partial(self._unwrap, key_id, wrapped), deadline)

    async def _unwrap(self, key_id: str, wrapped: bytes) -> Aead:
        aead = aes_gcm(await self.kms.decrypt_data_key(key_id, wrapped))
        self.unwrapped += 1
        self._remember((key_id, wrapped), aead)
        return aead

    def _remember(self, slot: tuple[str, bytes], aead: Aead) -> None:
        self._decrypted[slot] = (aead, self._clock() + self.policy.decrypted_ttl_s)
        self._decrypted.move_to_end(slot)
        while len(self._decrypted) > self.policy.decrypted_cache_size:
            self._decrypted.popitem(last=False)

    def __len__(self) -> int:
        """Unwrapped data keys held for decrypting."""
        return len(self._decrypted)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark ``task``'s exception as seen (each caller that still waits raises it)."""
    if not task.cancelled():
        task.exception()
