"""The Helm chart, rendered by Helm's own engine (helm-python-sdk): valid manifests for a current Kubernetes, the
CRD and RBAC that the operator's code defines, locked-down pods, NetworkPolicies that allow exactly the traffic
kvmesh needs, monitoring objects only where the Prometheus Operator exists, and dashboards for Grafana's sidecar."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from kvmesh import __version__
from kvmesh.engine.protocol import ROLE_LABEL
from kvmesh.operator import crd, desired, rbac
from kvmesh.router.config import GATEWAY_EXT_PROC_PORT

from .promql import CHART, DASHBOARDS, ROOT

KUBERNETES = "1.37.0"  # kubernetes-validate's newest schema: a current cluster
MONITORING_API = "monitoring.coreos.com/v1"
PROMETHEUS_OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}  # their CRDs are not here
DISAGGREGATED = {"pool": {"enabled": True, "name": "chat", "spec": {
    "model": {"source": "bundled"},
    "mode": "disaggregated",
    "replicas": {"prefill": {"min": 1, "max": 4}, "decode": {"min": 2, "max": 8}},
    "router": {"replicas": 2},
}}}


def render(values: dict[str, Any] | None = None, api_versions: tuple[str, ...] = (),
           namespace: str = "kvmesh", name: str = "kvmesh") -> dict[str, str]:
    """Template path -> rendered text. helm-python's Chart.render() has no api_versions option (what a cluster
    offers, for `.Capabilities.APIVersions.Has`), so the options go to its native call, which takes them."""
    options = {"name": name, "namespace": namespace, "api_versions": list(api_versions)}
    with helm_python.Chart.load(CHART) as chart:
        return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}),
                                              json.dumps(options)))


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for path, text in rendered.items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def the_crd() -> dict[str, Any]:
    return yaml.safe_load((CHART / "crds" / "inferencepools.kvmesh.io.yaml").read_text())


RENDERINGS = {
    "default": render(),
    "default, Prometheus Operator": render(api_versions=(MONITORING_API,)),
    "disaggregated pool, Prometheus Operator": render(DISAGGREGATED, api_versions=(MONITORING_API,)),
    "namespaced operator": render({"operator": {"watchNamespaces": ["team-a", "team-b", "kvmesh"], "workers": 128},
                                   "networkPolicy": {"clients": [{"namespaceSelector": {"matchLabels": {"app": "x"}}}]},
                                   "pool": {"enabled": True}}),
    "two operators": render({"operator": {"replicas": 2}}),
}


# ---- Helm's view ----------------------------------------------------------------------------------------------


def test_lint_finds_no_errors() -> None:
    for values in ({}, DISAGGREGATED, {"operator": {"replicas": 2}}):
        report = helm_python.lint(CHART, values, kube_version=f"v{KUBERNETES}")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_schema_rejects_bad_values() -> None:
    for bad in ({"ports": {"engine": 70000}}, {"operator": {"replicas": 4}}, {"unknown": 1},
                {"operator": {"workers": 0}}, {"operator": {"workers": "many"}},
                {"securityContext": {"readOnlyRootFilesystem": False}}, {"pool": {"name": "Not_A_Name"}},
                {"pool": {"name": "1chat"}},  # a Service's name starts with a letter, as the CRD says
                {"pool": {"enabled": True, "spec": {"mode": "disaggregated"}}}):  # a spec of your own names a model
        with pytest.raises(helm_python.HelmValuesError):
            render(bad)


def test_the_chart_version_follows_the_package() -> None:
    with helm_python.Chart.load(CHART) as chart:
        assert chart.metadata["appVersion"] == __version__
        image = chart.values["image"]
    # the operator's default engine image is the chart's image
    assert f"{image['repository']}:{__version__}" == crd.DEFAULT_IMAGE


# ---- every manifest valid -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_every_manifest_is_valid_kubernetes(name: str) -> None:
    docs = manifests(RENDERINGS[name])
    assert docs
    crd_schema = the_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for doc in docs:
        if doc["kind"] == crd.KIND:
            jsonschema.Draft4Validator(crd_schema).validate(doc)  # OpenAPI v3.0: boolean exclusiveMinimum
            crd.parse_pool(doc)  # the operator's own reading: defaults, bounds and the CEL rules' twins
        elif doc["kind"] in PROMETHEUS_OPERATOR_KINDS:
            assert doc["apiVersion"] == MONITORING_API and doc["spec"]
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_crd_is_valid_kubernetes() -> None:
    kubernetes_validate.validate(the_crd(), KUBERNETES, strict=True)


def test_the_chart_crd_is_the_operator_crd() -> None:
    """crds/ (generated from operator/crd.py) and the chart's copy are the same file: copy it after a change."""
    chart_copy = CHART / "crds" / "inferencepools.kvmesh.io.yaml"
    assert chart_copy.read_text() == (ROOT / "crds" / "inferencepools.kvmesh.io.yaml").read_text(), (
        "cp crds/inferencepools.kvmesh.io.yaml charts/kvmesh/crds/")
    assert yaml.safe_load(chart_copy.read_text()) == crd.crd_manifest()
    with helm_python.Chart.load(CHART) as chart:
        assert [c["filename"] for c in chart.crds] == ["kvmesh/crds/inferencepools.kvmesh.io.yaml"]


