"""The Rust recipe (examples/wasm/rust/uppercase.rs) builds and runs with ``module:`` alone.

Compiled with plain ``rustc`` for ``wasm32-unknown-unknown`` (no crates, no
network). Skipped, saying why, where the Rust toolchain or that target is not
installed (``rustup target add wasm32-unknown-unknown``). TinyGo is not
installable here (no Debian package, none on PyPI or npm, and its release
binaries cannot be downloaded), so its recipe in docs/wasm.md is not built by
the tests.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kiproxy.interceptors.testing import load, make_batch, make_record

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "wasm" / "rust" / "uppercase.rs"
TARGET = "wasm32-unknown-unknown"


def _wasm_target_missing() -> str | None:
    if shutil.which("rustc") is None:
        return "rustc is not installed"
    done = subprocess.run(["rustc", "--print", "target-libdir", "--target", TARGET],
                          capture_output=True, text=True, timeout=60)
    libdir = Path(done.stdout.strip())
    if done.returncode != 0 or not libdir.is_dir() or not any(libdir.glob("libstd-*")):
        return f"the Rust target {TARGET} is not installed (rustup target add {TARGET})"
    return None


@pytest.fixture(scope="module")
def rust_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = _wasm_target_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("rust") / "uppercase.wasm"
    done = subprocess.run(["rustc", "--edition", "2021", "--target", TARGET, "--crate-type",
                           "cdylib", "-O", str(RECIPE), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def test_the_rust_recipe_upper_cases_values_given_only_its_path(rust_module: Path) -> None:
    records = [make_record("hello", key="k", headers=[("h", "v")]), make_record(None),
               make_record("ALREADY"), make_record(b"\xff\xfe bytes")]
    with load("wasm", config={"module": str(rust_module), "threaded": False}) as plugin:
        outcome = plugin.run(make_batch(*records))
    assert outcome.kind == "transformed"
    assert outcome.values == [b"HELLO", None, b"ALREADY", b"\xff\xfe BYTES"]
    assert [(r.key, r.headers, r.timestamp) for r in outcome.records] == \
        [(r.key, r.headers, r.timestamp) for r in records]
