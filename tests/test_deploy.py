"""The compose file against the Compose Specification, and the Kubernetes manifests
rendered with `kubectl kustomize` and validated against the Kubernetes schemas offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import compose_spec
import pytest
import yaml

ROOT = Path(__file__).parent.parent


def test_compose_file_follows_the_specification() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    compose_spec.PyCompose.from_yaml(text).validate()
    doc = yaml.safe_load(text)
    services = doc["services"]
    assert {"minio", "postgres", "r3store", "seaweedfs"} <= set(services)
    assert services["seaweedfs"]["profiles"] == ["seaweedfs"], "an alternative S3 backend"
    for name, service in services.items():
        if "image" in service:
            assert ":" in service["image"], name
            assert not service["image"].endswith(":latest"), name
    for name in ("minio", "postgres", "r3store"):
        assert "healthcheck" in services[name], name
    conditions = services["r3store"]["depends_on"]
    assert conditions["postgres"]["condition"] == "service_healthy"
    assert "${POSTGRES_PASSWORD:?" in text
    assert "${R3STORE_ADMIN_KEY:?" in text
    broken = text.replace("condition: service_healthy", "condition: whenever", 1)
    with pytest.raises(ValueError, match="condition"):
        compose_spec.PyCompose.from_yaml(broken).validate()


def render(path: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: apt-get install kubectl"
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / path)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate(docs: list[dict[str, Any]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate, strict and offline, on `docs` written to one file."""
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(rendered)],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("path", ["deploy/base", "deploy/overlays/production"])
def test_kubernetes_manifests_render_and_validate(path: str, tmp_path: Path) -> None:
    docs = render(path)
    kinds = {d["kind"] for d in docs}
    assert kinds == {
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    result = validate(docs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    [container] = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "requests" in container["resources"]
    assert "limits" in container["resources"]


def test_broken_manifests_are_caught(tmp_path: Path) -> None:
    docs = render("deploy/base")
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = "two"
    assert validate([deployment], tmp_path).returncode != 0
