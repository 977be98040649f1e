"""Rendering and validating the Helm chart offline: shared by the chart tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

# pip install -e '.[test]' (helm-python-sdk): a missing one fails, never skips
from helm_python import Chart

ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = ROOT / "helm" / "slotserve"
CI_DIR = CHART_DIR / "ci"
GOLDEN_DIR = ROOT / "tests" / "golden" / "helm"
# KubeRay v1.7.0's CRD schemas, kept in the repository (helm/schemas/kuberay/README.md: source, refresh)
SCHEMA_DIR = ROOT / "helm" / "schemas" / "kuberay"
CI_NAMES = ("cpu-demo", "gpu-1x", "gpu-8b-tp2", "gpu-70b-tp8")
RELEASE, NAMESPACE = "slotserve", "slotserve"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # the chart's kubeVersion floor, and the newest schemas
BUILTIN_KINDS = {"PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim"}
RAY_NODE_HEALTH_PORT = 52365


# ----------------------------------------------------------------------------- rendering
@pytest.fixture(scope="module")
def chart():
    with Chart.load(CHART_DIR) as loaded:
        yield loaded


def ci_values(name: str) -> dict:
    return yaml.safe_load((CI_DIR / f"{name}.yaml").read_text()) or {}


def render(chart, values: dict | None = None, release: str = RELEASE) -> dict[str, str]:
    """Values that say nothing of authentication (no API keys, no tenants) render as a dev cluster's
    would (``insecure: true``): the chart refuses them otherwise, which tests/test_helm_values.py
    checks on its own."""
    values = dict(values or {})
    if "insecure" not in values and not (values.get("apiKeys") or {}).get("existingSecret") \
            and not values.get("tenants"):
        values["insecure"] = True
    return chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)


def documents(manifests: dict[str, str]) -> list[dict]:
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def golden_text(manifests: dict[str, str]) -> str:
    return "".join(f"# Source: {path}\n{text.strip()}\n---\n" for path, text in sorted(manifests.items())
                   if text.strip())


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, dict[str, str]]:
    return {name: render(chart, ci_values(name)) for name in CI_NAMES}


def the(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


# ----------------------------------------------------------------------------- validators
def _strict(schema):
    """CRD schema with unknown fields refused: the API server would drop them without a word."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_validators() -> dict[str, jsonschema.Draft4Validator]:
    return {kind: jsonschema.Draft4Validator(_strict(json.loads((SCHEMA_DIR / f"{kind.lower()}-v1.schema.json")
                                                                .read_text())))
            for kind in ("RayService", "RayCluster")}


def assert_valid(validator: jsonschema.Draft4Validator, doc: dict, what: str) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{what}:\n" + "\n".join(f"  {'.'.join(map(str, e.absolute_path))}: {e.message}"
                                                for e in errors[:10])


def k8s_validate(doc: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {path}: {exc.message}")


def check_kuberay_rules(rs: dict) -> None:
    """What KubeRay's own webhook-free validation refuses at reconcile time (utils/validation.go)."""
    name = rs["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    timeout = rs["metadata"]["annotations"]["ray.io/initializing-timeout"]
    assert re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+|[1-9]\d*", timeout), timeout
    spec = rs["spec"]
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "None")
    cluster = spec["rayClusterConfig"]
    # Token auth needs Ray >= 2.52; the probes' /api/healthz on the node agent needs 2.53.
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")) >= (2, 53, 0)
    assert "name" not in cluster["headGroupSpec"].get("headService", {}).get("metadata", {})
    v2 = cluster.get("enableInTreeAutoscaling") and cluster["autoscalerOptions"]["version"] == "v2"
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        assert not (group.get("resources") and {"num-cpus", "num-gpus", "memory", "resources"} & set(params))
        assert "labels" not in params
        assert group["template"]["spec"].get("restartPolicy", "Never") == "Never" or not v2
    for group in cluster["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["maxReplicas"], group["groupName"]
        assert "idleTimeoutSeconds" not in group or v2


def check_documents(docs: list[dict], crd_validators: dict[str, jsonschema.Draft4Validator]) -> dict:
    """Every document of a rendering validated (module docstring of tests/test_helm.py); the RayService."""
    rs = the(docs, "RayService")
    assert_valid(crd_validators["RayService"], rs, "RayService")
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": rs["metadata"]["name"]},
               "spec": rs["spec"]["rayClusterConfig"]}
    assert_valid(crd_validators["RayCluster"], cluster, "rayClusterConfig as a RayCluster")
    check_kuberay_rules(rs)
    for group, template in pod_templates(rs).items():  # the pods with Kubernetes' own (richer) schema
        k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template})
    for doc in docs:
        if doc["kind"] in BUILTIN_KINDS:
            k8s_validate(doc)
        elif doc["kind"] == "PodMonitor":
            check_pod_monitor(doc, rs)
        else:
            assert doc["kind"] == "RayService", f"unexpected kind {doc['kind']}"
        assert doc["metadata"]["namespace"] == NAMESPACE
    return rs


def check_pod_monitor(pm: dict, rs: dict) -> None:
    """No CRD schema for prometheus-operator here: check what would silently scrape nothing."""
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) <= {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels"}
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = pm["spec"]["selector"]["matchLabels"]
    for name, template in pod_templates(rs).items():
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"PodMonitor does not select the {name} pods"
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        for endpoint in pm["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings"}
            assert ports.get(endpoint["port"]) == 8080, f"{name} pods have no metrics port"
            assert re.fullmatch(r"(\d+(ms|s|m|h))+", endpoint["interval"])
