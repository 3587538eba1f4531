"""``MODULE:CLASS`` resolution and the loader's errors.

Order: the plugins dir (a ``.py`` file or a package), then installed modules on
``sys.path``, then the entry-point group ``kiproxy.interceptors``. Every failure
is a :class:`PluginLoadError` whose message says what was looked for and why it
failed. The plugins used live in ``tests/plugins``; throw-away ones are written
to ``tmp_path``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kiproxy.interceptors import ProduceRequestInterceptor, Record, RecordBatch
from kiproxy.interceptors.builtin.uppercase import Uppercase
from kiproxy.interceptors.loader import (
    ENTRY_POINT_GROUP,
    PluginLoadError,
    load_interceptor,
    resolve_class,
)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


@pytest.fixture(autouse=True)
def _isolate_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The loader edits sys.path and sys.modules; undo it after every test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("tp_", "shadow_", "syntax_", "needs_")):
            del sys.modules[name]


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


_SHADOW = """
    from kiproxy.interceptors import ProduceRequestInterceptor

    class Which(ProduceRequestInterceptor):
        origin = {origin!r}

        def intercept(self, batch, ctx):
            return batch
"""


# ---------------------------------------------------------------------------- found where


def test_plugin_file_in_the_plugins_dir() -> None:
    cls = resolve_class("tp_reject:Reject", PLUGINS)
    assert cls.__name__ == "Reject"
    assert issubclass(cls, ProduceRequestInterceptor)
    assert Path(sys.modules[cls.__module__].__file__ or "") == PLUGINS / "tp_reject.py"


def test_plugin_package_in_the_plugins_dir() -> None:
    plugin = load_interceptor("tp_package:Shout", PLUGINS, {"suffix": "?"})
    module = sys.modules[type(plugin).__module__]
    assert Path(module.__file__ or "") == PLUGINS / "tp_package" / "__init__.py"
    batch = RecordBatch(topic="t", partition=0, records=(Record(value=b"hi"), Record()))
    out = plugin.intercept(batch, None)
    assert [r.value for r in out.records] == [b"HI?", None]  # its submodule was imported


def test_submodule_of_a_plugin_package() -> None:
    # MODULE may be dotted: tp_package.shout is a module of the package (no class Shout).
    with pytest.raises(PluginLoadError, match="has no class 'Shout'"):
        resolve_class("tp_package.shout:Shout", PLUGINS)


def test_plugins_can_import_their_siblings() -> None:
    # tp_raise does `from tp_common import topic_pattern`: the dir goes on sys.path.
    cls = resolve_class("tp_raise:Raise", PLUGINS)
    assert cls.__name__ == "Raise"
    assert str(PLUGINS) in sys.path


def test_the_plugins_dir_comes_before_sys_path(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    on_path, plugins = tmp_path / "site", tmp_path / "plugins"
    _write(on_path, "shadow_mod.py", _SHADOW.format(origin="sys.path"))
    _write(plugins, "shadow_mod.py", _SHADOW.format(origin="plugins dir"))
    monkeypatch.syspath_prepend(str(on_path))

    # sys.path alone, and a plugins dir without the module: the installed one.
    assert resolve_class("shadow_mod:Which").origin == "sys.path"
    sys.modules.pop("shadow_mod", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve_class("shadow_mod:Which", empty).origin == "sys.path"
    sys.modules.pop("shadow_mod", None)
    # A plugins dir that has it: the plugins dir's, although the other is importable.
    assert resolve_class("shadow_mod:Which", plugins).origin == "plugins dir"


def test_plugins_dir_package_comes_before_sys_path(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    on_path, plugins = tmp_path / "site", tmp_path / "plugins"
    _write(on_path, "shadow_pkg.py", _SHADOW.format(origin="sys.path"))
    _write(plugins, "shadow_pkg/__init__.py", _SHADOW.format(origin="plugins package"))
    monkeypatch.syspath_prepend(str(on_path))
    assert resolve_class("shadow_pkg:Which", plugins).origin == "plugins package"


def test_installed_module_when_the_plugins_dir_does_not_have_it() -> None:
    assert resolve_class("kiproxy.interceptors.builtin.uppercase:Uppercase", PLUGINS) is Uppercase
    assert resolve_class("kiproxy.interceptors.builtin.uppercase:Uppercase") is Uppercase


def test_the_plugins_dir_comes_before_entry_points(tmp_path: Path) -> None:
    # A plugins-dir module called `uppercase` wins over the entry point of that name.
    _write(tmp_path, "uppercase.py", _SHADOW.replace("Which", "Uppercase")
           .format(origin="plugins dir"))
    try:
        cls = resolve_class("uppercase:Uppercase", tmp_path)
        assert cls is not Uppercase
        assert cls.origin == "plugins dir"
    finally:
        sys.modules.pop("uppercase", None)


def test_entry_point_by_name() -> None:
    names = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert names.get("uppercase") == "kiproxy.interceptors.builtin.uppercase:Uppercase"
    assert resolve_class("uppercase") is Uppercase
    assert resolve_class("uppercase", PLUGINS) is Uppercase
    plugin = load_interceptor("uppercase", None, {"keys": True})
    assert isinstance(plugin, Uppercase) and plugin.keys is True


def _fake_distribution(root: Path, entry_points_txt: str) -> None:
    dist = root / "kiproxy_test_plugins-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kiproxy-test-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points_txt))


def test_entry_point_of_another_distribution(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "tp_installed.py", _SHADOW.replace("Which", "Installed")
           .format(origin="distribution"))
    _fake_distribution(tmp_path, f"""
        [{ENTRY_POINT_GROUP}]
        installed-plugin = tp_installed:Installed
        broken-plugin = tp_no_such_module_xyz:Nope
        not-a-class = tp_installed:Installed.origin
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_class("installed-plugin").origin == "distribution"

    with pytest.raises(PluginLoadError) as info:
        resolve_class("broken-plugin")
    message = str(info.value)
    assert "broken-plugin" in message and "tp_no_such_module_xyz" in message

    with pytest.raises(PluginLoadError, match="not a class"):
        resolve_class("not-a-class")


