"""The admin guard's log: a token file it cannot use is one line an interval, saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kiproxy.proxy.admin.guard import AdminGuard


def _lines(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and words in r.getMessage()]


def test_a_missing_token_file_is_one_line_however_many_callers_ask(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    guard = AdminGuard(str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING):
        refusals = [guard.check("10.0.0.9:5000", "127.0.0.1:9193", "Bearer x")
                    for _ in range(20)]
    assert {r[0] for r in refusals if r is not None} == {403} and None not in refusals
    lines = _lines(caplog, "cannot be read")
    assert len(lines) == 1 and "No such file" in lines[0], lines


def test_an_empty_token_file_is_named_as_empty(caplog: pytest.LogCaptureFixture,
                                               tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    with caplog.at_level(logging.WARNING):
        assert AdminGuard(str(token)).check("10.0.0.9:5000", "127.0.0.1:9193", None) == (
            403, "the admin token file cannot be read or is empty (see the proxy's log)")
    assert _lines(caplog, "cannot be read") == [
        f"admin.token_file {token} cannot be read (it is empty); admin actions are refused "
        "until it can"]
