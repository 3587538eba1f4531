"""The one WebAssembly host under both ABIs (``interceptors/builtin/sandbox.py``): instance
pools, the file watch and the JSON spelling of bytes, without a runtime."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiproxy.interceptors.builtin.sandbox import (
    FileWatch,
    InstancePool,
    Spelling,
    json_bytes,
    read_bytes,
    spell_bytes,
)


@dataclass
class _Instance:
    number: int
    generation: int


def _pool(limit: int | None) -> tuple[InstancePool[_Instance], list[_Instance]]:
    made: list[_Instance] = []

    def make() -> _Instance:
        made.append(_Instance(len(made), pool.generation))
        return made[-1]

    pool: InstancePool[_Instance] = InstancePool(make, limit)
    return pool, made


def test_instances_are_reused_and_never_more_than_the_limit() -> None:
    pool, made = _pool(limit=1)
    first = pool.take()
    got: list[_Instance] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take()))
    waiter.start()  # the limit is reached: it waits for the instance to come back
    pool.give(first)
    waiter.join()
    assert got == [first] and made == [first], "no second instance past the limit"


def test_a_discarded_instance_makes_room_for_a_new_one() -> None:
    pool, made = _pool(limit=1)
    pool.take()
    pool.discard()  # it crashed
    assert pool.take() is made[1] and pool.size == 1


def test_a_renewed_pool_drops_old_instances_idle_and_busy() -> None:
    pool, made = _pool(limit=None)
    idle, busy = pool.take(), pool.take()
    pool.give(idle)
    pool.renew()  # the module was reloaded
    assert pool.idle == []
    pool.give(busy)
    assert pool.idle == [] and pool.size == 0, "an instance of the old module is not reused"
    assert pool.take() is made[2] and made[2].generation == 1


def test_a_changed_file_is_loaded_once_and_a_failed_one_waits_for_the_next_change(
        tmp_path: Path) -> None:
    file = tmp_path / "plugin.wasm"
    file.write_bytes(b"one")
    watch = FileWatch(file, interval=0)
    loads: list[bytes] = []
    answer = [False]

    def load() -> bool:
        loads.append(file.read_bytes())
        return answer[0]

    def never(exc: OSError) -> None:
        raise AssertionError(exc)

    watch.poll(load, never)
    assert loads == [], "unchanged"
    file.write_bytes(b"broken")
    watch.poll(load, never)
    watch.poll(load, never)
    assert loads == [b"broken"], "a file that failed is not tried again until it changes"
    answer[0] = True
    file.write_bytes(b"fixed, and longer")  # a new size: mtime may not tick
    watch.poll(load, never)
    watch.poll(load, never)
    assert loads == [b"broken", b"fixed, and longer"]


def test_a_file_watch_with_no_interval_never_looks(tmp_path: Path) -> None:
    file = tmp_path / "plugin.wasm"
    file.write_bytes(b"one")
    watch = FileWatch(file, interval=None)
    file.write_bytes(b"two!")
    watch.poll(lambda: pytest.fail("looked"), lambda exc: pytest.fail("looked"))


@pytest.mark.parametrize(("spelling", "data", "spelled"), [
    ("text", b"caf\xc3\xa9", "café"),
    ("base64", b"\xff\x00", "/wA="),
    ("tagged", b"caf\xc3\xa9", "café"),
    ("tagged", b"\xff\x00", {"b64": "/wA="}),
    ("tagged", None, None),
])
def test_bytes_are_spelled_and_read_back(spelling: Spelling, data: bytes | None,
                                         spelled: object) -> None:
    assert spell_bytes(spelling)(data) == spelled
    assert read_bytes(spelled, spelling, "value", ValueError) == data


@pytest.mark.parametrize(("spelling", "value", "message"), [
    ("text", 1, "value must be a string or null, not int"),
    ("base64", "***", "value is not base64"),
    ("base64", "\"é\"", "value is not base64 (string argument should contain only ASCII"),
    ("tagged", {"b64": "***"}, "value is not valid base64"),
    ("tagged", {"b64": "é"}, "value is not valid base64"),
    ("tagged", [1], 'value must be null, a string or {"b64": "..."}, not list'),
])
def test_bytes_spelled_wrong_name_the_field(spelling: Spelling, value: object,
                                            message: str) -> None:
    with pytest.raises(LookupError, match=message.replace("(", r"\(").replace("{", r"\{")
                       .replace("[", r"\[")):
        read_bytes(value, spelling, "value", LookupError)


def test_json_is_compact_and_keeps_non_ascii() -> None:
    assert json_bytes({"v": "é", "n": [1, None]}) == '{"v":"é","n":[1,null]}'
