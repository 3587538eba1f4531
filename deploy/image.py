"""Build kiproxy's container image with whichever engine this machine has (`make image`).

Contract:

* The engine is ``docker`` when ``docker info`` answers, else ``podman`` (which
  `make container-engine` installs from Debian where neither is present);
  podman reads this project's ``deploy/podman/containers.conf`` through
  ``CONTAINERS_CONF`` (set here when the caller has not).
* The base image (the Dockerfile's ``PYTHON_IMAGE``) is the registry's
  ``python:3.12-slim-trixie`` when it is present or can be pulled; otherwise a
  Debian bookworm base built by ``mmdebstrap --variant=minbase`` with python3,
  python3-venv, python3-pip, python3-dev and ca-certificates and a venv on
  ``PATH`` (so it behaves like the ``python:*-slim`` images), imported as
  ``localhost/kiproxy-base:<hash of its recipe>``. Its root file system is kept
  in ``~/.cache/kiproxy/images`` and rebuilt only when the recipe changes.
* The project's image is ``localhost/kiproxy:<hash>``, the hash covering the
  Dockerfile, the build context's files and the base image's reference: an
  image with that tag is reused, so a second run with unchanged inputs builds
  nothing; a new build untags the images of earlier trees. Built with
  ``--pull=never --format docker`` (the docker format keeps the HEALTHCHECK);
  only pip and apt reach the network, through the host's CA bundle mounted
  into the build.
* ``image.py kafka`` (`make kafka-image`): ``apache/kafka`` when it can be
  pulled, else ``localhost/kiproxy-kafka:<version>-<hash>`` built on the Debian
  base with openjdk-17-jre-headless and the jars ``make kafka`` resolves
  (deploy/kafka-image/), for docker-compose.yml's ``KAFKA_IMAGE``.
* The image reference is the last line printed on stdout; progress goes to
  stderr. Exit status 1, with the reason, when no engine can be used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KIPROXY_IMAGE_CACHE", Path.home() / ".cache/kiproxy/images"))
# Fully qualified: podman refuses short names it cannot resolve without asking.
REGISTRY_PYTHON = "docker.io/library/python:3.12-slim-trixie"
"""The Dockerfile's default ``PYTHON_IMAGE``."""
OFFICIAL_KAFKA = "docker.io/apache/kafka:4.3.1"
"""docker-compose.yml's default Kafka image."""
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python3-dev", "ca-certificates")
BASE_SUITE = "bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md",
           "LICENSE", "kiproxy", "proxy", "protocol", "interceptors", "pipelines",
           "deploy/docker")
EXCLUDED_SUFFIXES = (".pyc", ".pyo", ".so", ".c")

# mmdebstrap's recipe; its hash names the base image, so changing it rebuilds the base.
MMDEBSTRAP_ARGS = (
    "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
    "--aptopt=APT::Install-Recommends \"false\"",
    "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--customize-hook=chroot \"$1\" python3 -m venv /opt/venv",
    "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*",
)
IMPORT_CHANGES = ("ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                  "/sbin:/bin", "ENV LANG=C.UTF-8", "CMD [\"python3\"]")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"make image: {message}", file=sys.stderr, flush=True)


def engine() -> str:
    """``docker`` if its engine answers, else ``podman`` if installed; exits otherwise."""
    os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "deploy/podman/containers.conf"))
    if shutil.which("docker") and _quiet(["docker", "info"], timeout=20):
        return "docker"
    if shutil.which("podman") and _quiet(["podman", "info"], timeout=60):
        return "podman"
    sys.exit("make image: no container engine: `docker info` fails and podman is not "
             "usable; run `make container-engine` (root or sudo installs Debian's podman)")


def _quiet(cmd: list[str], timeout: float) -> bool:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run(cmd: list[str], **kwargs: object) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr, **kwargs)  # type: ignore[call-overload]


def image_exists(tool: str, ref: str) -> bool:
    """Whether ``ref`` is in the engine's local store."""
    return _quiet([tool, "image", "inspect", ref], timeout=60)


def base_image(tool: str) -> str:
    """The ``PYTHON_IMAGE`` build argument: the registry's, else one built from Debian."""
    wanted = os.environ.get("KIPROXY_PYTHON_IMAGE")
    if wanted:
        return wanted
    if image_exists(tool, REGISTRY_PYTHON) or _quiet([tool, "pull", REGISTRY_PYTHON],
                                                     timeout=120):
        return REGISTRY_PYTHON
    log(f"{REGISTRY_PYTHON} cannot be pulled: using a Debian {BASE_SUITE} base built by "
        "mmdebstrap")
    return debian_base(tool)


