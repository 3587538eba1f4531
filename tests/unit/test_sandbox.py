"""The Wasm hosts' shared backoff (``interceptors/builtin/sandbox.py``), on a fake clock."""

from __future__ import annotations

from kiproxy.interceptors.builtin.sandbox import Backoff, mib


def test_backoff_starts_at_the_third_crash_doubles_and_is_capped() -> None:
    now = [100.0]
    backoff = Backoff(clock=lambda: now[0])
    backoff.crashed("first")
    backoff.crashed("second")
    assert backoff.refusal() is None, "one or two crashes are a bad record's cost"
    for i, period in enumerate([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]):
        start = now[0]
        backoff.crashed(f"crash {i}")
        refusal = backoff.refusal()
        assert refusal is not None and refusal.startswith(f"crash {i} (it crashed {i + 3} "
                                                          "times in a row;")
        now[0] = start + period - 0.01
        assert backoff.refusal() is not None
        now[0] = start + period + 0.01
        assert backoff.refusal() is None, "after the period the plugin is tried again"


def test_an_answer_ends_the_backoff() -> None:
    now = [0.0]
    backoff = Backoff(clock=lambda: now[0])
    for _ in range(4):
        backoff.crashed("trap")
    assert backoff.refusal() is not None
    backoff.answered()
    assert backoff.refusal() is None and backoff.crashes == 0
    backoff.crashed("trap")
    assert backoff.refusal() is None, "the count starts again"


def test_sizes_are_written_as_people_read_them() -> None:
    assert (mib(256 * 2**20), mib(6400 * 1024), mib(100)) == ("256 MiB", "6400 KiB", "100 bytes")
