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

import os
import re

import helm_python
import pytest

# the chart, rendered and crd_validators fixtures come with these imports
from tests.helm_chart import (BUILTIN_KINDS, CHART_DIR, CI_DIR, CI_NAMES, GOLDEN_DIR, RAY_NODE_HEALTH_PORT,
                              assert_valid, chart, check_documents, check_kuberay_rules, ci_values, crd_validators,
                              documents, golden_text, k8s_validate, pod_templates, render, rendered, serve_config, the)


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
    check_documents(documents(rendered[name]), crd_validators)


@pytest.mark.parametrize("name", CI_NAMES)
def test_serve_config_builds_in_the_app(name, rendered):
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import build_app
    from deployments.app import AppConfig
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


@pytest.mark.parametrize("name", CI_NAMES)
def test_every_ray_container_has_the_serve_environment(name, rendered):
    """deployments.app.SERVE_ENV, which the CLI, tests and benchmarks also start Ray with."""
    from deployments.app import SERVE_ENV

    rs = the(documents(rendered[name]), "RayService")
    for group, template in pod_templates(rs).items():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0].get("env", [])}
        assert SERVE_ENV.items() <= env.items(), (group, env)


@pytest.mark.parametrize("name", CI_NAMES)
def test_every_ray_container_has_its_ingress_modes_environment(name, rendered):
    """HAProxy mode is set on every pod, as deployments.ingress_env.haproxy_env sets it for the CLI."""
    from deployments.app import SERVE_ENV
    from deployments.ingress_env import haproxy_env

    values = ci_values(name)
    mode = values.get("serve", {}).get("ingress", "haproxy")
    rs = the(documents(rendered[name]), "RayService")
    for group, template in pod_templates(rs).items():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0].get("env", [])}
        ray_serve = {k: v for k, v in env.items() if k.startswith("RAY_SERVE_") and k not in SERVE_ENV}
        assert ray_serve == (haproxy_env(draining_s=5) if mode == "haproxy" else {}), (group, ray_serve)


@pytest.mark.parametrize("name", CI_NAMES)
def test_every_ray_container_knows_its_node(name, rendered):
    """NODE_NAME from the downward API: the GPU info metric's node label (deployments.nvml)."""
    rs = the(documents(rendered[name]), "RayService")
    for group, template in pod_templates(rs).items():
        env = {e["name"]: e for e in template["spec"]["containers"][0].get("env", [])}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, group


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
        # Compiled code lives on a volume of the pod's own, whatever the model cache is.
        code = [m["mountPath"] for m in spec["containers"][0]["volumeMounts"] if m["name"] == "code-cache"]
        assert env["SLOTSERVE_CODE_CACHE"] == code[0] and not code[0].startswith(cache[0] + "/")
        assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == "code-cache")


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
    from deployments.app import AppConfig

    rs = the(documents(render(chart, {"extraAppArgs": {"max_body_bytes": 1048576}})), "RayService")
    args = serve_config(rs)["applications"][0]["args"]
    assert AppConfig.from_args(args).max_body_bytes == 1048576


def test_lora_store_is_mounted_read_only_on_the_workers_and_is_the_apps_load_dir(chart, crd_validators):
    from deployments.app import AppConfig

    values = {"loraStore": {"enabled": True, "existingClaim": "adapters"},
              "engine": {"lora": {"adapters": {"sql": "/adapters/sql"}, "max_loras": 4}}}
    rs = the(documents(render(chart, values)), "RayService")
    assert_valid(crd_validators["RayService"], rs, "RayService")
    for group, template in pod_templates(rs).items():
        pod = template["spec"]
        volumes = [v for v in pod.get("volumes", ()) if v["name"] == "lora-store"]
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", ()) if m["name"] == "lora-store"]
        if group == "head":  # no engine and no Router there
            assert not volumes and not mounts
            continue
        assert volumes == [{"name": "lora-store", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}]
        assert mounts and all(m["mountPath"] == "/adapters" and m["readOnly"] for m in mounts), group
    args = serve_config(rs)["applications"][0]["args"]
    assert AppConfig.from_args(args).lora_load_dir == "/adapters"
    assert args["engine"]["lora"] == {"adapters": {"sql": "/adapters/sql"}, "max_loras": 4}


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


