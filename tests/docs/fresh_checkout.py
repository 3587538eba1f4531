"""A page's ``run`` blocks, executed top to bottom in one fresh copy of the checkout.

This is what a new user does with a page: clone the repository, open a shell
without any virtualenv, and type the blocks in order. :class:`Workspace` plays
that user:

- **The copy.** The files ``git ls-files`` lists (the index: what a commit of
  the checkout would hold), copied from the working tree, so uncommitted edits
  of tracked files are tested and untracked files are not (``git add`` a new
  file to have it there). Symbolic links stay links, modes are kept. The copy
  has no ``.git`` and no ``.venv``: nothing the checkout has built is in it.
- **The environment.** Each block starts from a clean one: only the variables
  a user's login shell would have (``HOME``, ``USER``, locale, ``PATH`` without
  any virtualenv's ``bin``) and the caches' settings (``PIP_*``, ``MAVEN_*``,
  ``KIPROXY_*``), so installs reuse pip's and Maven's caches under ``HOME``.
  Whatever ``make`` or a virtualenv set in the test process (``MAKEFLAGS``,
  ``VIRTUAL_ENV``, ``PYTHONPATH``) is not passed on.
- **One shell session across blocks.** Each block runs in a fresh
  ``bash -e -o pipefail``, after restoring the exported variables and the
  working directory the previous block left (``export -p`` and ``pwd`` are
  saved when a block exits), so ``. .venv/bin/activate``, ``export X=...`` and
  ``cd`` carry on, as in a terminal. Shell functions and aliases do not. A
  ``python`` block runs with the ``python`` then on ``PATH``.
- **Background blocks** (``run background ready="TEXT"``) start in their own
  process group with their output in a log; the page goes on once TEXT is in
  it (within ``timeout=`` seconds, 240 by default), and fails if the block
  exits first. At the end of the page each group gets SIGTERM, then SIGKILL
  after 20 seconds.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from doc_blocks import ROOT, Block

#: Variables a user's shell has, passed on as they are.
KEPT = {"HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR",
        "JAVA_HOME", "DOCKER_HOST", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "PYENV_ROOT", "PYENV_VERSION",
        "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"}
#: The caches' settings (pip's, Maven's, kiproxy's own: Kafka, the registry, the images).
KEPT_PREFIXES = ("LC_", "PIP_", "MAVEN_", "KIPROXY_")
BLOCK_TIMEOUT = 900.0
READY_TIMEOUT = 240.0
STOP_GRACE = 20.0
OUTPUT_SHOWN = 6000


class PageFailure(AssertionError):
    """A block of the page did not do what its marker says; the message says which and why."""


def clean_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a user's new shell would have: see the module docstring."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if k in KEPT or k.startswith(KEPT_PREFIXES)}
    path = [d for d in environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
            if d and not (Path(d).parent / "pyvenv.cfg").exists()]
    env["PATH"] = os.pathsep.join(path)
    env.setdefault("LANG", "C.UTF-8")
    return env


def copy_checkout(root: Path, dest: Path) -> Path:
    """The tracked files of ``root`` (as the working tree has them) copied into ``dest``."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True,
                            capture_output=True).stdout.decode().split("\0")
    dest.mkdir(parents=True)
    for name in filter(None, listed):
        source, target = root / name, dest / name
        if not source.is_symlink() and not source.exists():
            continue  # deleted in the working tree, not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


