"""The cyclic collector's frozen start-up objects (kiproxy.proxy.collector)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from kiproxy.cli import main
from kiproxy.proxy import cli as proxy_cli
from kiproxy.proxy.brokers.discovery import UpstreamUnreachable

# Run in a process of its own: freezing is for good (the test process's objects must not
# be taken out of the collector's reach).
_PROBE = textwrap.dedent("""
    import gc, json, weakref
    import kiproxy.proxy.cli
    from kiproxy.proxy.collector import freeze_imported
    from kiproxy.proxy.server import ProxyServer

    class Node:
        pass

    before = Node()
    before.me = before  # a cycle made before the freeze
    before_ref = weakref.ref(before)
    del before
    frozen = freeze_imported()
    tracked = gc.get_objects()
    after = Node()
    after.me = after    # a cycle made after it, as a connection's or a generation's
    after_ref = weakref.ref(after)
    del after
    gc.collect()
    print(json.dumps({
        "frozen": frozen,
        "freeze_count": gc.get_freeze_count(),
        "tracked_after_freeze": len(tracked),
        "server_class_tracked": any(o is ProxyServer for o in tracked),
        "cycle_before_freed": before_ref() is None,
        "cycle_after_freed": after_ref() is None,
    }))
""")


@pytest.fixture(scope="module")
def probe() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=60)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_the_imported_runtime_is_frozen_and_no_longer_walked(probe: dict[str, object]) -> None:
    assert probe["frozen"] == probe["freeze_count"]
    assert isinstance(probe["frozen"], int) and probe["frozen"] > 10_000
    assert probe["server_class_tracked"] is False
    assert isinstance(probe["tracked_after_freeze"], int)
    assert probe["tracked_after_freeze"] < probe["frozen"] / 10


def test_garbage_is_collected_before_freezing_and_after(probe: dict[str, object]) -> None:
    # The collection before the freeze frees what was already garbage; cycles made later
    # (retired generations, closed connections) are collected as before.
    assert probe["cycle_before_freed"] is True
    assert probe["cycle_after_freed"] is True


def _recorder(calls: list[str]) -> Callable[[], int]:
    def freeze_imported() -> int:
        calls.append("freeze")
        return 0
    return freeze_imported


def test_run_freezes_before_it_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def check_upstream(config: object) -> None:
        calls.append("connect")
        raise UpstreamUnreachable("upstream 127.0.0.1:1 refused the connection")

    monkeypatch.setattr(proxy_cli, "freeze_imported", _recorder(calls))
    monkeypatch.setattr(proxy_cli, "check_upstream", check_upstream)
    monkeypatch.setattr(proxy_cli, "_run", lambda coro: coro)
    assert main(["run", "--upstream", "127.0.0.1:1"]) == 1
    assert calls == ["freeze", "connect"]


def test_a_config_error_stops_before_freezing(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []
    monkeypatch.setattr(proxy_cli, "freeze_imported", _recorder(calls))
    assert main(["run", "--upstream", "not-an-address"]) == 2
    assert "upstream" in capsys.readouterr().err
    assert calls == []