# ---------------------------------------------------------------------------- errors


def test_missing_module() -> None:
    with pytest.raises(PluginLoadError) as info:
        resolve_class("tp_no_such_plugin:Thing", PLUGINS)
    message = str(info.value)
    assert "tp_no_such_plugin" in message and "not found" in message
    for place in ("plugins dir", "sys.path", "entry points"):
        assert place in message, message
    assert str(PLUGINS) in message


def test_unknown_bare_name() -> None:
    with pytest.raises(PluginLoadError) as info:
        resolve_class("no-such-entry-point")
    assert "no-such-entry-point" in str(info.value)
    assert ENTRY_POINT_GROUP in str(info.value)


def test_missing_class_lists_what_the_module_defines() -> None:
    with pytest.raises(PluginLoadError) as info:
        resolve_class("tp_reject:Rejecter", PLUGINS)
    message = str(info.value)
    assert "'Rejecter'" in message
    assert "tp_reject.py" in message
    assert "defines: Reject" in message
    with pytest.raises(PluginLoadError, match=r"has no class 'Nope'.*defines: Uppercase"):
        resolve_class("kiproxy.interceptors.builtin.uppercase:Nope")


def test_class_that_is_not_an_interceptor() -> None:
    with pytest.raises(PluginLoadError) as info:
        resolve_class("tp_not_api:NotAnInterceptor", PLUGINS)
    message = str(info.value)
    assert "tp_not_api:NotAnInterceptor" in message
    assert "does not implement the interceptor API" in message
    assert "intercept" in message


def test_subclass_without_intercept() -> None:
    with pytest.raises(PluginLoadError, match="missing intercept"):
        resolve_class("tp_not_api:AbstractOnly", PLUGINS)


def test_not_a_class() -> None:
    with pytest.raises(PluginLoadError, match="tp_not_api:NOT_A_CLASS is a str, not a class"):
        resolve_class("tp_not_api:NOT_A_CLASS", PLUGINS)


