"""The deployment files agree with the code: Dockerfile, docker-compose.yml, deploy/kubernetes/.

No Docker engine is needed. Every flag list handed to the image (the
Dockerfile's ENTRYPOINT and CMD, compose's ``command``, the Kubernetes
container's ``args``) is parsed by ``kiproxy``'s own argument parser, so a
renamed flag fails here; every config file (the image's default, compose's,
the ConfigMap's) is validated by ``proxy.config``; and the ports, mounts,
images and probes of the three are checked against each other and against the
config they load.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiproxy.cli import build_parser
from kiproxy.interceptors.loader import resolve_class
from kiproxy.proxy.cli import _overrides
from kiproxy.proxy.config.model import ProxyConfig, load_config, parse_host_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG_IN_IMAGE = "/etc/kiproxy/config.yaml"
PLUGINS_IN_IMAGE = "/plugins"


# ---------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined."""

    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON-array (exec) form of the arguments."""
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} must use the exec (JSON array) form"
        return [str(v) for v in value]


@cache
def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per build stage (``FROM`` first)."""
    stages: list[list[Instruction]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def final_stage(keyword: str) -> list[Instruction]:
    """The runtime stage's instructions of one kind."""
    return [i for i in dockerfile_stages()[-1] if i.keyword == keyword]


def image_entrypoint() -> list[str]:
    """``ENTRYPOINT`` of the runtime stage."""
    (entrypoint,) = final_stage("ENTRYPOINT")
    return entrypoint.exec_form()


def image_cmd() -> list[str]:
    """``CMD`` of the runtime stage: the default flags, replaced by compose's ``command``
    and by Kubernetes' ``args``."""
    cmd = final_stage("CMD")
    return cmd[-1].exec_form() if cmd else []


def exposed_ports() -> set[int]:
    """Every port of the runtime stage's ``EXPOSE`` lines (ranges expanded)."""
    ports: set[int] = set()
    for instruction in final_stage("EXPOSE"):
        for item in instruction.args.split():
            low, _, high = item.split("/")[0].partition("-")
            ports.update(range(int(low), int(high or low) + 1))
    return ports


@cache
def compose() -> dict[str, Any]:
    """docker-compose.yml, parsed, with ``${VAR:-default}`` read as its default (as Compose
    does when VAR is unset)."""
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", (ROOT / "docker-compose.yml").read_text())
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


def kafka_services() -> dict[str, dict[str, Any]]:
    """The compose services that run Apache Kafka."""
    return {name: s for name, s in compose()["services"].items()
            if str(s.get("image", "")).startswith("apache/kafka:")}


def proxy_service() -> dict[str, Any]:
    """The compose service that runs kiproxy."""
    service = compose()["services"]["kiproxy"]
    assert isinstance(service, dict)
    return service


@cache
def kubernetes_objects() -> list[dict[str, Any]]:
    """Every object of every manifest in deploy/kubernetes/."""
    objects = []
    for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.y*ml")):
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def kubernetes_object(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``)."""
    found = [o for o in kubernetes_objects()
             if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/kubernetes/, got {found}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    """The Deployment's pod template spec."""
    spec = kubernetes_object("Deployment")["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def sidecar() -> dict[str, Any]:
    """The kiproxy container of the Deployment."""
    spec = pod_spec()
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    (found,) = [c for c in containers if c["name"] == "kiproxy"]
    assert isinstance(found, dict)
    return found


def parse_flags(argv: list[str], where: str) -> Any:
    """``argv`` (starting with ``kiproxy``) parsed by kiproxy's own parser."""
    assert argv[:2] == ["kiproxy", "run"], f"{where}: {argv} does not start with 'kiproxy run'"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: kiproxy rejects the flags {argv[2:]} (see stderr)")


def effective_config(argv: list[str], files: dict[str, Path], where: str) -> ProxyConfig:
    """The settings ``kiproxy`` would run with: the ``--config`` file (mapped from its path
    inside the container to ``files``) with the flags applied."""
    args = parse_flags(argv, where)
    assert args.config in files, f"{where}: --config {args.config} is not the mounted file"
    return load_config(files[args.config], _overrides(args))


def port_of(address: str) -> int:
    """The port of ``HOST:PORT``."""
    return parse_host_port(address)[1]


def node_port(config: ProxyConfig, node_id: int) -> int:
    """The proxy port that stands for ``node_id`` (as proxy/brokers/nodes.py computes it)."""
    start = config.broker_port_start
    if start is None:
        start = port_of(config.listen) + 1
    return config.node_ports.get(node_id, start + node_id)


def image_default_config() -> ProxyConfig:
    """The config file the image ships at /etc/kiproxy/config.yaml."""
    (copy,) = [i for i in final_stage("COPY") if i.args.split()[-1] == CONFIG_IN_IMAGE]
    source = ROOT / copy.args.split()[-2]
    return load_config(source, {})


def compose_config() -> ProxyConfig:
    """The effective config of compose's kiproxy service."""
    files = {CONFIG_IN_IMAGE: ROOT / compose_mounts()[CONFIG_IN_IMAGE]}
    command = proxy_service().get("command", image_cmd())
    if isinstance(command, str):
        command = shlex.split(command)
    return effective_config(image_entrypoint() + command, files, "docker-compose.yml kiproxy")


def compose_mounts() -> dict[str, str]:
    """Container path -> host path of compose's kiproxy bind mounts."""
    mounts = {}
    for volume in proxy_service().get("volumes", []):
        host, container, *_ = str(volume).split(":")
        mounts[container] = host
    return mounts


def configmap_config(tmp_path: Path) -> Path:
    """The ConfigMap's config.yaml, written to a file."""
    data = kubernetes_object("ConfigMap", "kiproxy-config")["data"]
    path = tmp_path / "config.yaml"
    path.write_text(data["config.yaml"])
    return path


def kubernetes_config(tmp_path: Path) -> ProxyConfig:
    """The effective config of the Kubernetes sidecar."""
    container = sidecar()
    argv = [*(container.get("command") or image_entrypoint()),
            *container.get("args", image_cmd())]
    return effective_config(argv, {CONFIG_IN_IMAGE: configmap_config(tmp_path)},
                            "deploy/kubernetes kiproxy container")


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (or a directory above it) out of the context."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:  # the last matching pattern wins; "!" re-includes
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        globs = [glob, glob.removeprefix("**/")] if glob.startswith("**/") else [glob]
        for candidate in candidates:
            names = [candidate] + (["/".join(candidate.split("/")[i:])
                                    for i in range(1, candidate.count("/") + 1)]
                                   if glob.startswith("**/") else [])
            if any(fnmatch.fnmatchcase(n, g) for n in names for g in globs):
                ignored = not negate
    return ignored


# ---------------------------------------------------------------------------- Dockerfile


def test_image_is_built_in_a_builder_stage_and_runs_without_build_tools() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    builder = " ".join(i.args for i in stages[0] if i.keyword == "RUN")
    assert "gcc" in builder, "the Cython codec needs a C compiler in the builder"
    assert "pip wheel" in builder
    runtime = " ".join(i.args for i in stages[-1] if i.keyword == "RUN")
    assert "pip install --no-index" in runtime, "the runtime installs the builder's wheels only"
    assert "gcc" not in runtime and "Cython" not in runtime
    assert "[test]" not in (ROOT / "Dockerfile").read_text(), "runtime dependencies only"
    bases = {i.args.split()[0] for i in (stage[0] for stage in stages)}
    assert len(bases) == 1, f"builder and runtime share one Python base (wheel ABI): {bases}"


def test_image_carries_the_license_text() -> None:
    copied = {i.args.split()[-2]: i.args.split()[-1] for i in final_stage("COPY")
              if "--from" not in i.args}
    assert "LICENSE" in copied, "the runtime stage copies LICENSE into the image"
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    label = " ".join(i.args for i in final_stage("LABEL"))
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in label


def test_image_runs_as_a_non_root_user() -> None:
    users = final_stage("USER")
    assert users, "the runtime stage sets USER"
    user = users[-1].args.split(":")[0]
    assert user.isdigit() and int(user) != 0, \
        f"USER {users[-1].args}: a numeric non-root uid (Kubernetes' runAsNonRoot checks it)"


def test_image_entrypoint_is_kiproxy_run_with_the_mounted_config() -> None:
    args = parse_flags(image_entrypoint() + image_cmd(), "Dockerfile ENTRYPOINT/CMD")
    assert args.config == CONFIG_IN_IMAGE
    volumes = {v for i in final_stage("VOLUME") for v in i.exec_form()}
    assert {str(Path(CONFIG_IN_IMAGE).parent), PLUGINS_IN_IMAGE} <= volumes


def test_image_default_config_validates_and_serves_on_all_interfaces() -> None:
    config = image_default_config()
    assert config.plugins_dir == PLUGINS_IN_IMAGE
    assert parse_host_port(config.listen)[0] == "0.0.0.0"
    assert config.metrics_listen is not None, "the HEALTHCHECK needs the metrics endpoint"
    assert parse_host_port(config.metrics_listen)[0] == "0.0.0.0"


def test_image_healthcheck_asks_healthz_on_the_metrics_port() -> None:
    (healthcheck,) = final_stage("HEALTHCHECK")
    found = re.search(r"http://(127\.0\.0\.1|localhost):(\d+)/healthz", healthcheck.args)
    assert found, f"HEALTHCHECK must fetch /healthz: {healthcheck.args}"
    config = image_default_config()
    assert config.metrics_listen is not None
    assert int(found.group(2)) == port_of(config.metrics_listen)
    assert "CMD" in healthcheck.args.split()


def test_image_exposes_the_bootstrap_node_and_metrics_ports() -> None:
    config = image_default_config()
    assert config.metrics_listen is not None
    expected = {port_of(config.listen), port_of(config.metrics_listen),
                *(node_port(config, n) for n in range(3))}
    assert expected <= exposed_ports()


def test_dockerignore_keeps_the_build_inputs_and_drops_host_artifacts() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.split(".")[0] for p in setuptools["packages"]}
    needed = ["pyproject.toml", "setup.py", "README.md", "protocol/_codec.pyx",
              *(f"{p}/__init__.py" for p in packages)]
    needed += [i.args.split()[-2] for i in final_stage("COPY") if "--from" not in i.args]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not dockerignored(path), f".dockerignore drops {path}, which the build needs"
    for path in [".venv/bin/python", ".git/HEAD", "protocol/_codec.c",
                 "protocol/_codec.cpython-312-x86_64-linux-gnu.so", "tests/conftest.py",
                 "proxy/__pycache__/cli.cpython-312.pyc"]:
        assert dockerignored(path), f".dockerignore lets {path} into the build context"


# ---------------------------------------------------------------------------- docker-compose.yml


def test_compose_runs_apache_kafka_in_kraft_mode_with_three_nodes() -> None:
    kafka = kafka_services()
    assert len(kafka) == 3, "docs/deployment.md explains why three brokers"
    images = {s["image"] for s in kafka.values()}
    assert len(images) == 1
    (image,) = images
    assert re.fullmatch(r"apache/kafka:4\.\d+\.\d+", image), f"{image}: pin a 4.x release"
    envs = {name: s["environment"] for name, s in kafka.items()}
    node_ids = {name: int(env["KAFKA_NODE_ID"]) for name, env in envs.items()}
    assert len(set(node_ids.values())) == len(kafka)
    for name, env in envs.items():
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}, name
        assert "KAFKA_ZOOKEEPER_CONNECT" not in env, name
        voters = set(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(","))
        assert {v.split(":")[0] for v in voters} == {f"{i}@{n}" for n, i in node_ids.items()}
        assert "ports" not in kafka[name], f"{name}: host clients must go through the proxy"
    assert len({env["CLUSTER_ID"] for env in envs.values()}) == 1


