"""``ReceiveBudget`` with clients that send at the same pace: past the capacity only one
connection reads on, so the bytes held stay within the capacity plus one frame (and one read per
connection, taken before it is paused).

Connections claiming frames of the same size and sending them in turns, one chunk at
a time, hold the same amount after every round: none holds *more* than the others.
Each must still be paused once the total passes the capacity, but one (the first to
get ahead), which completes its frame and frees room.
"""

from __future__ import annotations

import logging

import pytest

from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.proxy.net import buffers
from kiproxy.proxy.net.buffers import ReceiveBudget

CAPACITY = 4 * 1024 * 1024
CHUNK = 32 * 1024
FRAME = 5_000_000


class _Client:
    def __init__(self, budget: ReceiveBudget) -> None:
        self.budget = budget
        self.held = 0
        self.paused = False

    def hold_back(self) -> None:
        self.paused = True

    def let_go(self) -> None:
        self.paused = False

    def send(self, n: int) -> None:
        """What the proxy reads of the client's ``n`` next bytes (nothing while paused)."""
        if self.paused:
            return
        self.held = min(self.held + n, FRAME)
        if self.held == FRAME:  # the frame is whole: handled, its bytes freed
            self.held = 0
        self.budget.update(self, self.held)


def test_clients_sending_in_turns_hold_the_capacity_plus_one_frame() -> None:
    budget = ReceiveBudget(CAPACITY)
    clients = [_Client(budget) for _ in range(32)]
    peak = 0
    for _ in range(400):
        for client in clients:
            client.send(CHUNK)
            peak = max(peak, budget.used)
    # the one reading on holds at most a frame; each other read once before it paused
    assert peak <= CAPACITY + FRAME + len(clients) * CHUNK
    assert budget.pauses >= len(clients) - 1


def test_one_client_past_the_capacity_reads_on_and_completes_its_frame() -> None:
    budget = ReceiveBudget(CAPACITY)
    clients = [_Client(budget) for _ in range(16)]
    for _ in range(CAPACITY // CHUNK // 16 + 2):  # all in step until just past it
        for client in clients:
            client.send(CHUNK)
    assert budget.used > CAPACITY
    reading = [c for c in clients if not c.paused and c.held]
    assert len(reading) == 1  # not every client tied at the top
    leader = reading[0]
    while leader.held:  # it alone reads on, to the end of its frame
        leader.send(CHUNK)
        for client in clients:
            if client is not leader:
                client.send(CHUNK)
    # its frame freed room, but the others still hold more than the capacity: one of
    # them (the oldest of the largest) reads on next, the rest stay paused
    assert budget.used > CAPACITY
    assert len([c for c in clients if not c.paused and c.held]) == 1


def test_a_paused_largest_holder_does_not_hold_back_the_largest_reader() -> None:
    budget = ReceiveBudget(100)
    big, small = _Client(budget), _Client(budget)
    big.held = 90
    budget.update(big, 90)
    big.hold_back()
    budget._paused[big] = None  # paused earlier, still holding the most
    small.send(20)  # over the capacity, but no one still reading holds as much
    assert not small.paused


def test_a_pause_is_a_warning_naming_the_budget_and_the_rest_are_counted(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "_pauses", RateLimitedLog(buffers.log))
    budget = ReceiveBudget(CAPACITY)
    big, small, other = _Client(budget), _Client(budget), _Client(budget)
    big.send(CAPACITY)  # at the capacity, not past it: nobody paused
    assert not caplog.records
    with caplog.at_level(logging.WARNING, "kiproxy.memory"):
        small.send(CHUNK)  # past it, and not the largest holder
        other.send(CHUNK)
    assert small.paused and other.paused and not big.paused
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"client reads paused: partial request frames hold {CAPACITY + CHUNK} bytes on 2 "
        f"connections, over max_client_buffered_bytes ({CAPACITY}); paused now: 1; the "
        f"largest holder ({CAPACITY} bytes) reads on."), line
    assert "idle_timeout_ms" in line
    assert budget.pauses == 2  # the second pause counted, its line held back
