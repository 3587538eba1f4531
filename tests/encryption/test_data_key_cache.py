"""The data key cache: one KMS call in flight per key, rotation, bounded and expiring
unwrapped keys, failures remembered for ``negative_ttl_s``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections import Counter
from typing import Any

import pytest

from kiproxy.interceptors.builtin.record_encryption import (
    DataKey,
    DataKeyCache,
    DataKeyPolicy,
    KmsProvider,
    KmsUnavailable,
)


class GatedKms(KmsProvider):
    """Data keys in memory; every call waits for ``gate`` and fails while ``failing``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.failing = False
        self.calls: Counter[str] = Counter()
        self.keys: dict[bytes, bytes] = {}

    async def _enter(self, operation: str) -> None:
        self.calls[operation] += 1
        await self.gate.wait()
        if self.failing:
            raise KmsUnavailable(f"{operation}: throttled")

    async def resolve_key(self, reference: str) -> str:
        await self._enter("resolve_key")
        return f"id-of-{reference}"

    async def generate_data_key(self, key_id: str) -> DataKey:
        await self._enter("generate_data_key")
        plaintext, wrapped = os.urandom(32), os.urandom(16)
        self.keys[wrapped] = plaintext
        return DataKey(key_id=key_id, plaintext=plaintext, wrapped=wrapped)

    async def decrypt_data_key(self, key_id: str, wrapped: bytes) -> bytes:
        await self._enter("decrypt_data_key")
        return self.keys[wrapped]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_concurrent_callers_share_one_generation_and_a_cancelled_one_does_not_stop_it(
        ) -> None:
    kms = GatedKms()
    kms.gate.clear()
    cache = DataKeyCache(kms)
    waiters = [asyncio.ensure_future(cache.encryption_key("orders", "KEK", 2))
               for _ in range(100)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    kms.gate.set()
    keys = await asyncio.gather(*waiters[1:])
    assert kms.calls == {"resolve_key": 1, "generate_data_key": 1}
    assert len({id(k) for k in keys}) == 1 and keys[0].uses == 2 * 99
    assert keys[0].key_id == "id-of-KEK"
    other = await cache.encryption_key("payments", "KEK", 1)  # another topic, another key
    assert other is not keys[0] and kms.calls["generate_data_key"] == 2


async def test_a_call_that_fails_after_its_only_caller_left_is_remembered_not_reported(
        ) -> None:
    """The interceptor's deadline cancels the only caller of a KMS call that hangs; the
    call fails later (a read timeout). Its failure is remembered for the next caller,
    and asyncio has no exception to report as never retrieved."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        kms = GatedKms()
        kms.gate.clear()
        kms.failing = True
        cache = DataKeyCache(kms)
        for made, get in enumerate((lambda: cache.encryption_key("orders", "KEK", 1),
                                    lambda: cache.decryption_key("id", b"wrapped")), 1):
            caller = asyncio.ensure_future(get())
            while sum(kms.calls.values()) < made:
                await asyncio.sleep(0)  # until the call is made and waits at the gate
            caller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await caller
            kms.gate.set()  # the call ends, in KmsUnavailable, with nobody waiting
            for _ in range(5):
                await asyncio.sleep(0)
            kms.gate.clear()
            del caller
            gc.collect()
        assert [c.get("message") for c in reported] == []
        kms.gate.set()
        with pytest.raises(KmsUnavailable, match="resolve_key: throttled"):
            await cache.encryption_key("orders", "KEK", 1)
        with pytest.raises(KmsUnavailable, match="decrypt_data_key: throttled"):
            await cache.decryption_key("id", b"wrapped")
        assert kms.calls == {"resolve_key": 1, "decrypt_data_key": 1}  # remembered
    finally:
        loop.set_exception_handler(None)


async def test_a_key_is_used_up_by_count_and_by_age() -> None:
    kms, clock = GatedKms(), Clock()
    cache = DataKeyCache(kms, DataKeyPolicy(max_encryptions_per_key=5, max_key_age_s=10),
                         clock=clock)
    first = await cache.encryption_key("t", "KEK", 3)
    assert await cache.encryption_key("t", "KEK", 2) is first
    second = await cache.encryption_key("t", "KEK", 1)
    assert second is not first and first.uses == 5
    clock.now += 9.9
    assert await cache.encryption_key("t", "KEK", 1) is second
    clock.now += 0.1
    assert await cache.encryption_key("t", "KEK", 1) is not second
    with pytest.raises(ValueError, match=r"1\.\.5"):
        await cache.encryption_key("t", "KEK", 6)


async def test_unwrapped_keys_are_bounded_expire_and_include_generated_ones() -> None:
    kms, clock = GatedKms(), Clock()
    cache = DataKeyCache(kms, DataKeyPolicy(decrypted_cache_size=2, decrypted_ttl_s=60),
                         clock=clock)
    generated = [await kms.generate_data_key("id") for _ in range(3)]
    for key in generated:
        assert (await cache.decryption_key("id", key.wrapped)) is not None
    assert kms.calls["decrypt_data_key"] == 3 and len(cache) == 2
    await cache.decryption_key("id", generated[2].wrapped)  # held
    await cache.decryption_key("id", generated[0].wrapped)  # evicted: asked again
    assert kms.calls["decrypt_data_key"] == 4
    clock.now += 61
    await cache.decryption_key("id", generated[0].wrapped)  # expired: asked again
    assert kms.calls["decrypt_data_key"] == 5

    own = await cache.encryption_key("t", "KEK", 1)
    await cache.decryption_key(own.key_id, own.wrapped)
    assert kms.calls["decrypt_data_key"] == 5


async def test_a_failure_is_remembered_for_negative_ttl_then_tried_again() -> None:
    kms, clock = GatedKms(), Clock()
    cache = DataKeyCache(kms, DataKeyPolicy(negative_ttl_s=5), clock=clock)
    kms.failing = True
    for _ in range(3):
        with pytest.raises(KmsUnavailable, match="throttled"):
            await cache.encryption_key("t", "KEK", 1)
        with pytest.raises(KmsUnavailable, match="throttled"):
            await cache.decryption_key("id", b"wrapped")
    assert kms.calls == {"resolve_key": 1, "decrypt_data_key": 1}
    kms.failing = False
    clock.now += 5
    assert (await cache.encryption_key("t", "KEK", 1)).uses == 1
    assert kms.calls["resolve_key"] == 2


def test_the_policy_names_the_setting_that_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"data_keys\.max_encryptions_per_key"):
        DataKeyPolicy.from_config({"max_encryptions_per_key": 2**32 + 1})
    with pytest.raises(ValueError, match=r"data_keys\.max_key_age"):
        DataKeyPolicy.from_config({"max_key_age": 10})
    assert DataKeyPolicy.from_config({"negative_ttl_s": 0}).negative_ttl_s == 0
    with pytest.raises(ValueError, match="data_keys: expected a mapping, got list"):
        DataKeyPolicy.from_config([])  # type: ignore[arg-type]


async def test_a_wait_for_the_kms_ends_before_the_deadline_and_the_call_goes_on() -> None:
    kms = GatedKms()
    kms.gate.clear()
    cache = DataKeyCache(kms)
    for get in (lambda deadline: cache.encryption_key("orders", "KEK", 1, deadline=deadline),
                lambda deadline: cache.decryption_key("id", b"wrapped", deadline=deadline)):
        deadline = time.monotonic() + 0.3
        with pytest.raises(KmsUnavailable, match="did not answer before the batch's deadline"):
            await get(deadline)
        assert time.monotonic() < deadline  # room left to answer with the KMS policy
    assert kms.calls == {"resolve_key": 1, "decrypt_data_key": 1}
    wrapped = os.urandom(16)
    kms.keys[b"wrapped"] = wrapped
    kms.gate.set()  # the calls answer: the next callers get their keys, no new call
    key = await cache.encryption_key("orders", "KEK", 1, deadline=time.monotonic() + 1)
    assert key.key_id == "id-of-KEK"
    await cache.decryption_key("id", b"wrapped", deadline=time.monotonic() + 1)
    assert kms.calls == {"resolve_key": 1, "generate_data_key": 1, "decrypt_data_key": 1}