def test_engine_link_tls_is_mounted_on_every_ray_pod_and_given_to_the_app(rendered):
    rs = the(documents(rendered["gpu-70b-tp8"]), "RayService")
    path = ci_values("gpu-70b-tp8")["engineLinkTls"].get("mountPath", "/etc/slotserve/link-tls")
    for group, template in pod_templates(rs).items():
        pod = template["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "link-tls"]
        assert volume["secret"]["secretName"] == "slotserve-link-tls", group
        mounts = [m for c in pod["containers"] for m in c.get("volumeMounts", ()) if m["name"] == "link-tls"]
        assert mounts and all(m["mountPath"] == path and m["readOnly"] for m in mounts), group
    (app,) = serve_config(rs)["applications"]
    assert app["args"]["engine_link_tls"] == {"certfile": f"{path}/tls.crt", "keyfile": f"{path}/tls.key",
                                              "cafile": f"{path}/ca.crt"}
    for name in CI_NAMES:  # where it is not set, no link certificate anywhere
        if "engineLinkTls" not in ci_values(name):
            assert "link-tls" not in rendered[name]["slotserve/templates/rayservice.yaml"]


# ----------------------------------------------------------------------------- tenants
TENANTS = [
    {"name": "Team_A.prod", "existingSecret": "team-a-keys", "allowedPriority": [-5, 5], "shareCache": True,
     "maxConcurrentRequests": 32, "maxTokensPerMinute": 2000000, "maxWaiting": 8, "weight": 2.5},
    {"name": "team-b", "existingSecret": "team-b-keys", "key": "tenant-keys"},  # the other fields by default
]


def _secret_files(pod: dict, secret: str) -> set[str]:
    """The files of ``secret`` in the pod's first container, as mounted: {mountPath/item path}."""
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", ())
               if v.get("secret", {}).get("secretName") == secret}
    mounts = [m for m in pod["containers"][0].get("volumeMounts", ()) if m["name"] in volumes]
    assert all(m["readOnly"] for m in mounts), mounts
    return {f"{m['mountPath']}/{item['path']}" for m in mounts for item in volumes[m["name"]]["items"]}


@pytest.mark.parametrize("api_keys", ["app-keys", ""])
def test_tenants_keys_are_mounted_where_the_apps_are_and_reach_the_app(chart, crd_validators, api_keys):
    from deployments.app import AppConfig

    values = {"apiKeys": {"existingSecret": api_keys}, "tenants": TENANTS}  # no insecure: tenants authenticate
    rs = check_documents(documents(render(chart, values)), crd_validators)
    args = serve_config(rs)["applications"][0]["args"]
    cfg = AppConfig.from_args(args)
    assert [(t.name, t.allowed_priority, t.share_cache, t.max_concurrent_requests, t.max_tokens_per_minute,
             t.max_waiting, t.weight) for t in cfg.tenants] == [("Team_A.prod", (-5, 5), True, 32, 2000000, 8, 2.5),
                                                                ("team-b", (0, 0), False, None, None, None, 1)]
    assert [t.api_keys_file for t in cfg.tenants] == ["/etc/slotserve/tenants/Team_A.prod/keys",
                                                      "/etc/slotserve/tenants/team-b/tenant-keys"]
    assert all(not t.api_keys for t in cfg.tenants)  # keys never come inline from the values
    assert not {"max_concurrent_requests", "max_waiting"} & set(args["tenants"][1])  # unset limits: the app's
    assert cfg.api_keys_file == ("/etc/slotserve/api-keys/keys" if api_keys else None)
    for group, template in pod_templates(rs).items():
        pod = template["spec"]
        # Every pod with the app's keys, and the head (where Serve's controller builds the app).
        if api_keys and group != "head":
            assert _secret_files(pod, "app-keys") == {cfg.api_keys_file}, group
        for tenant in cfg.tenants:
            secret = {t["name"]: t["existingSecret"] for t in TENANTS}[tenant.name]
            assert _secret_files(pod, secret) == {tenant.api_keys_file}, (group, tenant.name)


def test_tenants_files_build_the_app(chart, tmp_path):
    """build_app reads each tenant's keys file where it runs (Serve's build task): with the files
    where the chart mounts them, the app builds."""
    from deployments.app import build_app

    rs = the(documents(render(chart, {"tenants": TENANTS, "tenantsMountPath": str(tmp_path)})), "RayService")
    args = serve_config(rs)["applications"][0]["args"]
    for i, tenant in enumerate(args["tenants"]):
        assert tenant["api_keys_file"].startswith(f"{tmp_path}/{tenant['name']}/")
        os.makedirs(os.path.dirname(tenant["api_keys_file"]))
        with open(tenant["api_keys_file"], "w") as f:
            f.write(f"# tenant {tenant['name']}\nsk-tenant-{i}-0123456789\n")
    build_app(args)


def test_strict_lint_passes_with_tenants():
    report = helm_python.chart.lint(CHART_DIR, {"tenants": TENANTS}, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_notes_name_the_tenants_secrets(chart):
    notes = render(chart, {"tenants": TENANTS})["slotserve/templates/NOTES.txt"]
    assert "Team_A.prod: Secret team-a-keys (key keys)" in notes
    assert "team-b: Secret team-b-keys (key tenant-keys)" in notes
    assert 'authorization: Bearer $SLOTSERVE_API_KEY' in notes
