"""deploy/image.py (`make image`, `make kafka-image`) agrees with the files it builds from.

The registry images it tries first are the Dockerfile's and docker-compose.yml's
defaults, and the project image's tag changes with any file of the build context
(so a changed tree is rebuilt and an unchanged one reused) but not with files the
``.dockerignore`` keeps out.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def image_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_image", ROOT / "deploy" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_registry_images_are_the_dockerfile_and_compose_defaults(image_py: ModuleType) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert default and f"docker.io/library/{default.group(1)}" == image_py.REGISTRY_PYTHON
    compose = (ROOT / "docker-compose.yml").read_text()
    kafka = set(re.findall(r"image: \$\{KAFKA_IMAGE:-([^}]+)\}", compose))
    assert {f"docker.io/{k}" for k in kafka} == {image_py.OFFICIAL_KAFKA}


def test_the_tag_follows_the_build_context(image_py: ModuleType, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("Dockerfile", "pyproject.toml", "proxy/server.py", "tests/t.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(image_py, "ROOT", tmp_path)
    first = image_py.context_hash("base")
    assert image_py.context_hash("base") == first
    (tmp_path / "tests/t.py").write_text("changed")  # not in the build context
    assert image_py.context_hash("base") == first
    assert image_py.context_hash("other-base") != first
    (tmp_path / "proxy/server.py").write_text("changed")
    assert image_py.context_hash("base") != first
