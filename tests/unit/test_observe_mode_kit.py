"""Observe mode in ``kiproxy check`` and the test kit: the batch goes on as it came, and
the observed verdict reads exactly as the enforced one would."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.cli import main
from kiproxy.interceptors.testing import load, make_batch, run_interceptor

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
TEST_PLUGINS = ROOT / "tests" / "plugins"


def test_the_kit_in_observe_mode_forwards_the_batch_and_holds_the_verdict() -> None:
    batch = make_batch("fine", "BAD value", topic="orders")
    with load("my_policy:MyPolicy", plugins_dir=TEST_PLUGINS) as plugin:
        enforced = run_interceptor(plugin, batch)
        observed = run_interceptor(plugin, batch, mode="observe")
    assert enforced.kind == "rejected" and enforced.record_errors == ((1, "record 1 says bad"),)
    assert (observed.kind, observed.mode, observed.records) == ("unchanged", "observe",
                                                                batch.records)
    assert observed.would == enforced  # the observed verdict, read the same way


def test_the_kit_in_observe_mode_reports_a_would_be_transformation() -> None:
    batch = make_batch("a", "b")
    with load("uppercase") as plugin:
        observed = plugin.run(batch, mode="observe")
    assert observed.values == [b"a", b"b"] and observed.forwarded
    assert observed.would is not None and observed.would.values == [b"A", b"B"]


def test_check_in_observe_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "mask_card_numbers:MaskCardNumbers", "--plugins-dir", str(PLUGINS),
                 "--mode", "observe"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == ("batch 1: check[0], 5 records: forwarded as it came (observe mode); "
                        "would have been: transformed (1 changed)")
    assert lines[2:] == [
        "batch 2: check[0], 1 record: forwarded as it came (observe mode); would have been: "
        "forwarded unchanged",
        "mask_card_numbers:MaskCardNumbers: loaded; 2 batches: 1 would be unchanged, "
        "1 would be transformed, 0 would be rejected (observe mode: every batch forwarded "
        "as it came)"]


def test_check_in_observe_mode_fails_on_what_would_be_rejected(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sample = tmp_path / "samples.jsonl"
    sample.write_text('{"value": "fine"}\n{"value": "bad one"}\n')
    code = main(["check", "my_policy:MyPolicy", "--plugins-dir", str(TEST_PLUGINS),
                 "--mode", "observe", "--fail-on-reject", "--sample", str(sample)])
    out, err = capsys.readouterr()
    assert out.splitlines()[:2] == [
        "batch 1: check[0], 2 records: forwarded as it came (observe mode); would have been: "
        "rejected with POLICY_VIOLATION (44): 1 of 2 records say bad",
        "  record 1: record 1 says bad"]
    assert code == 2 and "(--fail-on-reject)" in err


def test_check_in_observe_mode_runs_no_fetch_side_hook(
        capsys: pytest.CaptureFixture[str]) -> None:
    """As the proxy: a route or link in observe mode runs no fetch-side hook, so the
    consumer reads what is stored, and check says so instead of a fetched: line."""
    code = main(["check", "tp_fetch:UpperOnConsume", "--plugins-dir", str(TEST_PLUGINS),
                 "--mode", "observe"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "tp_fetch:UpperOnConsume: loaded; 2 batches: fetch side not run (observe mode runs "
        "no fetch-side hook: consumers read what is stored)"]
    code = main(["check", "tp_fetch:Reverse", "--plugins-dir", str(TEST_PLUGINS),
                 "--mode", "observe"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "fetched:" not in out
    assert out.splitlines()[-1].endswith(
        "0 would be rejected (observe mode: every batch forwarded as it came); fetch side "
        "not run (observe mode runs no fetch-side hook: consumers read what is stored)")
