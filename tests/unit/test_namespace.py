"""One import namespace: everything the project installs is under ``kiproxy``.

The repository keeps its top-level folders (``protocol/``, ``interceptors/``,
``proxy/``, ``pipelines/``); installed, and imported by the project's own code,
they are ``kiproxy.protocol`` and so on. No module may be reachable under two
names, so nothing may import the bare folder names.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import runtime_env

ROOT = Path(__file__).resolve().parents[2]
BARE = ("proxy", "protocol", "interceptors", "pipelines")
OLD_MODULE_RUNS = tuple(f"-m {name}" for name in ("proxy", "pipelines")) + tuple(
    f'"-m", "{name}' for name in ("proxy", "pipelines"))
SOURCE_DIRS = ("kiproxy", "protocol", "interceptors", "proxy", "pipelines", "dev", "tests",
               "bench", "plugins", "examples", "deploy")


def _python_files() -> list[Path]:
    files = [ROOT / "setup.py"]
    for name in SOURCE_DIRS:
        base = ROOT / name
        if name == "kiproxy":
            files += sorted(p for p in base.glob("*.py"))  # the rest are links to the folders
            continue
        files += sorted(base.rglob("*.py"))
    return [f for f in files if ".venv" not in f.parts]


def _bare_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                  for n in names if n.split(".")[0] in BARE]
    return found


def test_no_module_imports_a_bare_top_level_name() -> None:
    offenders = [line for path in _python_files() for line in _bare_imports(path)]
    assert offenders == []


def test_no_python_dash_m_of_an_old_module_path() -> None:
    texts = [p for p in _python_files()] + [ROOT / "Makefile", ROOT / "Dockerfile",
                                             ROOT / "README.md"]
    offenders = []
    for path in texts:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for old in OLD_MODULE_RUNS:
                if old in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_importing_the_project_loads_no_top_level_folder_module(tmp_path: Path) -> None:
    # A fresh interpreter outside the repository, so the working directory adds nothing.
    code = """
import json, pkgutil, sys, importlib
import kiproxy
loaded = []
for info in pkgutil.walk_packages(kiproxy.__path__, "kiproxy."):
    importlib.import_module(info.name)
    loaded.append(info.name)
print(json.dumps({"loaded": loaded, "modules": sorted(sys.modules)}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "kiproxy.proxy.server" in result["loaded"]
    assert "kiproxy.protocol._codec" in result["loaded"]
    assert "kiproxy.pipelines.replay" in result["loaded"]
    assert [m for m in result["modules"] if m.split(".")[0] in BARE] == []


def test_the_compiled_codec_is_kiproxy_protocol_codec() -> None:
    from kiproxy.protocol import _codec

    assert _codec.__name__ == "kiproxy.protocol._codec"
    assert Path(_codec.__file__ or "").suffix in (".so", ".pyd")


def test_version_is_the_distribution_version() -> None:
    from importlib.metadata import version

    import kiproxy

    assert kiproxy.__version__ == version("kafka-interceptor-proxy")
    done = subprocess.run([sys.executable, "-m", "kiproxy", "--version"], capture_output=True,
                          text=True, timeout=60, check=True, env=runtime_env())
    assert done.stdout.strip() == f"kiproxy {kiproxy.__version__}"


@pytest.mark.parametrize("name", ["uppercase", "json_schema", "stamp_headers", "topic_router",
                                  "chain", "wasm", "paper_trail", "trace_context", "signer",
                                  "signature_verifier", "header_token_authorizer", "pii_masker"])
def test_every_builtin_has_a_short_entry_point_name(name: str) -> None:
    from importlib.metadata import entry_points

    from kiproxy.interceptors.loader import ENTRY_POINT_GROUP, resolve_class

    points = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert points[name].startswith("kiproxy.interceptors.builtin.")
    module, _, cls = points[name].partition(":")
    assert resolve_class(name).__name__ == cls
    # The class the entry point names (a package, wasm/, exports it from a submodule).
    assert getattr(importlib.import_module(module), cls) is resolve_class(name)


def test_every_builtin_interceptor_class_is_registered() -> None:
    from importlib.metadata import entry_points

    from kiproxy.interceptors.api import ProduceRequestInterceptor
    from kiproxy.interceptors.loader import ENTRY_POINT_GROUP

    registered = {ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    public = set()
    builtin = ROOT / "interceptors" / "builtin"
    # A built-in is a module, or a package (wasm/) whose classes its __init__ exports.
    names = [p.stem for p in builtin.glob("[a-z]*.py")] + \
        [p.parent.name for p in builtin.glob("[a-z]*/__init__.py")]
    for stem in sorted(names):
        module = f"kiproxy.interceptors.builtin.{stem}"
        mod = __import__(module, fromlist=["_"])
        for name, value in vars(mod).items():
            if (isinstance(value, type) and issubclass(value, ProduceRequestInterceptor)
                    and (value.__module__ == module
                         or value.__module__.startswith(module + "."))
                    and not name.startswith("_")):
                public.add(f"{module}:{name}")
    assert public - registered == set()


def test_an_old_dotted_name_is_refused_with_the_new_name() -> None:
    from kiproxy.interceptors.loader import PluginLoadError, load_interceptor

    with pytest.raises(PluginLoadError) as err:
        load_interceptor("interceptors.builtin.uppercase:Uppercase")
    assert str(err.value) == (
        "'interceptors.builtin.uppercase:Uppercase' is an old name: the built-ins are now "
        "under the kiproxy namespace, so write "
        "'kiproxy.interceptors.builtin.uppercase:Uppercase' (or its short entry-point name)")


def test_a_bare_entry_point_name_is_a_valid_interceptor_setting() -> None:
    from kiproxy.proxy.config.model import ConfigError, load_config

    config = load_config(None, {"upstream": ["127.0.0.1:9092"], "interceptor.class": "uppercase"})
    assert config.interceptor.class_name == "uppercase"
    with pytest.raises(ConfigError, match="MODULE:CLASS or an entry-point name"):
        load_config(None, {"upstream": ["127.0.0.1:9092"], "interceptor.class": "a:b:c"})


def test_the_isolation_fork_server_preloads_modules_by_their_kiproxy_names() -> None:
    import importlib

    from kiproxy.proxy.isolation.process import preload as _preload

    names = [n for n in _preload() if n != "__main__"]
    assert "kiproxy.proxy.isolation.pool" in names
    for name in names:
        assert name.split(".")[0] not in BARE
        importlib.import_module(name)
