"""``LookupCache``: lifetimes, negative answers, stale-while-revalidate, single flight, bound."""

from __future__ import annotations

import asyncio

import pytest

from kiproxy.interceptors.builtin.schema_registry.lookup_cache import LookupCache


class Unknown(Exception):
    pass


class Down(Exception):
    pass


class Service:
    """Answers ``answer`` (or raises it), counting the calls; ``gate`` holds them."""

    def __init__(self, answer: object = "v1") -> None:
        self.answer = answer
        self.calls = 0
        self.gate: asyncio.Event | None = None

    async def fetch(self) -> str:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return str(self.answer)


def cache(ttl: float = 60.0, negative: float = 60.0, size: int = 10) -> LookupCache[str]:
    return LookupCache(size=size, ttl_s=ttl, negative_ttl_s=negative, remember=(Unknown, Down),
                       keep_stale_on=(Down,))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_answer_is_kept_for_its_lifetime() -> None:
    c, s = cache(), Service()
    assert await c.get("k", s.fetch) == "v1"
    assert await c.get("k", s.fetch) == "v1"
    assert s.calls == 1 and (c.counts.misses, c.counts.hits) == (1, 1)


async def test_past_its_lifetime_the_old_answer_serves_while_one_refresh_runs() -> None:
    c, s = cache(ttl=0.05), Service()
    await c.get("k", s.fetch)
    await asyncio.sleep(0.06)
    s.answer, s.gate = "v2", asyncio.Event()
    assert [await c.get("k", s.fetch) for _ in range(3)] == ["v1"] * 3  # nobody waits
    await settle()
    assert s.calls == 2 and c.counts.stale == 3 and c.counts.refreshes == 1
    assert c.peek("k", s.fetch) == "v1"
    s.gate.set()
    await settle()
    assert await c.get("k", s.fetch) == "v2" and s.calls == 2


async def test_a_refresh_that_finds_the_service_down_keeps_the_old_answer() -> None:
    c, s = cache(ttl=0.05, negative=0.2), Service()
    await c.get("k", s.fetch)
    await asyncio.sleep(0.06)
    s.answer = Down("registry down")
    assert await c.get("k", s.fetch) == "v1"
    await settle()
    assert s.calls == 2
    assert await c.get("k", s.fetch) == "v1"
    await settle()
    assert s.calls == 2  # tried again only after negative_ttl_s
    with pytest.raises(Down):  # refresh() says so, and the old answer stays
        await c.refresh("k", s.fetch)
    assert c.peek("k", s.fetch) == "v1"


async def test_negative_answers_are_remembered_for_their_own_lifetime() -> None:
    c, s = cache(negative=0.05), Service(Unknown("no such id"))
    for _ in range(3):
        with pytest.raises(Unknown):
            await c.get("k", s.fetch)
    assert s.calls == 1 and c.counts.unknown == 2
    assert isinstance(c.peek("k", s.fetch), Unknown)
    await asyncio.sleep(0.06)
    assert c.peek("k", s.fetch) is None  # expired: the caller must look it up
    s.answer = "v1"
    assert await c.get("k", s.fetch) == "v1" and s.calls == 2


async def test_an_error_not_remembered_is_asked_again_at_once() -> None:
    c = LookupCache[str](size=10, ttl_s=60, negative_ttl_s=60)
    s = Service(Down("refused"))
    for _ in range(2):
        with pytest.raises(Down):
            await c.get("k", s.fetch)
    assert s.calls == 2


async def test_one_lookup_in_flight_per_key_and_a_cancelled_caller_does_not_cancel_it() -> None:
    c, s = cache(), Service()
    s.gate = asyncio.Event()
    first = asyncio.ensure_future(c.get("k", s.fetch))
    others = [asyncio.ensure_future(c.get("k", s.fetch)) for _ in range(9)]
    await settle()
    first.cancel()
    s.gate.set()
    assert await asyncio.gather(*others) == ["v1"] * 9
    assert s.calls == 1


async def test_at_most_size_keys_the_least_recently_used_first_out() -> None:
    c, s = cache(size=2), Service()
    for key in ("a", "b"):
        await c.get(key, s.fetch)
    await c.get("a", s.fetch)
    await c.get("c", s.fetch)
    assert len(c) == 2 and "b" not in c and "a" in c


def test_each_event_loop_gets_its_own_lookup() -> None:
    c, s = cache(ttl=0.0), Service()
    assert asyncio.run(c.get("k", s.fetch)) == "v1"
    assert asyncio.run(c.refresh("k", s.fetch)) == "v1"
    assert s.calls == 2


async def test_flight_hands_over_the_lookup_in_flight_and_get_own_does_not_join_it(
        ) -> None:
    """``flight`` gives the answer known, or the lookup in flight (started if none) for
    the caller to join or leave; ``get_own`` asks on its own account (the lookup in
    flight may be waiting on its caller) and keeps the answer as ``get`` does."""
    c, held, own = cache(), Service("held"), Service("own")
    held.gate = asyncio.Event()
    task = c.flight("k", held.fetch)
    assert isinstance(task, asyncio.Task) and c.flight("k", own.fetch) is task
    assert (c.counts.misses, c.counts.hits) == (1, 1)
    await settle()
    assert await asyncio.wait_for(c.get_own("k", own.fetch), 1) == "own"
    assert c.flight("k", held.fetch) == "own" and held.calls == 1  # kept, asked once
    held.gate.set()
    assert await task == "held"
    c.drop("k")
    down = Service(Down("registry down"))
    with pytest.raises(Down):
        await c.get_own("k", down.fetch)
    with pytest.raises(Down):  # remembered: not asked again
        c.flight("k", down.fetch)
    assert down.calls == 1


def test_adopt_takes_the_answers_with_their_time_left_and_not_the_negative_ones() -> None:
    earlier: LookupCache[str] = LookupCache(size=3, ttl_s=60, negative_ttl_s=5,
                                            remember=(KeyError,))
    earlier.put("fresh", "a")
    earlier.put("stale", "b", ttl_s=-1)  # past its lifetime: still served, refreshed
    earlier.put("missing", KeyError("no such id"))
    later: LookupCache[str] = LookupCache(size=3, ttl_s=60, negative_ttl_s=5,
                                          remember=(KeyError,))
    later.put("fresh", "own")

    later.adopt(earlier)

    assert later.peek("fresh", _never) == "own"  # its own answer is kept
    assert "stale" in later and "missing" not in later
    assert later._data["stale"].expires == earlier._data["stale"].expires


async def _never() -> str:
    raise AssertionError("not asked")