def test_compose_proxy_points_at_every_broker_and_advertises_localhost() -> None:
    config = compose_config()
    advertised = set()
    for service in kafka_services().values():
        listeners = service["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
        advertised |= {listener.split("://", 1)[1] for listener in listeners}
    assert set(config.upstream) == advertised
    assert config.advertised_host == "localhost"
    depends = proxy_service()["depends_on"]
    assert set(depends) == set(kafka_services())


def test_compose_publishes_every_proxy_port_as_the_same_host_port() -> None:
    config = compose_config()
    assert config.metrics_listen is not None
    node_ids = [int(s["environment"]["KAFKA_NODE_ID"]) for s in kafka_services().values()]
    expected = {port_of(config.listen), port_of(config.metrics_listen),
                *(node_port(config, n) for n in node_ids)}
    published = {}
    for item in proxy_service()["ports"]:
        *host, container = str(item).split(":")
        published[int(container)] = int(host[-1])
    assert set(published) == expected
    for container, host in published.items():
        assert host == container, f"{host}:{container}: metadata names the proxy's own port"
    assert set(published) <= exposed_ports()


def test_compose_mounts_the_config_and_the_plugins_dir() -> None:
    mounts = compose_mounts()
    assert {CONFIG_IN_IMAGE, PLUGINS_IN_IMAGE} <= set(mounts)
    assert (ROOT / mounts[CONFIG_IN_IMAGE]).is_file()
    assert Path(mounts[PLUGINS_IN_IMAGE]) == Path("./plugins")
    config = compose_config()
    assert config.plugins_dir == PLUGINS_IN_IMAGE
    assert config.interceptor.class_name is not None, "compose shows an example interceptor"
    resolve_class(config.interceptor.class_name, ROOT / mounts[PLUGINS_IN_IMAGE])
    assert proxy_service()["build"] in (".", {"context": "."})


def test_containers_tests_start_the_compose_kafka_image() -> None:
    source = (ROOT / "tests" / "containers" / "test_apache_kafka.py").read_text()
    found = re.search(r'^KAFKA_IMAGE = "([^"]+)"', source, re.MULTILINE)
    assert found
    assert {found.group(1)} == {s["image"] for s in kafka_services().values()}


# ---------------------------------------------------------------------------- Kubernetes


def test_kubernetes_configmap_config_validates(tmp_path: Path) -> None:
    config = load_config(configmap_config(tmp_path), {})
    assert config.upstream
    assert config.plugins_dir == PLUGINS_IN_IMAGE


def test_kubernetes_sidecar_runs_the_compose_image_as_a_native_sidecar(tmp_path: Path) -> None:
    container = sidecar()
    assert container in pod_spec().get("initContainers", [])
    assert container.get("restartPolicy") == "Always"
    assert container["image"] == proxy_service()["image"]
    kubernetes_config(tmp_path)  # flags and ConfigMap validate together
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == final_stage("USER")[-1].args.split(":")[0]


def test_kubernetes_mounts_the_configmaps_where_the_image_reads_them(tmp_path: Path) -> None:
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in sidecar()["volumeMounts"]}
    config_volume = mounts[str(Path(CONFIG_IN_IMAGE).parent)]
    configmap = kubernetes_object("ConfigMap", config_volume["configMap"]["name"])
    assert Path(CONFIG_IN_IMAGE).name in configmap["data"]
    config = kubernetes_config(tmp_path)
    assert config.plugins_dir is not None
    plugins = mounts[config.plugins_dir]["configMap"]["name"]
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    assert f"kubectl create configmap {plugins} --from-file=plugins/" in deployment
    assert config.interceptor.class_name is not None
    resolve_class(config.interceptor.class_name, ROOT / "plugins")


