"""The container engine and the project's image, for the container tests.

``make image`` (deploy/image.py) decides the engine (docker when ``docker info``
answers, else podman with the project's ``deploy/podman/containers.conf``) and
builds or reuses ``localhost/kiproxy:<hash of its inputs>``; this module runs it
once per test session and wraps the few engine commands the tests use. Where no
engine can run, :func:`build_image` raises :class:`NoEngine` with the reason,
which the fixtures turn into a skip (and :class:`NoKafkaJars` where the Apache
Kafka image is needed and ``make kafka`` fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"


class NoEngine(Exception):
    """No container engine can build or run the image here (the message says why)."""


class NoKafkaJars(Exception):
    """``make kafka`` could not resolve the jars the Kafka image is built from."""


@dataclass(frozen=True)
class Image:
    """A built image and the engine holding it; ``build_seconds`` 0 when it was reused."""

    engine: str
    ref: str
    build_seconds: float

    def run(self, *args: str, check: bool = True, timeout: float = 120,
            ) -> subprocess.CompletedProcess[str]:
        """``<engine> ARGS``; its output as text."""
        return subprocess.run([self.engine, *args], capture_output=True, text=True,
                              timeout=timeout, check=check, env=engine_env())

    def size_bytes(self) -> int:
        """The image's size as the engine reports it."""
        return int(self.run("image", "inspect", "--format", "{{.Size}}", self.ref).stdout)


SERVED_DOCKER_HOST = "KIPROXY_PODMAN_DOCKER_HOST"
"""Names the DOCKER_HOST that the session's podman service set for testcontainers."""


def engine_env() -> dict[str, str]:
    """The environment the engine runs in: podman reads the project's settings, and the
    Docker API podman serves to testcontainers is not taken for a Docker engine."""
    env = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF",
                                                           str(CONTAINERS_CONF))}
    if env.get(SERVED_DOCKER_HOST) and env.get("DOCKER_HOST") == env[SERVED_DOCKER_HOST]:
        del env["DOCKER_HOST"]
    return env


def build_image(which: str = "kiproxy") -> Image:
    """``make image``'s build (``kafka``: ``make kafka-image``'s), reused when its inputs
    are unchanged; NoEngine if no engine can build it."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "image.py"), which],
                          capture_output=True, text=True, env=engine_env(), timeout=1500,
                          check=False)
    if done.returncode != 0:
        if "no container engine" in done.stderr or "mmdebstrap is missing" in done.stderr:
            raise NoEngine(done.stderr.strip().splitlines()[-1])
        if "make kafka failed" in done.stderr:
            raise NoKafkaJars(done.stderr.strip()[-2000:])
        raise RuntimeError(f"make image failed ({done.returncode}):\n{done.stderr[-6000:]}")
    ref = done.stdout.strip().splitlines()[-1]
    engine = "docker" if "engine: docker" in done.stderr else "podman"
    reused = "make image: $ " not in done.stderr  # no build command was run
    return Image(engine, ref, 0.0 if reused else time.monotonic() - started)