def debian_base(tool: str) -> str:
    """The Debian base (mmdebstrap), imported unless the engine has it; its reference."""
    recipe = "\n".join((BASE_SUITE, *MMDEBSTRAP_ARGS, *IMPORT_CHANGES)).encode()
    ref = f"localhost/kiproxy-base:{hashlib.sha256(recipe).hexdigest()[:12]}"
    if image_exists(tool, ref):
        return ref
    tarball = CACHE / f"{ref.rpartition(':')[2]}.tar"
    if not tarball.exists():
        if not shutil.which("mmdebstrap"):
            sys.exit("make image: no registry answers and mmdebstrap is missing; run "
                     "`make container-engine`")
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial.tar")
        _run(["mmdebstrap", *MMDEBSTRAP_ARGS, BASE_SUITE, str(partial)])
        partial.rename(tarball)
    changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
    _run([tool, "import", *changes, str(tarball), ref])
    return ref


def context_hash(python_image: str) -> str:
    """A hash of everything the image is built from."""
    digest = hashlib.sha256(python_image.encode())
    for name in CONTEXT:
        path = ROOT / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts or file.suffix in EXCLUDED_SUFFIXES:
                continue
            if file.exists():
                digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:12]


def build() -> str:
    """Build (or reuse) the project's image; its reference."""
    tool = engine()
    log(f"engine: {tool}")
    python_image = base_image(tool)
    ref = f"localhost/kiproxy:{context_hash(python_image)}"
    if image_exists(tool, ref):
        log(f"{ref} is up to date")
        return ref
    cmd = [tool, "build", "--build-arg", f"PYTHON_IMAGE={python_image}", "-t", ref]
    if tool == "podman":
        cmd += ["--pull=never", "--format", "docker"]
        if HOST_CA.exists():  # pip and apt in the build trust what the host trusts
            cmd += ["--volume", f"{HOST_CA}:{HOST_CA}:ro"]
    _run([*cmd, str(ROOT)])
    _drop_older(tool, ref)
    return ref


def _drop_older(tool: str, ref: str) -> None:
    """Untag the images an earlier tree built (``localhost/kiproxy:<other hash>``), so a
    rebuild per change does not pile them up; one a container still uses stays."""
    repo = ref.rpartition(":")[0]
    listed = subprocess.run([tool, "images", "--format", "{{.Repository}}:{{.Tag}}", repo],
                            capture_output=True, text=True, check=False).stdout.split()
    for old in listed:
        if old != ref and old.rpartition(":")[0] == repo:
            _quiet([tool, "rmi", old], timeout=60)


def build_kafka() -> str:
    """An Apache Kafka image for docker-compose.yml: ``apache/kafka`` when it can be pulled,
    else one built on the Debian base from the jars ``make kafka`` resolves."""
    tool = engine()
    log(f"engine: {tool}")
    if image_exists(tool, OFFICIAL_KAFKA) or _quiet([tool, "pull", OFFICIAL_KAFKA], timeout=300):
        return OFFICIAL_KAFKA
    log(f"{OFFICIAL_KAFKA} cannot be pulled: building one from `make kafka`'s jars")
    fetched = subprocess.run([str(ROOT / "apache-kafka" / "fetch.sh")], capture_output=True,
                             text=True, check=False)
    if fetched.returncode != 0:
        sys.exit(f"make kafka-image: make kafka failed:\n{fetched.stderr[-3000:]}")
    home = Path(fetched.stdout.strip().splitlines()[-1])
    base = debian_base(tool)
    recipe = ROOT / "deploy" / "kafka-image"
    digest = hashlib.sha256(base.encode() + (home / ".kiproxy-complete").read_bytes())
    for file in sorted(p for p in recipe.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(recipe)).encode() + b"\0" + file.read_bytes())
    version = home.name.rpartition("-")[2]
    ref = f"localhost/kiproxy-kafka:{version}-{digest.hexdigest()[:12]}"
    if image_exists(tool, ref):
        log(f"{ref} is up to date")
        return ref
    with tempfile.TemporaryDirectory(prefix="kafka-image-") as tmp:
        context = Path(tmp)
        shutil.copytree(recipe, context, dirs_exist_ok=True)
        shutil.copytree(home, context / "kafka", ignore=shutil.ignore_patterns(".kiproxy-*"))
        cmd = [tool, "build", "--build-arg", f"BASE_IMAGE={base}", "-t", ref]
        if tool == "podman":
            cmd += ["--pull=never", "--format", "docker"]
        _run([*cmd, str(context)])
    _drop_older(tool, ref)
    return ref


def main() -> int:
    """Build the image (``kafka``: the Apache Kafka image) and print its reference last."""
    which = sys.argv[1] if len(sys.argv) > 1 else "kiproxy"
    if which not in ("kiproxy", "kafka"):
        sys.exit(f"usage: {sys.argv[0]} [kiproxy|kafka]")
    print(build_kafka() if which == "kafka" else build(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
