"""The README's and the documentation's examples work as written.

A fenced code block is tested according to the HTML comment on the line above it:

- ``<!-- test: run -->`` (``sh`` or ``python``): executed as written, from the
  repository root, with ``kiproxy`` on ``PATH``. Blocks that name the quickstart
  address ``127.0.0.1:9192`` run against ``kiproxy dev --plugins-dir plugins
  --interceptor mask_card_numbers:MaskCardNumbers`` (what ``make run`` starts),
  which this test starts on that address when it is free. When it is taken, the
  proxy listens on a free port instead and that one substitution - the address
  it printed for ``127.0.0.1:9192`` - is the only change made to the block.
  ``expect="TEXT"`` in the marker: TEXT must be in the block's output.
- ``<!-- test: plugin -->`` (``python``): the module is dropped into a plugins
  directory, each interceptor or observer class it defines is loaded by the
  proxy's loader and configured (``config={...}`` in the marker), and every
  interceptor runs over sample batches: it must return a batch with as many
  records or raise ``RejectBatch``.
- ``<!-- test: config -->`` (``yaml``): validated by the config model
  (``kiproxy.proxy.config.model.load_config``); ``config load`` also loads and
  configures its interceptor.
- ``<!-- test: skip REASON -->``: not executed, for the reason given.

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
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiproxy.cli import build_parser
from kiproxy.interceptors import Header, InterceptContext, Record, RecordBatch, RejectBatch
from kiproxy.interceptors.loader import load_interceptor, load_observer
from kiproxy.proxy.config.model import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICKSTART_ADDRESS = "127.0.0.1:9192"
DEV_COMMAND = ["dev", "--plugins-dir", "plugins", "--interceptor",
               "mask_card_numbers:MaskCardNumbers"]
CHECKED_LANGUAGES = {"sh", "python", "yaml"}
MARKER = re.compile(r"<!--\s*test:\s*(?P<kind>run|plugin|config load|config|skip)\b"
                    r"(?P<args>.*?)-->")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with its test marker (if any)."""

    page: Path
    line: int
    language: str
    code: str
    kind: str | None
    args: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def arg(self, name: str) -> str | None:
        """A ``name="value"`` or ``name={json}`` argument of the marker."""
        found = re.search(rf'{name}=("(?P<q>[^"]*)"|(?P<j>\{{.*\}}))', self.args)
        if found is None:
            return None
        return found.group("q") if found.group("q") is not None else found.group("j")


def _include_snippets(code: str) -> str:
    lines = []
    for line in code.splitlines():
        found = SNIPPET.match(line.strip())
        lines.append((ROOT / found.group("path")).read_text().rstrip("\n") if found else line)
    return "\n".join(lines) + "\n"


def blocks(page: Path) -> Iterator[Block]:
    """The fenced blocks of ``page``, top to bottom."""
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\w*)", lines[i])
        if fence is None:
            i += 1
            continue
        start, language = i, fence.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(above)
        yield Block(page=page, line=start + 1, language=language,
                    code=_include_snippets("\n".join(lines[start + 1:end])),
                    kind=marker.group("kind") if marker else None,
                    args=marker.group("args") if marker else "")
        i = end + 1


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


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


def test_skipped_blocks_give_a_reason() -> None:
    bare = [b.id for b in _of("skip") if len(b.args.strip()) < 10]
    assert bare == [], f"say why these blocks are not run: {bare}"


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


def _port_free(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def quickstart_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kiproxy dev`` as ``make run`` starts it; yields the bootstrap address it printed."""
    extra = [] if _port_free(QUICKSTART_ADDRESS) else ["--listen", "127.0.0.1:0"]
    log = tmp_path_factory.mktemp("quickstart") / "kiproxy.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kiproxy", *DEV_COMMAND, *extra],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        address = None
        deadline = time.monotonic() + 90
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            found = re.match(r"kiproxy: bootstrap address (\S+)", line)
            address = found.group(1) if found else None
        assert address is not None, f"kiproxy dev did not start: {log.read_text()[-2000:]}"
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("block", _params(_of("run")))
def test_run_blocks_work_as_written(block: Block, request: pytest.FixtureRequest) -> None:
    code = block.code
    if QUICKSTART_ADDRESS in code:
        address = request.getfixturevalue("quickstart_proxy")
        code = code.replace(QUICKSTART_ADDRESS, address)  # the one substitution (see above)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if block.language == "python":
        argv = [sys.executable, "-c", code]
    elif block.language == "sh":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        pytest.fail(f"{block.id}: `test: run` needs a python or sh block")
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"
    expected = block.arg("expect")
    if expected is not None:
        assert expected in done.stdout, f"{block.id}: {expected!r} not in {done.stdout!r}"


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
            for base in ("ProduceRequestInterceptor", "Observer"):
                if base in bases:
                    found.append((node.name, base))
    return found


@pytest.mark.parametrize("block", _params(_of("plugin", "python")))
async def test_plugin_examples_load_and_run_over_a_batch(block: Block, tmp_path: Path) -> None:
    named = re.match(r"#\s*plugins/(\w+)\.py", block.code)
    module = named.group(1) if named else f"doc_plugin_{block.line}"
    (tmp_path / f"{module}.py").write_text(block.code)
    config = json.loads(block.arg("config") or "{}")
    classes = _plugin_classes(block.code)
    assert classes, f"{block.id}: defines no ProduceRequestInterceptor or Observer subclass"
    for name, base in classes:
        spec = f"{module}:{name}"
        if base == "Observer":
            observer = load_observer(spec, str(tmp_path), config)
            observer.close()
            continue
        plugin = load_interceptor(spec, str(tmp_path), config)
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
