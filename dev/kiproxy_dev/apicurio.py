"""A local Apicurio Registry (the jar ``make registry`` builds) for ``kiproxy dev --registry``,
the tests and the benches: in-memory storage on 127.0.0.1, serving the Confluent Schema
Registry API at ``/apis/ccompat/v7``.

Contract: ``start`` launches ``java -jar quarkus-run.jar`` in its own process group on a
chosen (or free) port and returns once ``GET /apis/ccompat/v7/subjects`` answers 200, or
raises :class:`RegistryLaunchError` with the end of the log after ending the JVM; ``stop``
ends it (the port is then refused, as in an outage); ``start`` again after ``stop`` uses
the same port, with empty storage. The registry stores each schema as it was registered
(``registry.ccompat.use-canonical-hash`` stays off: in 2.4.2 it stores Avro schemas with
their fields sorted by name, and a positional Avro payload then no longer decodes with the
schema its id names); the global compatibility level is set explicitly (Apicurio's default
is NONE).
Standard library only; never imported by the proxy.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kiproxy_dev.processes import (
    HOST,
    end_process,
    ended_with_parent,
    free_ports,
    port_free,
    register,
    tail,
)

__all__ = ["ApicurioRegistry", "RegistryLaunchError", "find_registry_jar"]

VERSION = "2.4.2.Final"
CCOMPAT_PATH = "/apis/ccompat/v7"
START_TIMEOUT_S = 120.0


class RegistryLaunchError(RuntimeError):
    """The registry did not start: the message says why and what to do."""


def find_registry_jar() -> Path | None:
    """``$KIPROXY_REGISTRY_JAR``, else the jar ``make registry`` left in its cache, else None."""
    env = os.environ.get("KIPROXY_REGISTRY_JAR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("KIPROXY_REGISTRY_CACHE",
                                Path.home() / ".cache" / "kiproxy" / "registry"))
    jar = cache / f"apicurio-registry-{VERSION}" / "quarkus-app" / "quarkus-run.jar"
    return jar if jar.is_file() else None


class ApicurioRegistry:
    """One Apicurio Registry JVM; ``url`` is the Confluent-compatible API's base URL."""

    def __init__(self, jar: Path | str, *, port: int | None = None,
                 compatibility: str = "BACKWARD", java: str = "java",
                 workdir: Path | None = None) -> None:
        self.jar = Path(jar)
        self.port = port if port is not None else free_ports(1)[0]
        self.compatibility = compatibility
        self.java = java
        self.workdir = workdir if workdir is not None else Path(
            tempfile.mkdtemp(prefix="kiproxy-registry-"))
        self.log_path = self.workdir / "registry.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The base URL of the Confluent Schema Registry API (``.../apis/ccompat/v7``)."""
        return f"http://{HOST}:{self.port}{CCOMPAT_PATH}"

    @property
    def running(self) -> bool:
        """Whether the JVM is alive."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The ``java`` command line that runs the registry."""
        return [
            # C1 only and the serial collector: a short-lived development registry starts
            # about three times faster, on a loaded machine most of all.
            self.java, "-Xmx512m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
            f"-Dquarkus.http.host={HOST}", f"-Dquarkus.http.port={self.port}",
            f"-Dregistry.rules.global.compatibility={self.compatibility}",
            "-jar", str(self.jar),
        ]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Launch the JVM and wait until the API answers; raises :class:`RegistryLaunchError`."""
        if self.running:
            return
        if not self.jar.is_file():
            raise RegistryLaunchError(
                f"no Apicurio Registry at {self.jar}: run `make registry` and pass the path it "
                "prints (or set KIPROXY_REGISTRY_JAR)")
        if not port_free(self.port):
            raise RegistryLaunchError(
                f"port {self.port} on {HOST} is taken: choose another port for the registry")
        with self.log_path.open("ab") as log:
            try:
                proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.workdir,
                                        start_new_session=True,
                                        preexec_fn=ended_with_parent)
            except FileNotFoundError as exc:
                raise RegistryLaunchError(
                    f"cannot run {self.java!r}: the registry needs a Java 17+ runtime") from exc
        register(proc)
        self._proc = proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.stop()
                raise RegistryLaunchError(
                    f"Apicurio Registry exited with status {proc.returncode} before it was "
                    f"ready; the end of {self.log_path}:\n{tail(self.log_path)}")
            if self.ready():
                return
            time.sleep(0.25)
        self.stop()
        raise RegistryLaunchError(
            f"Apicurio Registry did not answer on {self.url} within {timeout:.0f} s; the end "
            f"of {self.log_path}:\n{tail(self.log_path)}")

    def ready(self) -> bool:
        """Whether ``GET {url}/subjects`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace: float = 10.0) -> None:
        """End the JVM (SIGTERM, then SIGKILL after ``grace`` s); the port is then refused."""
        if self._proc is not None:
            end_process(self._proc, grace)
            self._proc = None

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Stop, then start on the same port (storage starts empty again)."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> ApicurioRegistry:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
