"""``kiproxy check``: the repository's example plugins pass, broken ones are named exactly.

Run through the real ``kiproxy`` parser and dispatch (:func:`kiproxy.cli.main`);
what is asserted is the exit code and what a CI log would show.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kiproxy.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
WASM = ROOT / "examples" / "wasm"


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def plugin_dir(tmp_path: Path, name: str, source: str) -> Path:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return tmp_path


def test_the_card_masking_plugin_on_the_built_in_samples(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(capsys, "mask_card_numbers:MaskCardNumbers",
                           "--plugins-dir", str(PLUGINS))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "batch 1: check[0], 5 records: transformed (1 changed)"
    assert lines[1].startswith('  record 1: {"key": "order-1", "value": "card '
                               '****-****-****-1111 paid", "headers": [["src", "web"], '
                               '["trace", null]], "timestamp": ')
    assert lines[2:] == ["batch 2: check[0], 1 record: forwarded unchanged",
                         "mask_card_numbers:MaskCardNumbers: loaded; 2 batches: 1 unchanged, "
                         "1 transformed, 0 rejected"]


def test_a_sample_file_and_a_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sample = tmp_path / "samples.jsonl"
    sample.write_text("\n".join(json.dumps(doc) for doc in [
        {"key": "o1", "value": "card 4111-1111-1111-1111", "topic": "payments"},
        {"value": {"b64": "AAE="}, "headers": [["src", {"b64": "/w=="}]], "topic": "payments",
         "timestamp": 1700000000000},
        {"value": "card 4111-1111-1111-1111", "topic": "logs"},
    ]) + "\n\n")
    code, out, _ = check(capsys, "mask_card_numbers:MaskCardNumbers", "--plugins-dir",
                         str(PLUGINS), "--config", '{"topics": ["payments"]}',
                         "--sample", str(sample))
    assert code == 0
    assert out.splitlines()[0] == "batch 1: payments[0], 2 records: transformed (1 changed)"
    assert out.splitlines()[2:] == [
        "batch 2: logs[0], 1 record: forwarded unchanged",
        "mask_card_numbers:MaskCardNumbers: loaded; 2 batches: 1 unchanged, 1 transformed, "
        "0 rejected"]


def test_the_wasm_examples_by_path_alone(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(capsys, str(WASM / "uppercase.wat"))
    assert code == 0
    assert '"value": "HELLO, WORLD"' in out
    code, out, _ = check(capsys, "wasm", "--config",
                         json.dumps({"module": str(WASM / "reject_shouting.wat"), "abi": 2}))
    assert code == 0
    assert out.splitlines()[-2:] == [
        f"batch 2: check[0], 1 record: rejected with INVALID_RECORD (87): wasm module "
        f"{WASM / 'reject_shouting.wat'} (transform_batch, abi v2) rejected check[0]: value is "
        "all upper case",
        "wasm: loaded; 2 batches: 1 unchanged, 0 transformed, 1 rejected"]
    code, _, err = check(capsys, str(WASM / "reject_shouting.wat"), "--fail-on-reject")
    assert code == 2
    assert err.startswith("kiproxy check: wasm failed on 1 of 2 batches (--fail-on-reject): "
                          "batch 2: wasm module ")


def test_a_plugin_that_imports_a_missing_package(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "needs_pkg", """\
        import json
        import no_such_package_for_kiproxy
    """)
    code, out, err = check(capsys, "needs_pkg:Plugin", "--plugins-dir", str(plugins))
    assert (code, out) == (2, "")
    assert err == (
        f"kiproxy check: importing interceptor module 'needs_pkg' from {plugins} failed: "
        f"{plugins / 'needs_pkg.py'} line 2 imports 'no_such_package_for_kiproxy', which is "
        "not installed (ModuleNotFoundError: No module named 'no_such_package_for_kiproxy'); "
        "install the package that provides 'no_such_package_for_kiproxy' where kiproxy runs\n")


@pytest.mark.parametrize(("content", "line", "reason"), [
    ('{"value": "ok"}\n{"value": "broken"\n', 2,
     "Expecting ',' delimiter: line 1 column 19 (char 18)"),
    ('\n["a list"]\n', 2, "expected a JSON object, got list"),
    ('{"value": 5}\n', 1, 'value must be a string, null or {"b64": "..."}, not 5'),
    ('{"value": {"b64": "***"}}\n', 1,
     'value: {"b64": ...} is not base64 (Only base64 data is allowed)'),
    ('{"headers": {"a": "b"}}\n', 1,
     'headers must be a list of [name, value] pairs, e.g. [["src", "web"]]'),
    ('{"val": "typo"}\n', 1,
     "unknown field(s) val; known: key, value, headers, timestamp, topic, partition"),
])
def test_a_malformed_sample_line_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          content: str, line: int, reason: str) -> None:
    sample = tmp_path / "bad.jsonl"
    sample.write_text(content)
    code, out, err = check(capsys, "uppercase", "--sample", str(sample))
    assert (code, out) == (2, "")
    assert err == f"kiproxy check: sample file {sample} line {line}: {reason}\n"


def test_a_plugin_that_fails_on_a_batch(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "dropper", """\
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Drop(ProduceRequestInterceptor):
            def intercept(self, batch, ctx):
                return batch.with_records(batch.records[1:])
    """)
    code, out, err = check(capsys, "dropper:Drop", "--plugins-dir", str(plugins))
    assert code == 2
    assert out.splitlines()[0] == (
        "batch 1: check[0], 5 records: rejected with INVALID_RECORD (87): interceptor "
        "dropper:Drop broke the record-count rule: returned 4 records for a batch of 5")
    assert err == (
        "kiproxy check: dropper:Drop failed on 2 of 2 batches: batch 1: interceptor "
        "dropper:Drop broke the record-count rule: returned 4 records for a batch of 5; "
        "batch 2: interceptor dropper:Drop broke the record-count rule: returned 0 records "
        "for a batch of 1\n")


@pytest.mark.parametrize(("argv", "reason"), [
    (["nowhere:Plugin"], "interceptor module 'nowhere' not found (looked in: sys.path, entry "
                         "points (kiproxy.interceptors))"),
    (["uppercase", "--config", "[1]"], "--config: no file [1] (a value that does not start "
                                       "with '{' is the path of a JSON or YAML file)"),
    (["uppercase", "--config", "{"], "--config: not valid JSON (Expecting property name "
                                     "enclosed in double quotes: line 1 column 2 (char 1))"),
    (["uppercase", "--config", '{"a": [1]'], "--config: not valid JSON (Expecting ',' "
                                             "delimiter: line 1 column 10 (char 9))"),
    (["uppercase", "--sample", "/nonexistent/s.jsonl"],
     "cannot read sample file /nonexistent/s.jsonl: [Errno 2] No such file or directory: "
     "'/nonexistent/s.jsonl'"),
])
def test_what_cannot_be_checked_is_said(capsys: pytest.CaptureFixture[str], argv: list[str],
                                        reason: str) -> None:
    code, _, err = check(capsys, *argv)
    assert (code, err) == (2, f"kiproxy check: {reason}\n")


@pytest.mark.parametrize(("name", "text"), [
    ("config.json", '{"prefix": "checked: "}'),
    ("config.yaml", "prefix: 'checked: '\n"),
    ("config.conf", "# YAML, whatever the suffix\nprefix: 'checked: '\n"),
])
def test_the_config_may_be_a_json_or_yaml_file(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, name: str, text: str) -> None:
    plugins = plugin_dir(tmp_path, "prefixer", """
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Prefix(ProduceRequestInterceptor):
            def configure(self, config):
                self.prefix = config["prefix"].encode()

            def intercept(self, batch, ctx):
                return batch.with_records([r.with_value(self.prefix + (r.value or b""))
                                           for r in batch.records])
    """)
    (tmp_path / name).write_text(text)
    code, out, err = check(capsys, "prefixer:Prefix", "--plugins-dir", str(plugins),
                           "--config", str(tmp_path / name))
    assert (code, err) == (0, "")
    assert '"value": "checked: hello, world"' in out


@pytest.mark.parametrize(("name", "text", "reason"), [
    ("bad.json", '{"a": 1,}', "--config: {path} is not valid JSON (Expecting property name "
                              "enclosed in double quotes: line 1 column 9 (char 8))"),
    ("bad.yaml", "a: [1\n", "--config: {path} is not valid YAML (while parsing a flow "
                            "sequence in \"{path}\""),
    ("list.yaml", "- 1\n", "--config: {path} must hold a JSON object ({{\"key\": value}}) "
                           "or a YAML mapping, not list"),
])
def test_a_config_file_that_does_not_parse_is_named(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path, name: str, text: str,
                                                    reason: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, _, err = check(capsys, "uppercase", "--config", str(path))
    assert code == 2
    assert err.startswith("kiproxy check: " + reason.format(path=path)), err


def test_a_config_path_that_does_not_exist_says_so(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    code, _, err = check(capsys, "uppercase", "--config", str(tmp_path / "config.json"))
    assert (code, err) == (2, f"kiproxy check: --config: no file {tmp_path / 'config.json'} "
                              "(a value that does not start with '{' is the path of a JSON "
                              "or YAML file)\n")


def test_each_record_error_is_printed_once(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "refuser", """
        from kiproxy.interceptors import ProduceRequestInterceptor, RejectBatch

        class Refuse(ProduceRequestInterceptor):
            def intercept(self, batch, ctx):
                # the first message carries its own prefix, as schema_registry's do
                errors = [(0, "record 0: not JSON"), (1, "not JSON either"), (2, None)]
                raise RejectBatch("no", record_errors=errors[:len(batch.records)])
    """)
    code, out, _ = check(capsys, "refuser:Refuse", "--plugins-dir", str(plugins))
    assert code == 0
    assert out.splitlines()[1:4] == ["  record 0: not JSON", "  record 1: not JSON either",
                                     "  record 2"]


def test_record_errors_naming_no_record_of_the_batch_fail_the_check(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "strays", """
        from kiproxy.interceptors import ProduceRequestInterceptor, RejectBatch

        class Nope(ProduceRequestInterceptor):
            def intercept(self, batch, ctx):
                raise RejectBatch("nope", record_errors=[(99, "x"), (-1, "y"), (0, "z")])
    """)
    code, out, err = check(capsys, "strays:Nope", "--plugins-dir", str(plugins))
    assert code == 2
    assert out.splitlines()[:3] == [
        "batch 1: check[0], 5 records: rejected with POLICY_VIOLATION (44): nope",
        "  record 0: z",
        "  record_errors naming no record of the batch, left out: 99, -1"]
    assert err.splitlines()[-1] == (
        "kiproxy check: strays:Nope failed on 2 of 2 batches: batch 1: rejected with "
        "record_errors naming no record of its 5 records: 99, -1; batch 2: rejected with "
        "record_errors naming no record of its 1 record: 99, -1")


def test_an_async_plugin_that_swallows_its_cancellation_misses_the_deadline(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "stubborn", """
        import asyncio
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Stubborn(ProduceRequestInterceptor):
            async def intercept(self, batch, ctx):
                try:
                    await asyncio.Event().wait()  # set by no one
                except BaseException:  # the bug: its cancellation swallowed
                    pass
                for _ in range(5):
                    await asyncio.sleep(0)
                return batch
    """)
    code, out, err = check(capsys, "stubborn:Stubborn", "--plugins-dir", str(plugins),
                           "--timeout-ms", "300")
    assert code == 2
    assert out.splitlines()[0] == (
        "batch 1: check[0], 5 records: rejected with REQUEST_TIMED_OUT (7): interceptor "
        "stubborn:Stubborn did not finish within 300 ms")
    assert "stubborn:Stubborn failed on 2 of 2 batches" in err


TEST_PLUGINS = ROOT / "tests" / "plugins"


def test_a_plugin_on_both_hooks_is_checked_on_the_fetch_side_too(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(capsys, "tp_fetch:Reverse", "--plugins-dir", str(TEST_PLUGINS))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "batch 1: fetched: transformed (4 changed); the consumer reads what was produced" \
        in lines
    assert lines[-1] == ("tp_fetch:Reverse: loaded; 2 batches: 0 unchanged, 2 transformed, "
                         "0 rejected; fetched: 0 unchanged, 2 transformed, 0 refused")


def test_a_fetch_side_only_plugin_reports_the_fetch_side_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(capsys, "tp_fetch:UpperOnConsume", "--plugins-dir",
                           str(TEST_PLUGINS))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    # With no produce-side line before it, the line names the batch itself.
    assert lines[0] == "batch 1: check[0], 5 records: fetched: transformed (3 changed)"
    # Batch 2 comes back as equal records: unchanged, as the proxy sends it.
    assert lines[-1] == ("tp_fetch:UpperOnConsume: loaded; 2 batches: fetched: 1 unchanged, "
                         "1 transformed, 0 refused")


@pytest.mark.parametrize(("topic", "code", "said"), [
    ("refuse-x", 0, "refused with UNKNOWN_SERVER_ERROR (-1): tp_fetch:RefuseOnConsume "
                    "refused it: no reading refuse-x at offset 0"),
    ("raise-x", 2, "refused with UNKNOWN_SERVER_ERROR (-1): tp_fetch:RefuseOnConsume raised "
                   "RuntimeError: the hook broke"),
    ("grow-x", 2, "returned 6 records for 5"),
])
def test_a_failing_fetch_side_hook_fails_the_check_and_a_refusal_is_an_answer(
        capsys: pytest.CaptureFixture[str], topic: str, code: int, said: str) -> None:
    got, out, err = check(capsys, "tp_fetch:RefuseOnConsume", "--plugins-dir",
                          str(TEST_PLUGINS), "--topic", topic)
    assert got == code, (out, err)
    assert said in out
    assert ("failed on 2 of 2 batches" in err) == (code == 2)
    if code == 0:
        assert main(["check", "tp_fetch:RefuseOnConsume", "--plugins-dir", str(TEST_PLUGINS),
                     "--topic", topic, "--fail-on-reject"]) == 2


def test_a_header_key_that_is_not_utf8_is_printed_escaped() -> None:
    """A header key that is not UTF-8 (as brokers store one, read as lone surrogates)
    is printed with those bytes as ``\\xNN`` escapes: as it was, it stopped the report."""
    import io
    import json

    from kiproxy.interceptors.check import _record_line
    from kiproxy.interceptors.testing import make_record

    key = b"\xffk".decode("utf-8", "surrogateescape")
    line = _record_line(make_record(b"v", headers=[(key, b"1"), ("caf\u00e9", b"2")]))
    io.TextIOWrapper(io.BytesIO(), encoding="utf-8").write(line)  # writable as UTF-8
    assert json.loads(line)["headers"] == [["\\xffk", "1"], ["caf\u00e9", "2"]]


def test_records_that_cannot_be_encoded_are_the_rejection_the_proxy_answers(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Values instead of Records, or a header key no bytes stand for: the proxy refuses
    the batch when it encodes it, and check says so instead of "transformed"."""
    plugins = plugin_dir(tmp_path, "unencodable", """
        class Values:
            def intercept(self, batch, ctx):
                return batch.with_records([r.value for r in batch.records])

        class Surrogate:
            def intercept(self, batch, ctx):
                return batch.with_records(r.with_header("\\ud800", b"v")
                                          for r in batch.records)
        """)
    for cls, why in [("Values", "TypeError: record 0 is a bytes, not a Record"),
                     ("Surrogate", "UnicodeEncodeError: ")]:
        code, out, err = check(capsys, f"unencodable:{cls}", "--plugins-dir", str(plugins))
        assert code == 2, (out, err)
        assert out.splitlines()[0].startswith(
            "batch 1: check[0], 5 records: rejected with INVALID_RECORD (87): interceptor "
            f"unencodable:{cls} returned records that cannot be encoded: {why}"), out
        assert "Traceback" not in out + err


def test_a_large_value_is_shown_cut_with_its_size(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    plugins = plugin_dir(tmp_path, "balloon", """
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Balloon(ProduceRequestInterceptor):
            def intercept(self, batch, ctx):
                return batch.with_records(r.with_value(b"x" * 100_000) for r in batch.records)
    """)
    code, out, err = check(capsys, "balloon:Balloon", "--plugins-dir", str(plugins))
    assert (code, err) == (0, "")
    shown = [line for line in out.splitlines() if line.startswith("  record 0: ")]
    assert shown and all(len(line) < 4000 for line in shown), [len(x) for x in shown]
    assert f'"value": {{"first": "{"x" * 1024}", "bytes": 100000}}' in shown[0]


def test_a_cut_value_ends_before_a_character_it_would_split() -> None:
    from kiproxy.interceptors.check import _shown

    text = "x" * 1023 + "é" * 10  # é is two bytes: byte 1024 is inside the first one
    assert _shown(text.encode()) == {"first": "x" * 1023, "bytes": 1043}
    binary = _shown(b"\xff" * 2000)  # not text: cut where it is, spelled in base64
    assert isinstance(binary, dict) and binary["bytes"] == 2000
    assert binary["first"] == _shown(b"\xff" * 1024)