def test_kubernetes_probes_ask_the_metrics_port(tmp_path: Path) -> None:
    config = kubernetes_config(tmp_path)
    assert config.metrics_listen is not None
    host, port = parse_host_port(config.metrics_listen)
    assert host == "0.0.0.0", "the kubelet probes the pod IP"
    container = sidecar()
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    expected_paths = {"startupProbe": "/healthz", "livenessProbe": "/livez",
                      "readinessProbe": "/readyz"}
    for probe, path in expected_paths.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert named.get(get["port"], get["port"]) == port, probe


def test_kubernetes_app_uses_the_sidecar_bootstrap_on_loopback(tmp_path: Path) -> None:
    config = kubernetes_config(tmp_path)
    listen_host, listen_port = parse_host_port(config.listen)
    assert listen_host in ("127.0.0.1", "localhost", "::1")
    (app,) = pod_spec()["containers"]
    env = {e["name"]: e.get("value") for e in app.get("env", [])}
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == f"{config.advertised_host}:{listen_port}"


# ---------------------------------------------------------------------------- docs


def test_deployment_page_covers_compose_and_kubernetes() -> None:
    section = (ROOT / "docs" / "deployment.md").read_text()
    for needle in ("docker compose up", "kcat -b localhost:", "deploy/kubernetes",
                   "kubectl apply", "three brokers", "no Docker engine"):
        assert needle in section, needle
    image = proxy_service()["image"]
    runs = [line for line in section.replace("\\\n", " ").splitlines()
            if line.strip().startswith("docker run") and f" {image} " in line]
    assert runs, f"a `docker run ... {image} ...` example"
    for line in runs:
        flags = shlex.split(line.split(f" {image} ", 1)[1].split("#")[0])
        parse_flags(image_entrypoint() + flags, f"docs/deployment.md: {line.strip()}")