# ---- what gets installed --------------------------------------------------------------------------------------


def test_monitoring_objects_only_where_the_prometheus_operator_is() -> None:
    without = {d["kind"] for d in manifests(RENDERINGS["default"])}
    with_api = {d["kind"] for d in manifests(RENDERINGS["default, Prometheus Operator"])}
    assert not without & PROMETHEUS_OPERATOR_KINDS
    assert with_api - without == PROMETHEUS_OPERATOR_KINDS


def test_a_pool_only_when_asked() -> None:
    assert by_kind(manifests(RENDERINGS["default"]), crd.KIND) == []
    (pool,) = by_kind(manifests(RENDERINGS["disaggregated pool, Prometheus Operator"]), crd.KIND)
    parsed = crd.parse_pool(pool)
    assert pool["metadata"] == {**pool["metadata"], "name": "chat", "namespace": "kvmesh"}
    assert pool["spec"] == DISAGGREGATED["pool"]["spec"]
    assert parsed is not None


def test_a_pool_spec_of_your_own_is_rendered_as_it_is() -> None:
    """Helm merges a release's maps into values.yaml's: while the bundled example lived there, a pool serving its
    own model got the example's model name (clients had to ask for smollm2 to reach Llama) and a 1 GiB host tier."""
    spec = {"model": {"source": "/models/Meta-Llama-3-8B-Instruct", "volumeClaim": "llama-weights"}}
    (pool,) = by_kind(manifests(render({"pool": {"enabled": True, "spec": spec}})), crd.KIND)
    assert pool["spec"] == spec
    parsed = crd.parse_pool(pool)
    assert parsed.spec["model"].get("name") in (None, "Meta-Llama-3-8B-Instruct")
    assert not parsed.spec["engine"].get("hostTierMiB")
    (bundled,) = by_kind(manifests(render({"pool": {"enabled": True}})), crd.KIND)
    assert bundled["spec"]["model"] == {"source": "bundled", "name": "smollm2-135m-instruct"}
    assert crd.parse_pool(bundled).spec["replicas"]["both"] == {"min": 1, "max": 4}


def rules_block(permissions: tuple[rbac.Permission, ...]) -> str:
    """The ClusterRole rules the chart's templates/operator-rbac.yaml should hold, with each rule's reason."""
    core = '""'
    return "".join(f"  # {p.why}\n  - apiGroups: [{p.group or core}]\n    resources: [{p.resource}]\n"
                   f"    verbs: [{', '.join(p.verbs)}]\n" for p in permissions)


