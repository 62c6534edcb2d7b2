"""What the chart asks the Prometheus Operator to scrape: each ServiceMonitor resolves, as the operator resolves it
(Service by labels, named port, targetPort on the pods behind it), to a port the NetworkPolicies let Prometheus
reach, for the operator and, with gateway.enabled, `kvmesh gateway`; every pod is scraped once."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from .promql import RULES
from .test_chart import (
    MONITORING_API,
    OWN_PORTS,
    PODS,
    allowed,
    by_kind,
    manifests,
    pool_pods_in_the_harness,
    render,
    selects,
)
from .test_chart_gateway import APPS, GATEWAY

GATEWAY_MONITOR = "kvmesh-gateway"


def monitoring(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return manifests(render(values, api_versions=(MONITORING_API,)))


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def scrape_targets(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str], int]]:
    """(ServiceMonitor, labels of a pod it scrapes, container port) for every endpoint of every ServiceMonitor."""
    found = []
    for monitor in by_kind(docs, "ServiceMonitor"):
        namespace = monitor["metadata"]["namespace"]
        services = [s for s in by_kind(docs, "Service") if s["metadata"]["namespace"] == namespace
                    and selects(monitor["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert services, f"{monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            for service in services:
                (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                for deployment in by_kind(docs, "Deployment"):
                    if not selects({"matchLabels": service["spec"]["selector"]}, pod_labels(deployment)):
                        continue
                    container_ports = [p for c in deployment["spec"]["template"]["spec"]["containers"]
                                       for p in c["ports"] if port["targetPort"] in (p["name"], p["containerPort"])]
                    (container_port,) = container_ports
                    found.append((monitor["metadata"]["name"], pod_labels(deployment),
                                  container_port["containerPort"]))
    return found


def gateway_monitors(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in by_kind(docs, "ServiceMonitor") if m["metadata"]["name"] == GATEWAY_MONITOR]


def test_the_gateway_is_scraped_only_when_it_runs_and_the_prometheus_operator_is_there() -> None:
    assert not gateway_monitors(monitoring())
    assert not gateway_monitors(manifests(render({"gateway": {"enabled": True}})))  # no monitoring.coreos.com
    off = {"gateway": {"enabled": True}, "monitoring": {"serviceMonitor": {"enabled": False}}}
    assert not by_kind(monitoring(off), "ServiceMonitor")
    (monitor,) = gateway_monitors(monitoring({"gateway": {"enabled": True},
                                              "monitoring": {"labels": {"release": "kps"}}}))
    assert monitor["metadata"]["labels"]["release"] == "kps"  # the label a kube-prometheus-stack selects


@pytest.mark.parametrize("values", [
    {},
    {"gateway": {"clients": [APPS]}},  # the gateway narrowed to named clients: Prometheus still scrapes it
    {"gateway": {"clients": [APPS], "port": 9000}, "networkPolicy": {"clients": [APPS]}},
])
def test_every_service_monitor_scrapes_a_port_prometheus_may_reach(values: dict[str, Any]) -> None:
    docs = monitoring({**values, "gateway": {"enabled": True, **values.get("gateway", {})}})
    targets = scrape_targets(docs)
    assert {(name, labels["app.kubernetes.io/component"]) for name, labels, _ in targets} == {
        ("kvmesh-operator", "operator"), (GATEWAY_MONITOR, "gateway")}
    gateway_port = values.get("gateway", {}).get("port", GATEWAY)
    assert {port for name, _, port in targets if name == GATEWAY_MONITOR} == {gateway_port}
    policies = by_kind(docs, "NetworkPolicy")
    for name, labels, port in targets:
        PODS["scraped"] = ("kvmesh", labels)
        try:
            assert allowed(policies, "prometheus", "scraped", port), f"Prometheus cannot reach {name}'s port {port}"
        finally:
            del PODS["scraped"]


def test_the_pool_pod_monitor_leaves_the_gateway_to_its_own_monitor() -> None:
    """One scrape per gateway pod: the PodMonitor (pools' engines and routers, labelled with their pool) does not
    select it, so its series come once and carry no pool."""
    docs = monitoring({"gateway": {"enabled": True}})
    (pod_monitor,) = by_kind(docs, "PodMonitor")
    gateway_pods = [labels for name, labels, _ in scrape_targets(docs) if name == GATEWAY_MONITOR]
    assert gateway_pods
    for labels in gateway_pods:
        assert not selects(pod_monitor["spec"]["selector"], labels)
        assert "kvmesh.io/pool" not in labels


def pod_monitor_scrapes(monitor: dict[str, Any], namespace: str, labels: dict[str, str],
                        ports: dict[str, int]) -> list[int]:
    """The container ports (by name) of one pod that a PodMonitor makes scrape targets, as the Prometheus Operator
    resolves it: the pod's namespace and labels against its selectors, then each endpoint's `port` (a container
    port's name) or `portNumber`, and its keep and drop relabelings over the pod's meta labels."""
    spec = monitor["spec"]
    namespaces = spec.get("namespaceSelector") or {}
    if not namespaces.get("any") and namespace not in (namespaces.get("matchNames")
                                                       or [monitor["metadata"]["namespace"]]):
        return []
    if not selects(spec["selector"], labels):
        return []
    found = []
    for endpoint in spec["podMetricsEndpoints"]:
        for name, number in ports.items():
            if endpoint.get("port", name) != name or endpoint.get("portNumber", number) != number:
                continue
            meta = {"__meta_kubernetes_pod_container_port_name": name,
                    "__meta_kubernetes_pod_container_port_number": str(number),
                    **{"__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", k): v for k, v in labels.items()}}
            kept = True
            for rule in endpoint.get("relabelings") or []:
                if rule.get("action") in ("keep", "drop"):
                    value = rule.get("separator", ";").join(meta.get(s, "") for s in rule["sourceLabels"])
                    matched = re.fullmatch(rule.get("regex", "(.*)"), value) is not None
                    kept = kept and matched == (rule["action"] == "keep")
            if kept:
                found.append(number)
    return found


@pytest.mark.parametrize("values", [{"pool": {"enabled": True}}, OWN_PORTS], ids=["default ports", "own ports"])
def test_the_pod_monitor_scrapes_each_pool_pod_once_on_its_serving_port(values: dict[str, Any]) -> None:
    """Engines and routers are scraped on their serving port (metrics share it), which the operator names `http`
    whatever number the pool gives it: a pool on its own ports (engine.port, router.port) is scraped too, and a
    router's ext_proc port (gRPC) is not. Numbered (ports.engine|ports.router), such a pool had no target at all,
    so the dashboards, the alerts and KvmeshPoolHasNoEngines knew nothing of it."""
    docs = monitoring(values)
    (monitor,) = by_kind(docs, "PodMonitor")
    with pool_pods_in_the_harness(docs) as pods:
        assert pods
        for role, (labels, ports) in pods.items():
            for namespace in ("kvmesh", "team-a"):  # every namespace: the operator watches them all
                assert pod_monitor_scrapes(monitor, namespace, labels, ports) == [ports["http"]], (role, ports)
    # (with the chart's pool the release's namespace must be watched too: tests/test_chart_release.py)
    confined = by_kind(monitoring({**values, "operator": {"watchNamespaces": ["team-a", "kvmesh"]}}),
                       "PodMonitor")[0]
    labels, ports = pods["router"]
    assert pod_monitor_scrapes(confined, "team-a", labels, ports) == [ports["http"]]
    assert pod_monitor_scrapes(confined, "team-b", labels, ports) == []


def test_the_operator_s_targets_carry_the_label_its_down_alert_selects() -> None:
    """KvmeshOperatorDown selects `up{component="operator"}`: the operator's ServiceMonitor must set that label on
    its targets (and on no other monitor's), or the alert can never fire."""
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert 'up{component="operator"}' in rules["KvmeshOperatorDown"]["expr"]
    docs = monitoring({"gateway": {"enabled": True}})
    labelled = {m["metadata"]["name"]: {r["targetLabel"]: r["replacement"] for e in m["spec"]["endpoints"]
                                        for r in e.get("relabelings", []) if "replacement" in r}
                for m in by_kind(docs, "ServiceMonitor")}
    operator = next(name for name in labelled if name != GATEWAY_MONITOR)
    assert labelled[operator] == {"component": "operator"}
    assert labelled[GATEWAY_MONITOR].get("component") != "operator"
