"""The chart's `kvmesh gateway` (gateway.enabled): valid locked-down manifests, RBAC that lists exactly the
InferencePools operator/crd.py names, arguments the real `kvmesh gateway` accepts, and NetworkPolicies that let
clients reach the gateway and the gateway reach the routers, however narrowly networkPolicy.clients is set."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from kvmesh.operator import rbac
from kvmesh.router.gateway import DEFAULT_PORT

from .test_chart import CHART, KUBERNETES, PODS, PORTS, by_kind, manifests, reachable, render

GATEWAY = DEFAULT_PORT  # the chart must give the port the gateway listens on by default
APPS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}


def gateway_objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    docs = manifests(render({"gateway": {"enabled": True, **(values or {})}}))
    return [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"]


def test_no_gateway_unless_enabled() -> None:
    docs = manifests(render())
    assert not [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"]


def test_the_gateway_s_manifests_are_valid_kubernetes_and_lint_clean() -> None:
    objects = gateway_objects()
    assert {d["kind"] for d in objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                            "Service", "NetworkPolicy"}
    for doc in objects + gateway_objects({"namespace": "team-a", "clients": [APPS]}):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    report = helm_python.lint(CHART, {"gateway": {"enabled": True}}, kube_version=f"v{KUBERNETES}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_rbac_lists_the_pools_and_nothing_else() -> None:
    (role,) = by_kind(gateway_objects(), "ClusterRole")
    assert role["rules"] == [p.rule() for p in rbac.GATEWAY]
    (binding,) = by_kind(gateway_objects(), "ClusterRoleBinding")
    (account,) = by_kind(gateway_objects(), "ServiceAccount")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    namespaced = gateway_objects({"namespace": "team-a"})
    assert not by_kind(namespaced, "ClusterRoleBinding") and not by_kind(namespaced, "ClusterRole")
    (role,) = by_kind(namespaced, "Role")
    assert role["rules"] == [p.rule() for p in rbac.GATEWAY] and role["metadata"]["namespace"] == "team-a"
    (binding,) = by_kind(namespaced, "RoleBinding")
    assert binding["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("values", [{}, {"namespace": "team-a", "refreshSeconds": 2.5, "port": 9000,
                                         "apiKeySecret": {"name": "gateway-key", "key": "token"}}])
def test_the_command_is_one_kvmesh_gateway_accepts(values: dict[str, Any]) -> None:
    """The chart's arguments given to the real `kvmesh gateway`, with a kubeconfig that does not exist: it parses
    them all, then stops at reading the cluster's settings (exit 2 with its own message, not argparse's)."""
    args = container(gateway_objects(values))["args"]
    assert args[:2] == ["gateway", "--kubernetes"]
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", *args, "--kubeconfig", "/nonexistent/kubeconfig"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("kvmesh gateway: kubernetes discovery"), out.stderr
    if values:
        assert "--namespace=team-a" in args and "--refresh-seconds=2.5" in args and "--port=9000" in args
        assert "--api-key-file=/etc/kvmesh/gateway-key/token" in args


def test_the_api_key_secret_is_a_read_only_volume_the_flag_points_into() -> None:
    """A volume of the Secret's one key (not an env var, not a subPath: the kubelet updates it in place when the
    Secret is rotated, and the gateway re-reads the file), mounted read-only where --api-key-file points."""
    assert not [a for a in container(gateway_objects())["args"] if a.startswith("--api-key-file")]
    objects = gateway_objects({"apiKeySecret": {"name": "gateway-key", "key": "token"}})
    for doc in objects:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    (deployment,) = by_kind(objects, "Deployment")
    gateway = container(objects)
    (flag,) = [a.split("=", 1)[1] for a in gateway["args"] if a.startswith("--api-key-file=")]
    (mount,) = [m for m in gateway["volumeMounts"] if flag.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True and "subPath" not in mount
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "gateway-key"
    (item,) = volume["secret"]["items"]
    assert item["key"] == "token" and flag == f"{mount['mountPath']}/{item['path']}"
    assert "env" not in gateway  # the key is in no environment variable of the pod


def test_the_pod_is_locked_down_and_probed() -> None:
    objects = gateway_objects()
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    gateway = container(objects)
    sc = gateway["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/metrics"  # alive with no pool yet
    (service,) = by_kind(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == GATEWAY
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.fixture
def gateway_pod() -> Iterator[None]:
    """A kvmesh gateway pod among test_chart's pods, as a source and a target."""
    PODS["kvgateway"] = ("kvmesh", {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/instance": "kvmesh",
                                    "app.kubernetes.io/component": "gateway"})
    PORTS["kvgateway"] = GATEWAY
    try:
        yield
    finally:
        del PODS["kvgateway"], PORTS["kvgateway"]


@pytest.mark.usefixtures("gateway_pod")
def test_clients_reach_the_gateway_and_the_gateway_reaches_the_routers() -> None:
    for values, callers in (
        ({"gateway": {"enabled": True}}, {s for s in PODS if s != "kvgateway"}),
        ({"gateway": {"enabled": True, "clients": [APPS]}}, {"client", "prometheus"}),
        # routers narrowed to named clients: the gateway still reaches them
        ({"gateway": {"enabled": True, "clients": [APPS]}, "networkPolicy": {"clients": [APPS]}},
         {"client", "prometheus"}),
    ):
        pairs = reachable(by_kind(manifests(render(values)), "NetworkPolicy"))
        assert {s for s, t in pairs if t == "kvgateway"} == callers
        assert ("kvgateway", "router") in pairs
        assert not {("kvgateway", e) for e in ("prefill", "decode", "both", "operator")} & pairs
    narrowed = reachable(by_kind(manifests(render({"gateway": {"enabled": True},
                                                   "networkPolicy": {"clients": [APPS]}})), "NetworkPolicy"))
    assert {s for s, t in narrowed if t == "router"} == {"client", "operator", "prometheus", "kvgateway"}


def test_replicas_spread_over_nodes_and_drain_one_at_a_time() -> None:
    """The gateway is the one data-path endpoint the chart runs: its replicas could all land on one node, and a
    drain evicted them together."""
    one = gateway_objects()
    assert "affinity" not in container_spec(one) and not by_kind(one, "PodDisruptionBudget")
    three = gateway_objects({"replicas": 3})
    (budget,) = by_kind(three, "PodDisruptionBudget")
    (deployment,) = by_kind(three, "Deployment")
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pods.items()
    (term,) = container_spec(three)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pods.items()
    zones = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {"matchLabels": {"app": "x"}}}]}}
    assert container_spec(gateway_objects({"replicas": 3, "affinity": zones}))["affinity"] == zones
    for doc in three:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def container_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway Deployment's pod spec."""
    (deployment,) = by_kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_the_schema_rejects_bad_gateway_values() -> None:
    for bad in ({"port": 70000}, {"refreshSeconds": 0}, {"unknown": 1}, {"namespace": "Not_A_Namespace"},
                {"apiKeySecret": {"name": "Gateway_Key"}}, {"apiKeySecret": {"name": "k", "key": "a/b"}},
                {"apiKeySecret": {"name": "k", "key": ".."}}, {"apiKeySecret": {"name": "k", "secretName": "k"}},
                {"apiKeySecret": "gateway-key"}):
        with pytest.raises(helm_python.HelmValuesError):
            render({"gateway": {"enabled": True, **bad}})
