"""The paced phase's bookkeeping: which records are timed, and the offsets they must get.

No timing here: the harness's measurements are checked by running it, not by tests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import support.bench  # noqa: F401 - bench/ is not an installed package: this makes it importable

from bench.proxy.paced import offset_errors, round_robin_counts, sampling_pattern
from bench.proxy.run import niced


def test_every_record_is_timed_without_sampling() -> None:
    assert all(sampling_pattern(1, length=100))


@pytest.mark.parametrize("sample", [2, 8, 32])
def test_sampling_times_about_one_in_n_records_of_every_partition(sample: int) -> None:
    pattern = sampling_pattern(sample)
    for partitions in (1, 3, 4):
        for p in range(partitions):
            share = sum(pattern[p::partitions]) / len(pattern[p::partitions])
            assert share == pytest.approx(1 / sample, rel=0.25)


def test_sampling_pattern_is_fixed_and_refuses_nonsense() -> None:
    assert sampling_pattern(8) == sampling_pattern(8)
    with pytest.raises(ValueError, match="1 or more"):
        sampling_pattern(0)


def test_round_robin_counts() -> None:
    assert round_robin_counts(10, 3) == [4, 3, 3]
    assert round_robin_counts(2, 3) == [1, 1, 0]
    assert sum(round_robin_counts(2000, 3)) == 2000


def _offsets(timed: list[int], partitions: int, before: list[int],
             lose: int | None = None, twice: int | None = None) -> list[tuple[int, int]]:
    """What the broker would assign to ``timed`` of 30 records, with one lost or doubled."""
    out, next_offset = [], list(before)
    for s in range(30):
        p = s % partitions
        if s == lose:
            continue
        copies = 2 if s == twice else 1
        for _ in range(copies):
            if s in timed:
                out.append((p, next_offset[p]))
            next_offset[p] += 1
    return out


def test_offsets_of_a_complete_phase_match() -> None:
    timed = [0, 4, 7, *range(25, 30)]
    assert offset_errors(timed, 3, [5, 4, 4], _offsets(timed, 3, [5, 4, 4])) is None


@pytest.mark.parametrize("fault", ["lose", "twice"])
def test_a_record_lost_or_doubled_before_the_timed_tail_is_caught(fault: str) -> None:
    timed = [0, 4, *range(25, 30)]
    delivered = _offsets(timed, 3, [5, 4, 4], **{fault: 11})  # record 11 is not timed
    error = offset_errors(timed, 3, [5, 4, 4], delivered)
    assert error is not None and "lost or written twice" in error


def test_niced_lowers_only_the_child() -> None:
    assert niced(0) is None
    mine = os.nice(0)
    out = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"],
                         capture_output=True, text=True, check=True, preexec_fn=niced(3))
    assert int(out.stdout) == min(mine + 3, 19)
    assert os.nice(0) == mine
