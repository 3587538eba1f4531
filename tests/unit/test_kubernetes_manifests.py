"""deploy/kubernetes/ validates against the Kubernetes versions it claims to support.

Offline: kubernetes-validate (PyPI) carries the OpenAPI schemas of each
Kubernetes release; every object of every manifest is checked strictly (an
unknown field is an error, as ``kubectl apply --validate=strict`` makes it)
against each version named on deployment.yaml's ``# Kubernetes versions:`` line.
The sidecar's hardening is checked on the parsed manifest.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"


def _claimed_versions() -> list[str]:
    text = (MANIFESTS / "deployment.yaml").read_text()
    match = re.search(r"^# Kubernetes versions: ([\d. ]+)$", text, re.MULTILINE)
    assert match, "deployment.yaml must name the Kubernetes versions it supports"
    return [f"{v}.0" for v in match.group(1).split()]


def _objects() -> list[dict[str, Any]]:
    found = [doc for path in sorted(MANIFESTS.glob("*.y*ml"))
             for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert {o["kind"] for o in found} == {"Deployment", "ConfigMap"}
    return found


@pytest.mark.parametrize("version", _claimed_versions())
def test_every_manifest_validates_strictly(version: str) -> None:
    for obj in _objects():
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validation_catches_a_misspelt_field() -> None:
    deployment = copy.deepcopy(next(o for o in _objects() if o["kind"] == "Deployment"))
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    sidecar["securityContext"]["readOnlyRootFileSystem"] = sidecar["securityContext"].pop(
        "readOnlyRootFilesystem")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, _claimed_versions()[0], strict=True)


def test_the_sidecar_has_probes_resources_and_a_locked_down_context() -> None:
    deployment = next(o for o in _objects() if o["kind"] == "Deployment")
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["name"] == "kiproxy" and sidecar["restartPolicy"] == "Always"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert sidecar["startupProbe"]["httpGet"]["path"] in ("/healthz", "/livez")
    # A proxy slow to answer under load (the probes share its event loop) is not
    # restarted by the kubelet's 1 s default timeout: 5 s, and a minute of failures.
    liveness = sidecar["livenessProbe"]
    assert liveness["timeoutSeconds"] >= 5, liveness
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60, liveness
    assert sidecar["readinessProbe"]["timeoutSeconds"] >= 5
    assert sidecar["startupProbe"]["timeoutSeconds"] >= 5
    assert {"cpu", "memory"} <= set(sidecar["resources"]["requests"])
    assert "memory" in sidecar["resources"]["limits"]
    context = sidecar["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
    assert context["allowPrivilegeEscalation"] is False
