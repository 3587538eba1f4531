"""The documentation site builds, the configuration reference is current, the README is short.

``make test`` runs this: ``mkdocs build --strict`` fails on a broken link, a
missing anchor or a page that is not in the nav; the configuration reference
(``docs/configuration.md``) and the built-ins' settings reference
(``docs/builtin-settings.md``) must be what ``docs/gen_config_reference.py``
writes from the models today.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from kiproxy import __version__
from kiproxy.proxy.config.model import ProxyConfig

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_current_model() -> None:
    generator = _generator()
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        f"docs/configuration.md is stale: regenerate it with {generator.REGENERATE} "
        "and commit the result")


def test_builtin_settings_reference_is_generated_from_the_current_models() -> None:
    generator = _generator()
    committed = (ROOT / "docs" / "builtin-settings.md").read_text(encoding="utf-8")
    assert committed == generator.render_builtins(), (
        f"docs/builtin-settings.md is stale: regenerate it with {generator.REGENERATE} "
        "and commit the result")
    for name in ("pii_masker", "json_schema", "signer", "chain", "topic_router"):
        assert f"## `{name}`" in committed, name


def _leaf_keys(model: type[object], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        path = f"{prefix}{info.alias or name}"
        keys.append(path)
        annotation = info.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            keys += _leaf_keys(annotation, f"{path}.")
    return keys


def test_configuration_reference_lists_every_key_and_its_flag() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for key in _leaf_keys(ProxyConfig):
        assert f"| `{key}` |" in page, key
    # A key that has a flag shows it (the old README table had no `workers` row at all).
    assert re.search(r"^\| `workers` \|.*`--workers N`", page, re.MULTILINE)
    assert re.search(r"^\| `interceptor.workers` \|.*`--interceptor-workers N`", page,
                     re.MULTILINE)


def test_site_builds_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_every_page_is_in_the_nav() -> None:
    mkdocs_yml = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    missing = [p for p in pages if f": {p}" not in mkdocs_yml]
    assert missing == [], f"list these pages under nav in mkdocs.yml: {missing}"


def test_readme_is_short_and_has_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    assert "make run" in readme and "make test" in readme


@pytest.mark.parametrize("document", ["README.md", "CHANGELOG.md"])
def test_relative_links_resolve(document: str) -> None:
    text = (ROOT / document).read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        if not (ROOT / target).exists():
            broken.append(target)
    assert broken == []


def test_changelog_starts_at_this_release() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = [r for r in re.findall(r"^## \[([^\]]+)\]", changelog, re.MULTILINE)
                if r != "Unreleased"]  # Keep a Changelog: changes not yet released go first
    assert releases[0] == __version__, "add the release to CHANGELOG.md"
    assert "0.1.0" in releases


def test_readme_lists_every_extra_and_what_all_holds() -> None:
    """The README's extras are pyproject.toml's, and `[all]` is every extra listed before it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = re.findall(r"`\[([\w-]+)\]`", readme)
    assert set(extras) - {"test", "docs"} <= set(named), "the README's list of extras"
    (inner,) = re.findall(r"\[([\w,-]+)\]", extras["all"][0])
    before_all = named[:named.index("all")]
    assert set(inner.split(",")) == set(before_all), (
        "the README says `[all]` holds every extra listed before it; pyproject.toml's `all` "
        f"holds {inner}, the README lists {before_all}")