def test_duck_typed_class_with_intercept_is_accepted() -> None:
    plugin = load_interceptor("tp_duck:Duck", PLUGINS)
    assert not isinstance(plugin, ProduceRequestInterceptor)
    batch = RecordBatch(topic="t", partition=0, records=(Record(value=b"abc"),))
    assert [r.value for r in plugin.intercept(batch, None).records] == [b"cba"]


def test_configure_raising() -> None:
    with pytest.raises(PluginLoadError) as info:
        load_interceptor("tp_bad_configure:BadConfigure", PLUGINS, {"limit": -1})
    message = str(info.value)
    assert "tp_bad_configure:BadConfigure.configure() failed" in message
    assert "ValueError" in message and "'limit' must be a positive integer, got -1" in message
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("where", ["module", "init", "configure"])
def test_a_plugin_calling_sys_exit_while_loading_is_a_load_error(tmp_path: Path,
                                                                  where: str) -> None:
    # A reload that loads it must fail as any other broken plugin, not stop the proxy.
    exits = {where: '__import__("sys").exit("plugin exits")'}
    (tmp_path / "exits_on_load.py").write_text(f"""
from kiproxy.interceptors import ProduceRequestInterceptor
{exits.get("module", "")}

class Exits(ProduceRequestInterceptor):
    def __init__(self):
        {exits.get("init", "pass")}

    def configure(self, config):
        {exits.get("configure", "pass")}

    def intercept(self, batch, ctx):
        return batch
""")
    with pytest.raises(PluginLoadError, match="SystemExit: plugin exits"):
        load_interceptor("exits_on_load:Exits", tmp_path)


@pytest.mark.parametrize(("cls", "method"), [("AsyncConfigure", "configure"),
                                             ("AsyncAcknowledgement", "on_acknowledgement")])
def test_an_async_hook_the_proxy_does_not_await_is_refused(
        cls: str, method: str, recwarn: pytest.WarningsRecorder) -> None:
    """Called as a plain method it only made a coroutine: an async configure's settings
    were silently never applied (the plugin ran with its defaults), an async
    on_acknowledgement never ran."""
    with pytest.raises(PluginLoadError) as info:
        load_interceptor(f"tp_bad_configure:{cls}", PLUGINS, {"prefix": "P-"})
    assert str(info.value).startswith(
        f"tp_bad_configure:{cls}.{method}() is async; it must be a plain def")
    assert [str(w.message) for w in recwarn] == []  # no "never awaited" besides


def test_constructor_raising() -> None:
    with pytest.raises(PluginLoadError) as info:
        load_interceptor("tp_bad_configure:BadInit", PLUGINS)
    message = str(info.value)
    assert "creating tp_bad_configure:BadInit failed" in message
    assert "RuntimeError" in message and "licence file" in message


def test_syntax_error_in_a_plugin(tmp_path: Path) -> None:
    _write(tmp_path, "syntax_broken.py", """
        from kiproxy.interceptors import ProduceRequestInterceptor

        class Broken(ProduceRequestInterceptor):
            def intercept(self, batch, ctx:
                return batch
    """)
    with pytest.raises(PluginLoadError) as info:
        resolve_class("syntax_broken:Broken", tmp_path)
    message = str(info.value)
    assert "syntax_broken" in message
    assert "SyntaxError" in message
    assert "syntax_broken.py" in message and "line 5" in message
    assert "syntax_broken" not in sys.modules  # no half-imported module is left behind