def test_the_wheel_lists_every_package_folder_of_the_namespace() -> None:
    # setuptools installs only the packages pyproject.toml names: a new folder left out of
    # the list works in an editable checkout and is missing from every real install.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    on_disk = {"kiproxy"}
    for top in ("protocol", "interceptors", "proxy", "pipelines"):
        for init in (ROOT / top).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT).as_posix()
            name = folder if folder.startswith("kiproxy/") else f"kiproxy/{folder}"
            on_disk.add(name.replace("/", "."))
    assert on_disk == listed, (
        f"missing from [tool.setuptools] packages: {sorted(on_disk - listed)}; "
        f"listed but not a package: {sorted(listed - on_disk)}")


def test_the_dev_distribution_lists_its_package_and_the_image_leaves_it_out() -> None:
    # `kiproxy dev` and the local brokers are dev/'s distribution alone: the runtime's
    # package list names none of them, the image's build context holds no dev/ and its
    # pip lines install the runtime's wheel only.
    dev = tomllib.loads((ROOT / "dev" / "pyproject.toml").read_text())
    on_disk = {init.parent.relative_to(ROOT / "dev").as_posix().replace("/", ".")
               for init in (ROOT / "dev").rglob("__init__.py")
               if "build" not in init.relative_to(ROOT / "dev").parts}  # a wheel's build
    assert set(dev["tool"]["setuptools"]["packages"]) == on_disk == {"kiproxy_dev"}
    assert dev["project"]["entry-points"]["kiproxy.commands"] == {"dev": "kiproxy_dev.cli"}
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any("dev" in p for p in runtime["tool"]["setuptools"]["packages"])
    assert "dev" in (ROOT / ".dockerignore").read_text().splitlines()
    pip_lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
                 if "pip " in line]
    assert pip_lines and not any("dev" in line for line in pip_lines), pip_lines
