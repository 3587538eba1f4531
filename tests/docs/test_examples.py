"""The README's and the documentation's examples work as written.

A fenced code block is tested according to the HTML comment on the line above it
(parsed by ``tests/docs/doc_blocks.py``):

- ``<!-- test: run -->`` (``sh`` or ``python``): executed as written. On a page
  marked ``<!-- test: fresh-checkout -->`` (a line of its own before its first
  block) the page's ``run`` blocks run top to bottom in one fresh copy of the
  checkout, from a clean shell, as a new user would type them
  (``tests/docs/test_fresh_checkout.py``, which also documents ``run fails`` and
  ``run background``). On the other pages each ``run`` block runs on its own
  from the repository root with this checkout's ``kiproxy`` on ``PATH``.
  ``expect="TEXT"`` in the marker: TEXT must be in the block's output;
  ``timeout=SECONDS`` overrides the 120 s a block on such a page may take.
- ``<!-- test: plugin -->`` (``python``): the module is dropped into a plugins
  directory, each interceptor or observer class it defines is loaded by the
  proxy's loader and configured (``config={...}`` in the marker), and every
  interceptor runs over sample batches: it must return a batch with as many
  records or raise ``RejectBatch``.
- ``<!-- test: config -->`` (``yaml``): validated by the config model
  (``kiproxy.proxy.config.model.load_config``); ``config load`` also loads and
  configures its interceptor.
- ``<!-- test: skip REASON -->``: not executed. REASON names the test that runs
  the same command line as a pytest node id
  (``tests/containers/test_image.py::test_x``, which must exist), or begins with
  ``cannot run here:`` and says what the block needs that a CI machine with only
  the package registries cannot have (a cluster at the reader's address, a
  Docker engine, Kubernetes, a toolchain target none of the registries serves);
  ``tests/docs/doc_blocks.py`` states the rule. It holds for a skip marker on a
  block of any language.

Every ``sh``, ``python`` and ``yaml`` block must carry one of them, and every
``kiproxy`` command line in an ``sh`` block must parse with the real parser.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from doc_blocks import (
    ALL_BLOCKS,
    CHECKED_LANGUAGES,
    PAGE_MARKER,
    PAGES,
    ROOT,
    Block,
    is_fresh_checkout,
    page_marker_line,
    skip_reason_problem,
)

from kiproxy.cli import build_parser
from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    Header,
    InterceptContext,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.loader import load_interceptor, load_observer
from kiproxy.interceptors.testing import run_consume
from kiproxy.proxy.config.model import load_config


def _of(kind: str, *languages: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.kind == kind and (not languages or b.language in languages)]


def _params(found: list[Block]) -> list[object]:
    return [pytest.param(b, id=b.id) for b in found]


# ------------------------------------------------------------------------- markers


def test_every_runnable_language_block_says_how_it_is_tested() -> None:
    unmarked = [b.id for b in ALL_BLOCKS if b.language in CHECKED_LANGUAGES and b.kind is None]
    assert unmarked == [], (
        "add <!-- test: run | plugin | config | skip REASON --> above these blocks: "
        + ", ".join(unmarked))


def test_skip_reasons_name_a_test_or_say_why_it_cannot_run_here() -> None:
    wrong = {b.id: problem for b in _of("skip") if (problem := skip_reason_problem(b.args))}
    assert wrong == {}, f"these skip reasons are not of a kind doc_blocks.py allows: {wrong}"


@pytest.mark.parametrize(("reason", "problem"), [
    ("cannot run here: needs a Kafka cluster at kafka-1:9092", None),
    ("tests/unit/test_loader.py::test_entry_point_by_name runs it", None),
    ("cannot run here: see tests/unit/test_loader.py::test_entry_point_by_name", None),
    ("needs a running proxy", "name the test"),
    ("tests/unit/test_loader.py runs it", "a file is not enough"),
    ("cannot run here: slow", "say after"),
    ("tests/unit/test_loader.py::test_no_such_thing runs it", "defines no test_no_such_thing"),
    ("cannot run here: tests/unit/test_nothing.py::test_x does", "no such file"),
])
def test_the_skip_reason_rule(reason: str, problem: str | None) -> None:
    found = skip_reason_problem(reason)
    assert found is None if problem is None else (found is not None and problem in found), found


@pytest.mark.parametrize("page", [p for p in PAGES if is_fresh_checkout(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_fresh_checkout_marker_comes_before_the_first_block(page: Path) -> None:
    first = next((b.line for b in ALL_BLOCKS if b.page == page), None)
    marker = page_marker_line(page)
    assert marker is not None and (first is None or marker < first), (
        f"{page.name}: put {PAGE_MARKER} on a line of its own before the first block")


def test_background_blocks_are_on_fresh_checkout_pages() -> None:
    elsewhere = [b.id for b in _of("run") if b.flag("background")
                 and not is_fresh_checkout(b.page)]
    assert elsewhere == [], ("`run background` needs a page marked "
                             f"{PAGE_MARKER}: {elsewhere}")


def test_the_examples_cover_each_kind() -> None:
    # The README's quickstart and plugin are among the executed blocks.
    readme = [b for b in ALL_BLOCKS if b.page.name == "README.md"]
    assert {"run", "plugin"} <= {b.kind for b in readme}
    assert _of("config load")


def _command_lines(block: Block) -> Iterator[str]:
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("kiproxy ") and "..." not in shlex.split(line, comments=True):
            yield line


SH_COMMANDS = [(b, line) for b in ALL_BLOCKS if b.language == "sh" for line in _command_lines(b)]


@pytest.mark.parametrize(("block", "line"),
                         [pytest.param(b, c, id=f"{b.id}:{c[:40]}") for b, c in SH_COMMANDS])
def test_kiproxy_command_lines_parse(block: Block, line: str) -> None:
    argv = shlex.split(line, comments=True)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --version, --help
            return
        pytest.fail(f"{block.id}: `{line}` does not parse (exit {exc.code})")


# ------------------------------------------------------------------------- run


@pytest.mark.parametrize("block", _params([b for b in _of("run")
                                           if not is_fresh_checkout(b.page)]))
def test_run_blocks_work_as_written(block: Block) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language == "python":
        argv = [sys.executable, "-c", block.code]
    elif block.language == "sh":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        pytest.fail(f"{block.id}: `test: run` needs a python or sh block")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=float(block.arg("timeout") or 120))
    output = done.stdout + done.stderr
    if block.flag("fails"):
        assert done.returncode != 0, f"{block.id} exited 0; the page shows it failing"
    else:
        assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"
    expected = block.arg("expect")
    if expected is not None:
        assert expected in output, f"{block.id}: {expected!r} not in {output!r}"


# ------------------------------------------------------------------------- plugins


def _sample_batches() -> list[RecordBatch]:
    records = (
        Record(key=b"k1", value=b"card 4111 1111 1111 1111 paid, secret hunter2 password",
               headers=[Header("src", b"web")], timestamp=1_700_000_000_000),
        Record(key=None, value=b'{"id": 1, "kind": "order"}', timestamp=1_700_000_000_001,
               offset_delta=1),
        Record(key=b"k3", value=None, timestamp=1_700_000_000_002, offset_delta=2),
    )
    return [RecordBatch(topic=topic, partition=0, records=records)
            for topic in ("orders", "events", "audit.log")]


def _context() -> InterceptContext:
    return InterceptContext(client_id="docs", client_address="127.0.0.1:50000", principal=None,
                            api_version=11, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 5, received_at_ms=1_700_000_000_000,
                            proxy_host="docs")


def _plugin_classes(code: str) -> list[tuple[str, str]]:
    """``(class name, base name)`` of the interceptors and observers ``code`` defines."""
    found = []
    for node in ast.parse(code).body:
        if isinstance(node, ast.ClassDef):
            # A base may be parametrized by its settings model: Base[Settings].
            plain = [b.value if isinstance(b, ast.Subscript) else b for b in node.bases]
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                     for b in plain}
            for base in ("ProduceRequestInterceptor", "FetchResponseInterceptor", "Observer"):
                if base in bases:
                    found.append((node.name, base))
                    break
    return found


@pytest.mark.parametrize("block", _params(_of("plugin", "python")))
async def test_plugin_examples_load_and_run_over_a_batch(block: Block, tmp_path: Path) -> None:
    named = re.match(r"#\s*plugins/(\w+)\.py", block.code)
    module = named.group(1) if named else f"doc_plugin_{block.line}"
    (tmp_path / f"{module}.py").write_text(block.code)
    config = json.loads(block.arg("config") or "{}")
    classes = _plugin_classes(block.code)
    assert classes, f"{block.id}: defines no interceptor or observer subclass"
    for name, base in classes:
        spec = f"{module}:{name}"
        if base == "Observer":
            observer = load_observer(spec, str(tmp_path), config)
            observer.close()
            continue
        plugin = load_interceptor(spec, str(tmp_path), config)
        if callable(getattr(plugin, "on_consume", None)):
            await _consume_over_a_batch(block, spec, plugin)
        if not callable(getattr(plugin, "intercept", None)):
            continue
        outcomes = []
        for batch in _sample_batches():
            try:
                result = plugin.intercept(batch, _context())
                if inspect.isawaitable(result):
                    result = await result
            except RejectBatch as exc:
                outcomes.append(f"rejected: {exc.message}")
                continue
            assert isinstance(result, RecordBatch), f"{block.id}: {spec} returned {result!r}"
            assert len(result.records) == len(batch.records), f"{block.id}: record count"
            outcomes.append("transformed" if result.records != batch.records else "unchanged")
        assert any(not o.startswith("rejected") for o in outcomes), (block.id, outcomes)
        close = getattr(plugin, "close", None)
        if close is not None:
            close()


async def _consume_over_a_batch(block: Block, spec: str, plugin: Any) -> None:
    """A fetch-side hook runs over each sample batch as fetched, for two consumers, as the
    proxy runs it (``on_consume_block`` first, when it has one)."""
    for principal in (None, "auditor"):
        ctx = ConsumeContext(client_id="docs", client_address="127.0.0.1:50000",
                             principal=principal, api_version=17,
                             deadline=time.monotonic() + 5)
        for batch in _sample_batches():
            fetched = ConsumedBatch(topic=batch.topic, partition=0, base_offset=40,
                                    records=batch.records)
            result = run_consume(plugin, fetched, ctx, name=spec)  # block side first
            assert isinstance(result, ConsumedBatch), f"{block.id}: {spec} returned {result!r}"
            assert len(result.records) == len(fetched.records), f"{block.id}: record count"


# ------------------------------------------------------------------------- configs


@pytest.mark.parametrize("block", _params(_of("config", "yaml") + _of("config load", "yaml")))
def test_config_examples_validate(block: Block, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # relative paths in the examples are from the repository root
    path = tmp_path / "config.yaml"
    path.write_text(block.code)
    config = load_config(path, {})
    if block.kind == "config load":
        spec = config.interceptor.class_name
        assert spec is not None, f"{block.id}: `config load` needs interceptor.class"
        plugin = load_interceptor(spec, config.plugins_dir, config.interceptor.config)
        close = getattr(plugin, "close", None)
        if close is not None:
            close()
    # Every route's links load with the settings the block gives them: the built-ins
    # always, a plugin of the reader's own when the block names a plugins dir that has it
    # (a secret the block reads from the environment is the reader's: set here).
    for name in re.findall(r"\{env: (\w+)\}", block.code):
        monkeypatch.setenv(name, "s" * 32)
    links = [link for route in config.every_route for link in route.interceptors]
    for link in links:
        if not _loadable_here(link.class_name, config.plugins_dir):
            continue
        plugin = load_interceptor(link.class_name, config.plugins_dir, link.config)
        close = getattr(plugin, "close", None)
        if close is not None:
            close()


def _loadable_here(spec: str, plugins_dir: str | None) -> bool:
    """A built-in, or a module the block's own plugins dir holds."""
    module = spec.partition(":")[0]
    if module.startswith("kiproxy.") or ":" not in spec:
        return True
    return plugins_dir is not None and any(
        (Path(plugins_dir) / f"{module.replace('.', '/')}{suffix}").exists()
        for suffix in (".py", "/__init__.py"))