def test_rbac_is_exactly_what_the_operator_uses() -> None:
    """The operator's rules are operator/rbac.py's list: a ClusterRole bound cluster-wide, or with
    operator.watchNamespaces a Role bound in each of those namespaces and nothing cluster-scoped. One more Role, in
    the release's namespace only, lets the operator get, create and update Leases for its leader election
    (operator/leader.py)."""
    expected = [p.rule() for p in rbac.OPERATOR]
    leader_election = [rbac.LEADER_ELECTION.rule()]
    for name, rendered in RENDERINGS.items():
        docs = manifests(rendered)
        watched = ["team-a", "team-b", "kvmesh"] if name == "namespaced operator" else []
        roles = by_kind(docs, "ClusterRole") + by_kind(docs, "Role")
        operator_roles = [r for r in roles if r["rules"] != leader_election]
        assert [r["kind"] for r in operator_roles] == (["Role"] * len(watched) if watched else ["ClusterRole"])
        assert [r["metadata"].get("namespace") for r in operator_roles] == (watched or [None])
        for role in operator_roles:
            assert role["rules"] == expected, (f"{name}: operator/rbac.py changed; paste into "
                                               f"templates/operator-rbac.yaml:\n{rules_block(rbac.OPERATOR)}")
        (lease_role,) = [r for r in roles if r["rules"] == leader_election]
        assert lease_role["kind"] == "Role" and lease_role["metadata"]["namespace"] == "kvmesh"
        bindings = by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding")
        assert len(bindings) == len(roles)
        (account,) = by_kind(docs, "ServiceAccount")
        for binding in bindings:
            (role,) = [r for r in roles if r["kind"] == binding["roleRef"]["kind"]
                       and r["metadata"]["name"] == binding["roleRef"]["name"]
                       and r["metadata"].get("namespace") == binding["metadata"].get("namespace")]
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                            "namespace": "kvmesh"}]


