"""Wasm modules that describe themselves (the ``kiproxy.interceptor`` custom section).

The shipped examples need only ``module:``; config keys override a
declaration, and when host and module then disagree the start-up log and the
rejection say so; a module that declares nothing is called with the old
defaults, and a trap then says which defaults were used. Bad declarations and
files that are not Wasm fail at start with the file and the section or export
named. Plugins are loaded and run with the test kit, as a plugin author would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime

from kiproxy.interceptors.builtin.wasm.declaration import (
    Declaration,
    Entry,
    bind,
    custom_sections,
    read_declaration,
)
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.interceptors.testing import Plugin, load, make_batch

ROOT = Path(__file__).resolve().parents[2]
UPPERCASE = ROOT / "examples" / "wasm" / "uppercase.wat"
REJECT_SHOUTING = ROOT / "examples" / "wasm" / "reject_shouting.wat"
SECTION_LINE = '(@custom "kiproxy.interceptor"'
DECLARED = ('{"function":"transform","abi":1,"encoding":"binary",'
            '"functions":{"transform_batch":{"abi":2}}}')


@pytest.fixture
def plugins() -> Iterator[list[Plugin]]:
    loaded: list[Plugin] = []
    yield loaded
    for plugin in loaded:
        plugin.close()


def wasm(plugins: list[Plugin], **config: object) -> Plugin:
    plugin = load("wasm", config={"threaded": False, **{k: str(v) if isinstance(v, Path) else v
                                                         for k, v in config.items()}})
    plugins.append(plugin)
    return plugin


def with_section(tmp_path: Path, payload: str | None, name: str = "m.wat") -> Path:
    """uppercase.wat with its declaration replaced by ``payload`` (None: removed)."""
    lines = [line for line in UPPERCASE.read_text().splitlines() if SECTION_LINE not in line]
    if payload is not None:
        escaped = payload.replace('"', '\\"')
        lines.insert(lines.index("(module") + 1, f'  {SECTION_LINE} "{escaped}")')
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- the examples


def test_the_examples_need_only_module(plugins: list[Plugin]) -> None:
    upper = wasm(plugins, module=UPPERCASE).run(make_batch("hello", None))
    assert (upper.kind, upper.values) == ("transformed", [b"HELLO", None])
    shout = wasm(plugins, module=REJECT_SHOUTING).run(make_batch("calm", "LOUD", topic="t"))
    assert (shout.kind, shout.record_errors) == ("rejected", ((1, "value is all upper case"),))
    assert shout.message == (f"wasm module {REJECT_SHOUTING} (transform, abi v1) rejected "
                             "record 1 of t[0]: value is all upper case")


def test_abi_2_alone_picks_the_function_declared_for_it(plugins: list[Plugin]) -> None:
    plugin = wasm(plugins, module=REJECT_SHOUTING, abi=2)
    outcome = plugin.run(make_batch("LOUD", topic="t"))
    assert outcome.message == (f"wasm module {REJECT_SHOUTING} (transform_batch, abi v2) "
                               "rejected t[0]: value is all upper case")


def test_an_overridden_encoding_is_logged_and_named_in_the_rejection(
        plugins: list[Plugin], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kiproxy.wasm"):
        plugin = wasm(plugins, module=UPPERCASE, encoding="json")
    assert (f"wasm module {UPPERCASE}: the config sets encoding json but the module declares "
            "binary for 'transform'; the config wins") in caplog.text
    outcome = plugin.run(make_batch("hello"))
    assert outcome.error == "INVALID_RECORD"
    assert outcome.message is not None
    assert outcome.message.startswith(f"wasm module {UPPERCASE} (transform, abi v1) trapped: ")
    assert outcome.message.endswith(
        "The host and the module disagree: the config sets encoding json but the module "
        "declares binary for 'transform'. Remove the override from the config or rebuild "
        "the module.")


def test_a_module_that_declares_nothing_keeps_the_defaults_and_says_so_when_it_traps(
        plugins: list[Plugin], tmp_path: Path) -> None:
    module = with_section(tmp_path, None)
    outcome = wasm(plugins, module=module).run(make_batch("hello"))
    assert outcome.message is not None and "(transform, abi v1) trapped" in outcome.message
    assert outcome.message.endswith(
        "The module does not declare how 'transform' is called (no 'kiproxy.interceptor' "
        "custom section entry for it) and the config does not say either, so the host used "
        "its default abi v1 and the json encoding; if the module was built for another, "
        "declare it in the module or set abi and encoding in the config.")
    # Told in the config, it works as before declarations existed.
    fixed = wasm(plugins, module=module, encoding="binary").run(make_batch("hello"))
    assert fixed.values == [b"HELLO"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("payload", "message"), [
    (DECLARED.replace('"abi":1', '"abi":3'),
     "custom section 'kiproxy.interceptor' (function 'transform') declares abi 3, which this "
     "kiproxy does not know: it runs abi 1 (one record per call) and 2 (the whole batch); "
     "rebuild the module for one of them or upgrade kiproxy"),
    (DECLARED.replace('"binary"', '"cbor"'),
     "custom section 'kiproxy.interceptor' declares encoding \"cbor\"; known: json, binary"),
    ("{abi: 1}", "custom section 'kiproxy.interceptor' is not a UTF-8 JSON object: Expecting "
                 "property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('{"abi":1,"entry":"transform"}', "custom section 'kiproxy.interceptor' has unknown key(s) "
                                      "entry; known: abi, encoding, function, functions"),
])
def test_a_bad_declaration_fails_at_start_naming_file_and_section(
        plugins: list[Plugin], tmp_path: Path, payload: str, message: str) -> None:
    module = with_section(tmp_path, payload)
    with pytest.raises(PluginLoadError) as info:
        wasm(plugins, module=module)
    assert str(info.value) == \
        f"wasm.configure() failed: ValueError: wasm module {module}: {message}"


def test_a_declared_function_that_is_not_exported_is_named(plugins: list[Plugin],
                                                           tmp_path: Path) -> None:
    module = with_section(tmp_path, DECLARED.replace("transform_batch", "check_batch"))
    with pytest.raises(PluginLoadError) as info:
        wasm(plugins, module=module)
    assert str(info.value) == (
        f"wasm.configure() failed: ValueError: wasm module {module} does not follow the "
        "kiproxy ABI: it exports no function 'check_batch' (its custom section "
        "'kiproxy.interceptor' declares it); its (i32, i32) -> i64 exports are: transform, "
        "transform_batch")


def test_a_configured_function_that_is_not_exported_is_named(plugins: list[Plugin]) -> None:
    with pytest.raises(PluginLoadError) as info:
        wasm(plugins, module=UPPERCASE, function="transfrom")
    assert str(info.value).endswith(
        "it exports no function 'transfrom' (the config sets function 'transfrom'; the module "
        "declares transform (abi v1, binary), transform_batch (abi v2, binary)); its "
        "(i32, i32) -> i64 exports are: transform, transform_batch")


@pytest.mark.parametrize(("name", "data", "reason"), [
    ("m.wasm", b"plain text, not wasm", "is not WebAssembly: it does not start with the Wasm "
                                      "magic bytes \\0asm (a binary module) and is named "
                                      ".wasm, not .wat"),
    ("m.wat", b"\x7fELF\x02\x01\xff\xfe", "is not WebAssembly: it does not start with the "
                                         "Wasm magic bytes \\0asm (a binary module) and is "
                                         "not text (.wat)"),
    ("m.wat", b"(module (func", "does not compile: it is not valid WebAssembly text: "
                                "expected `)` (line:column 1:14)"),
])
def test_a_file_that_is_not_wasm(plugins: list[Plugin], tmp_path: Path, name: str, data: bytes,
                                 reason: str) -> None:
    module = tmp_path / name
    module.write_bytes(data)
    with pytest.raises(PluginLoadError) as info:
        wasm(plugins, module=module)
    assert str(info.value) == f"wasm.configure() failed: ValueError: wasm module {module} {reason}"


# ---------------------------------------------------------------------------- pure parts


def test_the_section_is_read_from_the_binary_module() -> None:
    binary = bytes(wasmtime.wat2wasm(UPPERCASE.read_text()))
    assert ("kiproxy.interceptor", DECLARED.encode()) in list(custom_sections(binary))
    declaration = read_declaration(binary, "uppercase.wasm")
    assert declaration == Declaration(function="transform", entries={
        "transform": Entry(abi=1, encoding="binary"),
        "transform_batch": Entry(abi=2, encoding="binary")})
    assert read_declaration(bytes(wasmtime.wat2wasm("(module)")), "empty.wasm") is None
    with pytest.raises(ValueError, match="runs past the end"):
        list(custom_sections(binary[:40]))


def test_bind_lets_the_config_override_and_keeps_the_disagreements() -> None:
    declared = Declaration(function="transform", entries={
        "transform": Entry(1, "binary"), "transform_batch": Entry(2, "binary")})
    plain = bind(declared, function=None, abi=None, encoding=None)
    assert (plain.function, plain.abi, plain.encoding, plain.hint) == \
        ("transform", 1, "binary", "")
    assert bind(declared, function=None, abi=2, encoding=None).function == "transform_batch"
    forced = bind(declared, function="transform", abi=2, encoding="json")
    assert (forced.abi, forced.encoding) == (2, "json")
    assert forced.overrides == (
        "the config sets abi 2 but the module declares abi 1 for 'transform'",
        "the config sets encoding json but the module declares binary for 'transform'")
    nothing = bind(None, function=None, abi=None, encoding="binary")
    assert (nothing.function, nothing.abi, nothing.encoding, nothing.defaulted) == \
        ("transform", 1, "binary", ("abi",))