@dataclass
class _Background:
    block: Block
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Workspace:
    """One page's checkout copy and shell state; use as a context manager (stops background)."""

    root: Path
    state: Path
    env: dict[str, str]
    background: list[_Background] = field(default_factory=list)
    count: int = 0
    #: ``(block id, seconds, CPU seconds)`` of each block run (a background block: until it was
    #: ready, and its CPU is not counted: it is still running).
    timings: list[tuple[str, float, float]] = field(default_factory=list)

    @classmethod
    def create(cls, tmp: Path, env: dict[str, str] | None = None,
               source: Path = ROOT) -> Workspace:
        """A copy of ``source`` in ``tmp/kiproxy``, a shell state in ``tmp/state``."""
        root = copy_checkout(source, tmp / "kiproxy")
        state = tmp / "state"
        state.mkdir()
        env = clean_environment() if env is None else env
        exported = subprocess.run(["bash", "-c", "export -p"], env=env, check=True,
                                  capture_output=True, text=True).stdout
        (state / "env").write_text(exported)
        (state / "cwd").write_text(f"{root}\n")
        return cls(root=root, state=state, env=env)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_background()

    # ------------------------------------------------------------------ scripts

    def _script(self, block: Block, save_state: bool) -> Path:
        self.count += 1
        name = f"block-{self.count}"
        prologue = [
            # Only what the previous block exported, then its directory.
            'for _v in $(compgen -e); do unset "$_v" 2>/dev/null || true; done',
            f"source {self.state}/env",
            f'cd "$(cat {self.state}/cwd)"',
        ]
        if save_state:
            prologue.append(f"trap 'export -p > {self.state}/env; pwd > {self.state}/cwd' EXIT")
        if block.language == "python":
            code_file = self.state / f"{name}.py"
            code_file.write_text(block.code)
            body = f"python {code_file}\n"
        elif block.language == "sh":
            body = block.code
        else:
            raise PageFailure(f"{block.id}: `test: run` needs a python or sh block, "
                              f"not {block.language or 'an unnamed'} one")
        script = self.state / f"{name}.sh"
        script.write_text("\n".join(prologue) + "\n" + body)
        return script

    def _argv(self, script: Path) -> list[str]:
        return ["bash", "-e", "-o", "pipefail", str(script)]

    # ------------------------------------------------------------------ running

    def run(self, block: Block) -> str:
        """Run ``block`` as its marker says; its output, or :class:`PageFailure`."""
        started, cpu = time.monotonic(), _children_cpu()
        try:
            return self._run(block)
        finally:
            self.timings.append((block.id, time.monotonic() - started, _children_cpu() - cpu))

    def _run(self, block: Block) -> str:
        if block.flag("background"):
            self._start_background(block)
            return ""
        timeout = float(block.arg("timeout") or BLOCK_TIMEOUT)
        log = self.state / f"block-{self.count + 1}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(self._argv(self._script(block, save_state=True)),
                                       env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()
            raise PageFailure(self._report(block, f"did not finish within {timeout:.0f} s",
                                           _text(log.read_bytes()))) from None
        # What the block left running stops with it: long-lived processes are `run background`.
        _signal_group(process, signal.SIGTERM)
        output = _text(log.read_bytes())
        expected = block.arg("expect")
        if block.flag("fails"):
            if returncode == 0:
                raise PageFailure(self._report(block, "exited 0 but the page shows it failing",
                                               output))
        elif returncode != 0:
            raise PageFailure(self._report(block, f"exited {returncode}", output))
        if expected is not None and expected not in output:
            raise PageFailure(self._report(block, f"{expected!r} is not in its output", output))
        return output

    def _start_background(self, block: Block) -> None:
        ready = block.arg("ready")
        if ready is None:
            raise PageFailure(f'{block.id}: `run background` needs ready="TEXT" (what it '
                              "prints once the next blocks can use it)")
        timeout = float(block.arg("timeout") or READY_TIMEOUT)
        log = self.state / f"background-{self.count + 1}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(self._argv(self._script(block, save_state=False)),
                                       env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        running = _Background(block, process, log)
        self.background.append(running)
        deadline = time.monotonic() + timeout
        while ready not in _text(log.read_bytes()):
            if process.poll() is not None:
                raise PageFailure(self._report(
                    block, f"exited {process.returncode} before printing {ready!r}",
                    _text(log.read_bytes())))
            if time.monotonic() > deadline:
                raise PageFailure(self._report(
                    block, f"did not print {ready!r} within {timeout:.0f} s",
                    _text(log.read_bytes())))
            time.sleep(0.2)

    def stop_background(self) -> None:
        """SIGTERM to each background block's process group, SIGKILL after a grace period."""
        for running in reversed(self.background):
            _signal_group(running.process, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.process.wait(STOP_GRACE)
            _signal_group(running.process, signal.SIGKILL)
            running.process.wait()
        self.background.clear()

    def _report(self, block: Block, what: str, output: str) -> str:
        parts = [f"{block.id}: the block {what}.", "--- the block ---", block.code.rstrip(),
                 "--- its output (stdout and stderr) ---", _tail(output)]
        for running in self.background:
            parts += [f"--- output of the background block {running.block.id} ---",
                      _tail(_text(running.log.read_bytes()))]
        parts.append(f"(workspace: {self.root})")
        return "\n".join(parts)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_SHOWN else "[...]\n" + text[-OUTPUT_SHOWN:]


__all__ = ["BLOCK_TIMEOUT", "PageFailure", "Workspace", "clean_environment",
           "copy_checkout"]