def test_operators_elect_a_leader_so_two_replicas_and_rolling_updates_are_safe() -> None:
    """Every rendering runs the operator with --leader-elect (one replica or two), its pod's name as the
    candidate's identity, and rolls it: the new pod stands by until the old one stops and releases the lease."""
    for name, rendered in RENDERINGS.items():
        (deployment,) = [d for d in by_kind(manifests(rendered), "Deployment")
                         if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert "--leader-elect" in container["args"], name
        env = {e["name"]: e.get("valueFrom") for e in container["env"]}
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        assert deployment["spec"]["replicas"] == (2 if name == "two operators" else 1)


@pytest.mark.parametrize("name", RENDERINGS)
def test_pods_are_locked_down(name: str) -> None:
    deployments = by_kind(manifests(RENDERINGS[name]), "Deployment")
    assert deployments
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert container["livenessProbe"] and container["readinessProbe"]


def test_the_operator_command_is_one_kvmesh_accepts() -> None:
    """The chart's arguments, given to the real `kvmesh operator` (with --render-crd, so it parses them, prints
    the CRD and exits without a cluster). operator.workers is passed only when set (else the operator's
    default)."""
    for name, workers in (("default", []), ("namespaced operator", ["--workers=128"])):
        (deployment,) = by_kind(manifests(RENDERINGS[name]), "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["args"][0] == "operator"
        assert [a for a in container["args"] if a.startswith("--workers")] == workers
        out = subprocess.run([sys.executable, "-m", "kvmesh.cli", *container["args"], "--render-crd"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert yaml.safe_load(out.stdout) == the_crd()


def operator_defaults(docs: list[dict[str, Any]]) -> crd.PoolDefaults:
    """What the rendered operator reads from its Deployment's environment as its pools' image and ports."""
    (deployment,) = [d for d in by_kind(docs, "Deployment") if d["spec"]["template"]["spec"]["containers"][0][
        "args"][0] == "operator"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return crd.PoolDefaults.from_env({e["name"]: e["value"] for e in container["env"] if "value" in e})


def test_the_operator_runs_the_image_and_ports_the_pools_default_to() -> None:
    docs = manifests(RENDERINGS["default"])
    assert operator_defaults(docs) == crd.PoolDefaults()
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == crd.DEFAULT_IMAGE


def test_pools_run_the_charts_image_and_ports_not_the_public_registrys() -> None:
    """An air-gapped cluster pulls from a mirror and may move the ports: the pools the operator makes (the chart's
    own pool here, whose spec names neither) run the mirror's image on the ports the NetworkPolicies and
    PodMonitor admit. With the CRD's defaults they pulled ghcr.io and listened where no policy let traffic in."""
    values = {"image": {"repository": "registry.internal/ml/kvmesh", "tag": "7.7.7"},
              "ports": {"engine": 9100, "router": 9180}, "pool": {"enabled": True}}
    docs = manifests(render(values, api_versions=(MONITORING_API,)))
    defaults = operator_defaults(docs)
    assert defaults == crd.PoolDefaults("registry.internal/ml/kvmesh:7.7.7", 9100, 9180)
    (pool_body,) = by_kind(docs, crd.KIND)
    assert {"image", "port"}.isdisjoint(pool_body["spec"].get("engine") or {})
    pool = crd.parse_pool(pool_body, defaults)
    containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                  for d in by_kind(desired.desired_objects(pool), "Deployment")}
    assert {c["image"] for c in containers.values()} == {"registry.internal/ml/kvmesh:7.7.7"}
    ports = {name: c["ports"][0]["containerPort"] for name, c in containers.items()}
    assert ports == {desired.engine_name(pool, "both"): 9100, desired.router_name(pool): 9180}
    # the policies admit the pods' serving ports (tests/test_chart_monitoring.py: and the PodMonitor scrapes them)
    with pool_pods_in_the_harness(docs) as pods:
        assert {port for _, ports in pods.values() for port in ports.values()} == {9100, 9180}
        assert allowed(by_kind(docs, "NetworkPolicy"), "router", "pool-both", 9100)
        assert allowed(by_kind(docs, "NetworkPolicy"), "prometheus", "pool-router", 9180)


def test_pools_running_the_charts_image_pull_it_with_the_charts_pull_secrets() -> None:
    """A private registry: the chart's imagePullSecrets reached the operator's pod alone, and every pool's engines
    and routers sat in ImagePullBackOff. The operator now gives them to the pools that run its own image."""
    values = {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror-cred"}], "pool": {"enabled": True}}
    docs = manifests(render(values, api_versions=(MONITORING_API,)))
    defaults = operator_defaults(docs)
    assert defaults.image_pull_secrets == ("regcred", "mirror-cred")
    (pool_body,) = by_kind(docs, crd.KIND)
    for deployment in by_kind(desired.desired_objects(crd.parse_pool(pool_body, defaults)), "Deployment"):
        assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"},
                                                                            {"name": "mirror-cred"}]
    assert operator_defaults(manifests(RENDERINGS["default"])).image_pull_secrets == ()


def test_a_pool_that_names_its_image_and_ports_keeps_them() -> None:
    spec = {"model": {"source": "bundled"}, "engine": {"image": "example.org/kvmesh:dev", "port": 7000},
            "router": {"port": 7080}}
    pool = crd.parse_pool({"metadata": {"name": "p"}, "spec": spec}, crd.PoolDefaults("mirror/kvmesh:1", 1, 2))
    assert (pool.spec["engine"]["image"], pool.spec["engine"]["port"], pool.spec["router"]["port"]) == (
        "example.org/kvmesh:dev", 7000, 7080)


@pytest.mark.parametrize("env", [{"KVMESH_ENGINE_PORT": "http"}, {"KVMESH_ROUTER_PORT": "70000"}])
def test_the_operator_refuses_a_port_variable_that_is_not_a_port(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=next(iter(env))):
        crd.PoolDefaults.from_env(env)


def test_dashboards_are_configmaps_for_grafanas_sidecar() -> None:
    maps = by_kind(manifests(RENDERINGS["default"]), "ConfigMap")
    shipped = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped.update(cm["data"])
    assert shipped == {p.name: p.read_text() for p in DASHBOARDS}
    assert all(json.loads(text)["uid"] for text in shipped.values())
    assert by_kind(manifests(render({"dashboards": {"enabled": False}})), "ConfigMap") == []


def test_notes_say_how_to_reach_the_router() -> None:
    notes = RENDERINGS["disaggregated pool, Prometheus Operator"]["kvmesh/templates/NOTES.txt"]
    assert "port-forward svc/chat-router 8080:8080" in notes
    assert "routerAddress" in notes
    assert "svc/<pool>-router" in RENDERINGS["default"]["kvmesh/templates/NOTES.txt"]


def test_notes_name_only_the_monitoring_objects_installed() -> None:
    """With the Prometheus Operator present but every monitor turned off, the notes had said all three were
    installed: an operator then waited for alerts nothing would fire."""
    off = {name: {"enabled": False} for name in ("podMonitor", "serviceMonitor", "prometheusRule")}
    notes = render({"monitoring": off}, api_versions=(MONITORING_API,))["kvmesh/templates/NOTES.txt"]
    assert "no PodMonitor, ServiceMonitor or PrometheusRule installed" in notes
    only_rules = {**off, "prometheusRule": {"enabled": True}}
    notes = render({"monitoring": only_rules}, api_versions=(MONITORING_API,))["kvmesh/templates/NOTES.txt"]
    assert "installed a PrometheusRule (alerts)." in notes and "PodMonitor" not in notes


def test_notes_give_the_gateway_s_address() -> None:
    notes = render({"gateway": {"enabled": True}}, name="llm")["kvmesh/templates/NOTES.txt"]
    assert "http://llm-kvmesh-gateway.kvmesh.svc:8090/v1" in notes
    assert "gateway" not in RENDERINGS["default"]["kvmesh/templates/NOTES.txt"]


@pytest.mark.parametrize("release", ["1st", "llm.prod", "LLM"])
def test_a_release_name_no_service_can_carry_is_refused(release: str) -> None:
    """Helm takes these names, but the Services named after them are refused by the API server mid-install."""
    with pytest.raises(helm_python.HelmError, match=f"release name \"{re.escape(release)}\""):
        render(name=release)


def test_notes_show_a_key_to_a_pool_with_api_keys() -> None:
    """A keyed pool's router answers /v1/models with 401 to a request without a key: the notes' curl sends one."""
    keyed = render({"pool": {"enabled": True, "name": "chat", "spec": {"model": {"source": "bundled"},
                                                                       "router": {"apiKeys": {"secretName": "keys"}}}}})
    (curl,) = [line for line in keyed["kvmesh/templates/NOTES.txt"].splitlines() if "curl" in line]
    assert 'curl http://127.0.0.1:8080/v1/models -H "Authorization: Bearer $KEY"' in curl


def test_notes_give_the_port_the_pool_s_router_listens_on() -> None:
    """A pool.spec.router.port is the router's port (the operator gives its container and Service that one): the
    notes print it, as the `helm test` pod asks it, not ports.router."""
    rendered = render({"pool": {"enabled": True, "name": "chat", "spec": {"model": {"source": "bundled"},
                                                                          "router": {"port": 9999}}}})
    notes = rendered["kvmesh/templates/NOTES.txt"]
    assert "port-forward svc/chat-router 9999:9999" in notes and "curl http://127.0.0.1:9999/v1/models" in notes
    assert "http://chat-router.kvmesh.svc:9999/v1" in notes and "8080" not in notes
    (pod,) = by_kind(manifests(rendered), "Pod")
    assert "--url=http://chat-router.kvmesh.svc:9999" in pod["spec"]["containers"][0]["args"]
    (pool_body,) = by_kind(manifests(rendered), crd.KIND)
    router = desired.router_deployment(crd.parse_pool(pool_body, operator_defaults(manifests(rendered))))
    assert router["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9999


# The longest release name Helm takes (53), names that begin alike (blue-green releases), and a fullname that is
# the release name itself (it contains the chart's name)
LONG_NAMES = ("a" * 53, "inference-platform-production-eu-west-1-kvmesh-blue2",
              "inference-platform-production-eu-west-1-kvmesh-green", "llm-serving-platform-production-eu-west-1-aa1")


def test_dashboards_of_a_long_release_name_get_distinct_valid_names() -> None:
    """Each dashboard's ConfigMap keeps its `-dashboard-<file>` suffix under the 63-character limit: cut at 63,
    a long fullname left the four names equal (one ConfigMap, applied four times); two long release names that
    begin alike keep theirs apart too (their ConfigMaps may share dashboards.namespace)."""
    short = {cm["metadata"]["name"] for cm in by_kind(manifests(RENDERINGS["default"]), "ConfigMap")}
    assert short == {f"kvmesh-dashboard-{p.stem}" for p in DASHBOARDS}  # short names are left as they were
    seen: set[str] = set()
    for release in LONG_NAMES:
        maps = by_kind(manifests(render(name=release)), "ConfigMap")
        names = {cm["metadata"]["name"] for cm in maps}
        assert len(names) == len(DASHBOARDS) == len(maps), names
        for cm in maps:
            kubernetes_validate.validate(cm, KUBERNETES, strict=True)
            name = cm["metadata"]["name"]
            assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum(), name
            (data_key,) = cm["data"]
            assert name.endswith(f"-dashboard-{data_key.removesuffix('.json')}"), name
        assert not names & seen
        seen |= names


def test_the_documented_helm_template_renders_the_monitoring_objects_and_no_test_pod() -> None:
    """docs/operations.md's install without Helm's release machinery: `helm template` sees no cluster, so without
    --api-versions it leaves out the PodMonitor, ServiceMonitor and PrometheusRule, and without --skip-tests it
    emits the `helm test` pod, which kubectl would start at once."""
    text = (ROOT / "docs" / "operations.md").read_text()
    (command,) = [line for line in text.replace("\\\n", " ").splitlines() if line.startswith("helm template ")]
    args = command.split()
    assert args[args.index("--api-versions") + 1] == MONITORING_API and "--skip-tests" in args
    rendered = render({"pool": {"enabled": True}}, api_versions=(MONITORING_API,))
    docs = manifests(rendered)
    assert {d["kind"] for d in docs} >= PROMETHEUS_OPERATOR_KINDS
    hooks = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    assert [d["kind"] for d in hooks] == ["Pod"]  # what --skip-tests leaves out


# ---- NetworkPolicies: who may reach whom ------------------------------------------------------------------------

ROUTER, ENGINE, OPERATOR_METRICS = 8080, 8000, 9090
OPERATOR_LABELS = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/instance": "kvmesh",
                   "app.kubernetes.io/component": "operator"}
PODS = {  # name -> (namespace, labels)
    "client": ("apps", {"app": "web"}),
    "router": ("kvmesh", {"kvmesh.io/role": "router", "kvmesh.io/pool": "chat"}),
    "prefill": ("kvmesh", {"kvmesh.io/role": "prefill", "kvmesh.io/pool": "chat"}),
    "decode": ("kvmesh", {"kvmesh.io/role": "decode", "kvmesh.io/pool": "chat"}),
    "both": ("kvmesh", {"kvmesh.io/role": "both", "kvmesh.io/pool": "chat"}),
    "operator": ("kvmesh", OPERATOR_LABELS),
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "stranger": ("kvmesh", {"app": "debug"}),  # some other pod in the pools' namespace
}
ENGINES = ("prefill", "decode", "both")
PORTS = {"router": ROUTER, "prefill": ENGINE, "decode": ENGINE, "both": ENGINE, "operator": OPERATOR_METRICS}
# The ports each pod names: a NetworkPolicy port given by name admits the selected pod's container port of that name
# (the operator's names, operator/desired.py: `http`, and a router's ext_proc port; the chart's operator's)
NAMED_PORTS: dict[str, dict[str, int]] = {
    "router": {"http": ROUTER, desired.EXT_PROC_PORT_NAME: GATEWAY_EXT_PROC_PORT},
    **{engine: {"http": ENGINE} for engine in ENGINES},
    "operator": {"metrics": OPERATOR_METRICS, "health": 8081},
}


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        value, present = labels.get(e["key"]), e["key"] in labels
        ok = {"In": present and value in e.get("values", []), "NotIn": not present or value not in e["values"],
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def allowed(policies: list[dict[str, Any]], source: str, target: str, port: int) -> bool:
    """NetworkPolicy ingress semantics: a pod no policy selects takes anything; a selected pod takes what some
    rule of a selecting policy allows (a peer with only podSelector means the policy's namespace)."""
    src_ns, src_labels = PODS[source]
    dst_ns, dst_labels = PODS[target]
    selecting = [p for p in policies if p["metadata"]["namespace"] == dst_ns
                 and selects(p["spec"]["podSelector"], dst_labels) and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True

    def peer_matches(peer: dict[str, Any], policy_ns: str) -> bool:
        if "ipBlock" in peer:
            return False  # these test pods have cluster addresses outside any client CIDR
        if "namespaceSelector" in peer:
            in_ns = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
        else:
            in_ns = src_ns == policy_ns
        return in_ns and selects(peer.get("podSelector"), src_labels)

    named = NAMED_PORTS.get(target, {})
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports_ok = not rule.get("ports") or any(port in (p["port"], named.get(p["port"])) for p in rule["ports"])
            peers_ok = not rule.get("from") or any(peer_matches(p, dst_ns) for p in rule["from"])
            if ports_ok and peers_ok:
                return True
    return False


def reachable(policies: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """Every (source, target) pair whose traffic to the target's port gets through."""
    return {(s, t) for s in PODS for t in PORTS if s != t or t in ENGINES
            if allowed(policies, s, t, PORTS[t])}


def test_network_policies_allow_exactly_the_traffic_kvmesh_needs() -> None:
    policies = by_kind(manifests(RENDERINGS["default"]), "NetworkPolicy")
    expected = (
        {(s, "router") for s in PODS if s != "router"}  # clients: anyone, by default
        | {(s, e) for e in ENGINES for s in ("router", *ENGINES, "operator", "prometheus")}
        | {("prometheus", "operator")}
    )
    assert reachable(policies) == expected
    # and only on the serving port: nothing reaches an engine or the operator on another port
    assert not allowed(policies, "router", "both", 22)
    assert not allowed(policies, "prometheus", "operator", 8081)


def test_clients_can_be_narrowed_to_named_peers() -> None:
    apps = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}
    policies = by_kind(manifests(render({"networkPolicy": {"clients": [apps]}})), "NetworkPolicy")
    to_router = {s for s, t in reachable(policies) if t == "router"}
    assert to_router == {"client", "operator", "prometheus"}


def test_a_gateway_reaches_the_engines_only_when_named() -> None:
    PODS["gateway"] = ("gateway", {"app": "envoy"})
    try:
        gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
                   "podSelector": {"matchLabels": {"app": "envoy"}}}
        for values, engines in (({}, set()), ({"networkPolicy": {"gateway": [gateway]}}, set(ENGINES))):
            policies = by_kind(manifests(render(values)), "NetworkPolicy")
            assert {t for s, t in reachable(policies) if s == "gateway"} == {"router", *engines}
    finally:
        del PODS["gateway"]


@contextmanager
def pool_pods_in_the_harness(docs: list[dict[str, Any]]) -> Iterator[dict[str, tuple[dict[str, str], dict[str, int]]]]:
    """The pods the operator makes for the rendering's InferencePool (its own reading of it, with the defaults the
    rendered operator gives it), as the harness's targets `pool-<role>` with their labels and named container
    ports; yields them by role."""
    (body,) = by_kind(docs, crd.KIND)
    pool = crd.parse_pool(body, operator_defaults(docs))
    pods = {}
    for deployment in by_kind(desired.desired_objects(pool), "Deployment"):
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        labels = template["metadata"]["labels"]
        pods[labels[ROLE_LABEL]] = (labels, {p["name"]: p["containerPort"] for p in container["ports"]})
    for role, (labels, ports) in pods.items():
        PODS[f"pool-{role}"] = (body["metadata"]["namespace"], labels)
        NAMED_PORTS[f"pool-{role}"] = ports
    try:
        yield pods
    finally:
        for role in pods:
            del PODS[f"pool-{role}"], NAMED_PORTS[f"pool-{role}"]


# A pool on ports of its own, behind a Gateway (gatewayInferencePool) whose endpoint picker is on its own port too
OWN_PORTS = {"pool": {"enabled": True, "name": "chat", "spec": {
    "model": {"source": "bundled"}, "engine": {"port": 7000},
    "router": {"port": 7080, "settings": {"ext_proc_port": 9100}}, "gatewayInferencePool": {"enabled": True},
}}}
GATEWAY_PROXY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
                 "podSelector": {"matchLabels": {"app": "envoy"}}}


def test_a_pool_on_ports_of_its_own_gets_its_traffic() -> None:
    """The policies name the pods' ports (`http`, the router's ext_proc port) instead of numbering them: a pool
    whose spec moves its ports (engine.port, router.port, router.settings.ext_proc_port) still takes its clients,
    routers, peers, operator, Prometheus and Gateway. Numbered, they let nothing in on 7000, 7080 or 9100, and the
    Gateway's FailClose then refused every request."""
    PODS["envoy"] = ("gateway", {"app": "envoy"})
    try:
        docs = manifests(render({**OWN_PORTS, "networkPolicy": {"gateway": [GATEWAY_PROXY]}}))
        policies = by_kind(docs, "NetworkPolicy")
        with pool_pods_in_the_harness(docs) as pods:
            assert pods["router"][1] == {"http": 7080, desired.EXT_PROC_PORT_NAME: 9100}
            assert pods["both"][1] == {"http": 7000}
            for source in ("client", "operator", "prometheus", "envoy"):
                assert allowed(policies, source, "pool-router", 7080), source
            for source in ("router", "pool-router", "pool-both", "operator", "prometheus", "envoy"):
                assert allowed(policies, source, "pool-both", 7000), source
            assert allowed(policies, "envoy", "pool-router", 9100)  # the Gateway asks its endpoint picker
            assert not allowed(policies, "client", "pool-router", 9100)  # only the Gateway's proxies
            assert not allowed(policies, "client", "pool-both", 7000)
            assert not allowed(policies, "router", "pool-both", 8000)  # nothing else opens
    finally:
        del PODS["envoy"]


def test_network_policies_can_be_turned_off() -> None:
    assert by_kind(manifests(render({"networkPolicy": {"enabled": False}})), "NetworkPolicy") == []


def test_a_standby_operator_gets_a_disruption_budget_of_one() -> None:
    """A node drain evicts one operator replica at a time, so the other can take the lease; one replica has no
    budget (it would block every drain)."""
    assert not by_kind(manifests(RENDERINGS["default"]), "PodDisruptionBudget")
    docs = manifests(RENDERINGS["two operators"])
    (budget,) = by_kind(docs, "PodDisruptionBudget")
    (deployment,) = by_kind(docs, "Deployment")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
