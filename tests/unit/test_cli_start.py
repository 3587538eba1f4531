"""What a new user meets at start: one line and an exit status, never a traceback.

The ``kiproxy`` command runs as a subprocess (what is asserted is its stderr and
exit code) where start-up sets up logging or a missing package must be missing
from a whole process: such a package is made so for that process by a
directory on ``PYTHONPATH`` whose ``aiokafka`` package raises the error a missing
one does. ``kiproxy check``, which changes nothing in the process it runs in,
and :func:`~kiproxy.proxy.serve.run_loop` are tested in this process.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import runtime_env

from kiproxy.cli import main
from kiproxy.proxy.serve import run_loop

ROOT = Path(__file__).resolve().parents[2]

# docs/rollout.md's routes, with a built-in for the policy plugin
ROLLOUT = """\
upstream: [127.0.0.1:1]
routes:
  - name: trial
    match: {topic: "trial|rej-observe"}
    mode: observe
    interceptors: [{class: uppercase}]
  - name: guard
    match: {topic: "payments"}
    dead_letter: {topic: payments-dlq}
    interceptors: [{class: uppercase}]
"""


def _kiproxy(*args: str, cwd: Path, pythonpath: Path | None = None
             ) -> subprocess.CompletedProcess[str]:
    env = runtime_env() if pythonpath is None else runtime_env(PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, "-m", "kiproxy", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def _without_aiokafka(tmp_path: Path) -> Path:
    shim = tmp_path / "shim"
    (shim / "aiokafka").mkdir(parents=True)
    (shim / "aiokafka" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'aiokafka'\", name='aiokafka')\n")
    return shim


@pytest.mark.parametrize("command", ["run", "dev"])
def test_a_config_that_needs_a_missing_extra_stops_with_one_line(tmp_path: Path,
                                                                 command: str) -> None:
    (tmp_path / "config.yaml").write_text(
        ROLLOUT if command == "run" else ROLLOUT.replace("upstream: [127.0.0.1:1]\n", ""))
    result = _kiproxy(command, "--config", "config.yaml", cwd=tmp_path,
                      pythonpath=_without_aiokafka(tmp_path))
    assert (result.returncode, result.stderr) == (2, (
        "kiproxy: config error in config.yaml: routes[1].dead_letter needs the kafka-audit "
        "extra (aiokafka is not installed): pip install '.[kafka-audit]' from a kiproxy "
        "checkout\n"))
    assert "bootstrap address" not in result.stdout


def test_kiproxy_dev_without_the_dev_distribution_stops_with_one_line(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    (shim / "kiproxy_dev").mkdir(parents=True)
    (shim / "kiproxy_dev" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'kiproxy_dev'\", name='kiproxy_dev')\n")
    result = _kiproxy("dev", "--broker", "kafka", "--listen", "127.0.0.1:0", cwd=tmp_path,
                      pythonpath=shim)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", (
        "kiproxy: kiproxy dev needs the kafka-interceptor-proxy-dev distribution (kiproxy_dev "
        "is not installed): pip install ./dev from a kiproxy checkout\n"))
    # The other commands are untouched by it.
    assert _kiproxy("run", "--help", cwd=tmp_path, pythonpath=shim).returncode == 0


def test_the_same_config_passes_the_check_where_the_extra_is_installed(tmp_path: Path) -> None:
    # The shim is what fails above: without it, start-up gets as far as the upstream.
    (tmp_path / "config.yaml").write_text(ROLLOUT)
    result = _kiproxy("run", "--config", "config.yaml", "--upstream-startup-timeout-ms", "100",
                      cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("kiproxy: upstream 127.0.0.1:1: connection refused")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_taken_broker_port_is_one_line_and_not_a_broker_reported_ready(tmp_path: Path
                                                                         ) -> None:
    """Something listening on the port accepts connections too: the embedded broker
    must not take that for itself being ready (Tansu then fails to bind, and clients
    would talk to whatever holds the port)."""
    from kiproxy_dev.tansu import BrokerPortTaken, EmbeddedBroker

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(BrokerPortTaken, match=f"port {port} on 127.0.0.1 is taken"):
            EmbeddedBroker(port).start()
        done = _kiproxy("dev", "--broker-port", str(port), "--listen", "127.0.0.1:0",
                        cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"kiproxy: port {port} on 127.0.0.1 is taken: stop what listens there or choose "
        "another port (--broker-port)")


def test_upstream_takes_kafkas_comma_separated_bootstrap_list(tmp_path: Path) -> None:
    first, second = _closed_port(), _closed_port()
    result = _kiproxy("run", "--upstream", f"127.0.0.1:{first},127.0.0.1:{second}",
                      "--upstream-startup-timeout-ms", "100", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith(f"kiproxy: upstream 127.0.0.1:{first}: connection refused; "
                                    f"127.0.0.1:{second}: connection refused"), result.stderr


def test_a_misspelt_built_in_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "uppercas"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        "kiproxy check: interceptor 'uppercas' is not MODULE:CLASS nor a known name (did you "
        "mean 'uppercase'?); known names (the built-ins and the entry points of group "
        "'kiproxy.interceptors'): chain, "), err


def test_check_of_schema_registry_closes_it_and_prints_each_record_error_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Level id refuses an unframed value before any lookup: no registry is asked.
    (tmp_path / "config.yaml").write_text(
        "registry: {url: 'http://127.0.0.1:1'}\ntopics: {check: {value: id}}\n")
    monkeypatch.chdir(tmp_path)
    code = main(["check", "schema_registry", "--config", "config.yaml"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].startswith("  record 0: not framed with a schema id: expected magic byte 0")
    assert lines[-1] == ("schema_registry: loaded; 2 batches: 0 unchanged, 0 transformed, "
                         "2 rejected")


def test_an_import_error_of_the_served_coroutine_is_raised_once() -> None:
    runs: list[int] = []

    async def start() -> None:
        runs.append(1)
        raise ImportError("the embedded thing needs a package")

    with pytest.raises(ImportError, match="the embedded thing needs a package"):
        run_loop(start())
    assert runs == [1]


def test_without_uvloop_the_coroutine_runs_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    loops: list[str] = []

    async def serve() -> None:
        loops.append(type(asyncio.get_running_loop()).__module__)

    run_loop(serve())
    assert loops == ["asyncio.unix_events"]


def test_free_port_hands_a_port_out_once_per_process() -> None:
    """A port handed out and not bound yet looks free again: two listeners of one test
    (a proxy's metrics and one of its broker ports) got the same port, and clients of
    that broker reached the metrics server."""
    from kiproxy_dev.tansu import free_port, hand_out

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not hand_out(ports[0])
    spare = max(ports) + 1
    while spare in ports:
        spare += 1
    assert hand_out(spare) and not hand_out(spare) and free_port() != spare