def test_syntax_error_in_an_installed_module(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "syntax_installed.py", "def broken(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginLoadError) as info:
        resolve_class("syntax_installed:Broken")
    message = str(info.value)
    assert "importing interceptor module 'syntax_installed' failed" in message
    assert "SyntaxError" in message and "line 1" in message


def test_plugin_whose_import_fails_names_the_missing_dependency(tmp_path: Path) -> None:
    _write(tmp_path, "needs_dep.py", "import tp_dependency_that_is_missing\n")
    with pytest.raises(PluginLoadError) as info:
        resolve_class("needs_dep:Plugin", tmp_path)
    message = str(info.value)
    assert "needs_dep" in message
    assert "ModuleNotFoundError" in message and "tp_dependency_that_is_missing" in message


@pytest.mark.parametrize("missing", ["needs", "needs_dependency", "needs_dependency_lib_xyz"])
def test_installed_module_whose_import_fails_is_not_reported_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """A module that exists but imports something missing must say so, not "not found" -
    even when the missing name is a prefix of the module's own name."""
    _write(tmp_path, "needs_dependency_lib.py", f"import {missing}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginLoadError) as info:
        resolve_class("needs_dependency_lib:Plugin")
    message = str(info.value)
    assert "ModuleNotFoundError" in message and f"'{missing}'" in message, message
    assert "not found (looked in" not in message


def test_missing_plugins_dir(tmp_path: Path) -> None:
    with pytest.raises(PluginLoadError, match=r"plugins dir .*nowhere does not exist"):
        resolve_class("tp_reject:Reject", tmp_path / "nowhere")


def test_load_interceptor_configures_it() -> None:
    plugin = load_interceptor("tp_reject:Reject", PLUGINS,
                              {"topics": "audit\\..*", "error": "INVALID_RECORD",
                               "message": "read-only"})
    assert plugin.pattern.pattern == "audit\\..*"
    assert (plugin.error, plugin.message) == ("INVALID_RECORD", "read-only")


def test_a_composite_gets_a_factory_for_its_plugins_dir() -> None:
    # No global state: a chain loaded from PLUGINS finds its links there too.
    chain = load_interceptor("chain", PLUGINS, {"links": ["tp_reject:Reject"]})
    [(spec, link)] = chain.links
    assert (spec, type(link).__name__) == ("tp_reject:Reject", "Reject")
    assert type(link).__module__ == "tp_reject"


def test_configure_gets_a_copy_of_the_config() -> None:
    config = {"topics": "x"}
    plugin = load_interceptor("tp_reject:Reject", PLUGINS, config)
    assert plugin.pattern.pattern == "x"
    assert config == {"topics": "x"}
    assert load_interceptor("tp_reject:Reject", PLUGINS).pattern.pattern == ".*"  # no config


# ---------------------------------------------------------------------------- misspellings


def test_a_misspelt_built_in_gets_the_closest_name_and_the_list() -> None:
    with pytest.raises(PluginLoadError) as caught:
        resolve_class("uppercas")
    names = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
    assert str(caught.value) == (
        "interceptor 'uppercas' is not MODULE:CLASS nor a known name (did you mean "
        "'uppercase'?); known names (the built-ins and the entry points of group "
        f"'kiproxy.interceptors'): {', '.join(names)}")
    assert "uppercase" in names and "json_schema" in names


def test_a_name_like_no_built_in_gets_the_list_only() -> None:
    with pytest.raises(PluginLoadError) as caught:
        resolve_class("zzzzqqqq")
    assert "did you mean" not in str(caught.value)
    assert "known names (the built-ins" in str(caught.value)


def test_a_misspelt_module_of_the_plugins_dir_gets_the_closest_module(tmp_path: Path) -> None:
    (tmp_path / "mask_card_numbers.py").write_text("class MaskCardNumbers: ...\n")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "__init__.py").write_text("")
    with pytest.raises(PluginLoadError) as caught:
        resolve_class("mask_card_numbrs:MaskCardNumbers", tmp_path)
    assert str(caught.value) == (
        "interceptor module 'mask_card_numbrs' not found (looked in: plugins dir "
        f"{tmp_path}, sys.path, entry points (kiproxy.interceptors)); did you mean "
        "'mask_card_numbers'?")
    with pytest.raises(PluginLoadError, match=r"did you mean 'policies'\?$"):
        resolve_class("policy:Policy", tmp_path)


def test_a_misspelt_class_gets_the_closest_class(tmp_path: Path) -> None:
    (tmp_path / "masking.py").write_text("class MaskCardNumbers: ...\nclass Other: ...\n")
    with pytest.raises(PluginLoadError) as caught:
        resolve_class("masking:MaskCardNumber", tmp_path)
    assert str(caught.value).endswith(
        "has no class 'MaskCardNumber' (did you mean 'MaskCardNumbers'?); it defines: "
        "MaskCardNumbers, Other")
