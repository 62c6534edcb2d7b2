"""The chart across releases: upgrades that reuse an older release's values, images that change under one tag,
several releases in one cluster (leader Leases, cluster-scoped names, what a namespaced operator watches), and
values the schema or the templates refuse before anything is applied (the restricted pod security among them)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from kvmesh import cli
from kvmesh.operator import crd, desired

from .test_chart import (
    CHART,
    KUBERNETES,
    MONITORING_API,
    PROMETHEUS_OPERATOR_KINDS,
    ROOT,
    by_kind,
    manifests,
    operator_defaults,
    render,
)

OPERATIONS = ROOT / "docs" / "operations.md"


def render_chart(chart: Path, values: dict[str, Any], namespace: str = "kvmesh") -> dict[str, str]:
    options = {"name": "kvmesh", "namespace": namespace, "api_versions": []}
    with helm_python.Chart.load(chart) as loaded:
        return json.loads(_native.call_string("helm_render", loaded._raw(), json.dumps(values), json.dumps(options)))


def valid(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] != crd.KIND and doc["kind"] not in PROMETHEUS_OPERATOR_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def deployment(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, "Deployment")
                if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def container(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (only,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return only


def section(title: str) -> str:
    """One `## title` section of docs/operations.md."""
    text = OPERATIONS.read_text()
    start = text.index(f"\n## {title}\n")
    return text[start:text.index("\n## ", start + 1)]


# ---- 1. upgrades with an older release's values ----------------------------------------------------------------

# The keys values.yaml gained since each older chart: `helm upgrade --reuse-values` renders the new templates with
# the old release's values, in which these are missing (the new values.yaml is not read at all).
OLDER_VALUES = {
    "first release (7698676)": [("gateway",), ("networkPolicy", "gateway")],
    "gateway without an API key (e47f038)": [("gateway", "apiKeySecret"), ("gateway", "bodyReadTimeoutSeconds")],
    "gateway without a body deadline (dcab88c)": [("gateway", "bodyReadTimeoutSeconds")],
}


@pytest.mark.parametrize("release", OLDER_VALUES)
def test_an_upgrade_over_an_older_release_s_values_renders_what_the_defaults_render(release: str,
                                                                                     tmp_path: Path) -> None:
    """The chart with an older release's values.yaml (what --reuse-values gives the templates) renders the
    operator and the gateway as the current defaults do. It failed on a nil apiKeySecret, or rendered
    `--body-read-timeout-seconds=`, which the gateway refuses at start: a crash loop after the upgrade."""
    chart = tmp_path / "kvmesh"
    shutil.copytree(CHART, chart)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in OLDER_VALUES[release]:
        parent = values
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    for asked in ({}, {"gateway": {"enabled": True}}):
        old = manifests(render_chart(chart, asked))
        new = manifests(render(asked))
        valid(old)
        assert deployment(old, "operator") == deployment(new, "operator")
        if asked:
            assert deployment(old, "gateway") == deployment(new, "gateway")
            assert container(old, "gateway")["args"][-2:] == ["--body-read-timeout-seconds=30", "--log-level=info"]
        else:
            assert not [d for d in old if d["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"]


@pytest.mark.parametrize("key", ["logLevel", "bodyReadTimeoutSeconds", "apiKeySecret", "refreshSeconds", "port"])
def test_a_gateway_key_set_to_null_renders_its_default(key: str) -> None:
    """Helm drops a key given null (`--set gateway.logLevel=null`), as --reuse-values leaves a new one out: the
    gateway's flag then carries values.yaml's default, not an empty value its program refuses."""
    defaults = container(manifests(render({"gateway": {"enabled": True}})), "gateway")
    nulled = container(manifests(render({"gateway": {"enabled": True, key: None}})), "gateway")
    assert nulled == defaults
    assert all(not a.endswith("=") for a in nulled["args"])


def test_the_docs_upgrade_without_reuse_values() -> None:
    """--reuse-values keeps the old release's values and drops the new chart's defaults: the docs give
    --reset-then-reuse-values (Helm 3.14 and later) or a values file instead."""
    text = OPERATIONS.read_text()
    assert re.findall(r"helm upgrade[^`]*?\s--reuse-values\b", text) == []
    assert "--reuse-values" in text  # said not to use
    assert "--reset-then-reuse-values" in section("Upgrade") and "Helm 3.14" in section("Upgrade")


# ---- 2. the image: a new tag or a digest at each upgrade ---------------------------------------------------------

DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_an_image_digest_is_what_every_pod_and_pool_runs() -> None:
    """image.digest (before the tag): the operator, the gateway, the test pod and the engines and routers of
    the pools that follow the operator's image (KVMESH_IMAGE) run repository@digest, so an upgrade to a new build
    pulls it even where the tag is reused and nodes keep images (IfNotPresent)."""
    values = {"image": {"repository": "registry.internal/kvmesh", "tag": "0.1.0", "digest": DIGEST},
              "pool": {"enabled": True}, "gateway": {"enabled": True}}
    docs = manifests(render(values))
    valid(docs)
    image = f"registry.internal/kvmesh@{DIGEST}"
    assert container(docs, "operator")["image"] == container(docs, "gateway")["image"] == image
    (test_pod,) = by_kind(docs, "Pod")
    assert test_pod["spec"]["containers"][0]["image"] == image
    defaults = operator_defaults(docs)
    assert defaults.image == image
    (pool,) = by_kind(docs, crd.KIND)
    pods = [d["spec"]["template"]["spec"]["containers"][0]
            for d in by_kind(desired.desired_objects(crd.parse_pool(pool, defaults)), "Deployment")]
    assert pods and {c["image"] for c in pods} == {image}
    # no digest: the tag, as before
    assert container(manifests(render({"image": {"tag": "0.2.0"}})), "operator")["image"] == (
        "ghcr.io/kvmesh/kvmesh:0.2.0")
    for bad in ("0123", "sha256:" + "0" * 63, "md5:" + "0" * 64, DIGEST.upper()):
        with pytest.raises(helm_python.HelmValuesError):
            render({"image": {"digest": bad}})


def test_the_docs_say_each_upgrade_names_a_new_tag_or_a_digest() -> None:
    upgrade = section("Upgrade")
    assert "image.digest" in upgrade and "image.tag" in upgrade and "IfNotPresent" in upgrade
    assert "KVMESH_IMAGE" in upgrade and "engine.image" in upgrade
    assert "helm history" in upgrade


# ---- 3. one leader Lease per release -----------------------------------------------------------------------------


def lease_name(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> str:
    """The Lease the rendered operator's own arguments make it elect on (kvmesh/cli.py's reading of them)."""
    parser = argparse.ArgumentParser()
    cli._operator_parser(parser.add_subparsers(dest="command"))
    monkeypatch.setenv("POD_NAMESPACE", "kvmesh")
    election = cli._election(parser.parse_args(container(docs, "operator")["args"]))
    assert election is not None
    return election.name


def test_two_releases_in_one_namespace_elect_on_their_own_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --leader-elect-lease-name both operators took the `kvmesh-operator` Lease: one of the two releases
    had no leader at all (and its pools no reconciler) while the other's led."""
    names = {}
    for release in ("kvmesh", "blue", "green"):
        docs = manifests(render({"operator": {"watchNamespaces": [f"team-{release}"]}}, name=release))
        names[release] = lease_name(docs, monkeypatch)
        assert names[release] == deployment(docs, "operator")["metadata"]["name"]
    assert names["kvmesh"] == "kvmesh-operator"  # the default release keeps the Lease it had
    assert len(set(names.values())) == 3
    lease = re.search(r"^kubectl .*get lease (\S+)", section("High availability"), re.M)
    assert lease and lease.group(1) == "kvmesh-operator"


# ---- 4. releases of one name in several namespaces ---------------------------------------------------------------


def identities(docs: list[dict[str, Any]]) -> set[tuple[str, str | None, str]]:
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}


@pytest.mark.parametrize("values", [{}, {"operator": {"watchNamespaces": ["shared"]},
                                         "gateway": {"enabled": True, "namespace": "shared"}}],
                         ids=["cluster-wide", "both watching one namespace"])
def test_releases_of_one_name_in_two_namespaces_share_no_object(values: dict[str, Any]) -> None:
    """A release `kvmesh` in team-a and another in team-b: their ClusterRoles and ClusterRoleBindings had the same
    names, so the second install failed (or, adopted, rebound the first operator's role to the second's account).
    The names of objects outside the release's namespace now carry that namespace."""
    values = {"gateway": {"enabled": True}, **values}
    a = manifests(render(values, namespace="team-a"))
    b = manifests(render(values, namespace="team-b"))
    valid(a + b)
    assert not identities(a) & identities(b)


def test_a_namespaced_operator_has_nothing_cluster_scoped() -> None:
    """With operator.watchNamespaces the operator (kopf standalone: no peering; no namespace or CRD scanning;
    every call namespaced, operator/kube.py) needs no cluster-wide object: a Role and a RoleBinding in each watched
    namespace, not a ClusterRole that any binding could reuse. The gateway with gateway.namespace likewise."""
    values = {"operator": {"watchNamespaces": ["team-a", "kvmesh"]}, "pool": {"enabled": True},
              "gateway": {"enabled": True, "namespace": "team-a"}}
    docs = manifests(render(values, api_versions=(MONITORING_API,)))
    valid(docs)
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
    cluster_wide = manifests(render({"gateway": {"enabled": True}}))
    assert {r["metadata"]["name"] for r in by_kind(cluster_wide, "ClusterRole")} == {
        "kvmesh-operator-kvmesh", "kvmesh-gateway-kvmesh"}


def test_the_docs_say_one_cluster_wide_operator_per_cluster() -> None:
    install = section("Install")
    assert "one cluster-wide operator per cluster" in install.lower()
    assert "watchNamespaces" in section("Uninstall")


# ---- 5. the chart's pool in a namespace the operator watches ----------------------------------------------------


def test_the_chart_s_pool_outside_the_watched_namespaces_is_refused() -> None:
    """pool.enabled creates the pool in the release's namespace: with operator.watchNamespaces leaving that out,
    nothing reconciled it (the notes said it was being created; `helm test` failed after 15 minutes)."""
    with pytest.raises(helm_python.HelmRenderError, match=r"operator\.watchNamespaces"):
        render({"operator": {"watchNamespaces": ["team-a"]}, "pool": {"enabled": True}})
    docs = manifests(render({"operator": {"watchNamespaces": ["team-a", "kvmesh"]}, "pool": {"enabled": True}}))
    assert by_kind(docs, crd.KIND)
    render({"operator": {"watchNamespaces": ["team-a"]}})  # no pool of the chart's: any namespaces


# ---- 6, 7, 8: values refused before anything is applied ---------------------------------------------------------


def test_the_pool_name_is_as_long_as_the_crd_allows() -> None:
    longest = "a" * crd.MAX_NAME_LENGTH
    (pool,) = by_kind(manifests(render({"pool": {"enabled": True, "name": longest}})), crd.KIND)
    assert crd.parse_pool(pool) is not None
    for name in ("a" * (crd.MAX_NAME_LENGTH + 1), "a" * (crd.MAX_NAME_LENGTH + 2)):
        with pytest.raises(helm_python.HelmValuesError):
            render({"pool": {"enabled": True, "name": name}})


@pytest.mark.parametrize("bad", [
    {"operator": {"logLevel": None}},  # rendered --log-level=, which the operator refuses
    {"operator": {"logLevel": "verbose"}},
    {"gateway": {"logLevel": "verbose"}},
    {"gateway": {"bodyReadTimeoutSeconds": "30"}},
    {"operator": {"watchNamespaces": ["Team_A"]}},
    {"operator": {"watchNamespaces": [""]}},
    {"dashboards": {"namespace": "Bad_NS"}},
    {"image": {"tag": 2}},
    {"operator": {"resources": {"requests": {"cpu": "lots", "memory": "256Mi"}}}},  # rendered, refused at apply
    {"gateway": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1 GiB"}}}},
    {"operator": {"resources": {"requests": {"cpu": -1, "memory": "256Mi"}}}},
], ids=str)
def test_the_schema_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render(bad)


@pytest.mark.parametrize("cpu", ["500m", "2", 2, 0.5, "1.5", "2e3"])
def test_resource_quantities_as_kubernetes_writes_them_are_taken(cpu: object) -> None:
    render({"operator": {"resources": {"requests": {"cpu": cpu, "memory": "1.5Gi"}, "limits": {"memory": "2G"}}}})


def test_one_port_for_metrics_and_health_is_refused() -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"metricsPort and operator\.healthPort"):
        render({"operator": {"metricsPort": 9090, "healthPort": 9090}})


@pytest.mark.parametrize("bad", [
    {"podSecurityContext": {"runAsNonRoot": None}},
    {"podSecurityContext": {"seccompProfile": None}},
    {"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
    {"podSecurityContext": {"runAsUser": 0}},
    {"securityContext": {"readOnlyRootFilesystem": None}},
    {"securityContext": {"allowPrivilegeEscalation": None}},
    {"securityContext": {"capabilities": None}},
    {"securityContext": {"capabilities": {"drop": []}}},
    {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}},
    {"securityContext": {"privileged": True}},
    {"securityContext": {"runAsUser": 0}},
    {"securityContext": {"runAsNonRoot": False}},
], ids=str)
def test_the_restricted_pod_security_cannot_be_removed(bad: dict[str, Any]) -> None:
    """The schema held these keys' values but not their presence: Helm drops a key given null, so
    `--set podSecurityContext.runAsNonRoot=null` rendered pods without it (and privileged or root was accepted)."""
    with pytest.raises(helm_python.HelmValuesError):
        render(bad)


def test_the_docs_uninstall_pools_first_and_the_lease_last() -> None:
    uninstall = section("Uninstall")
    assert uninstall.index("kubectl delete kvpool") < uninstall.index("helm uninstall")
    assert "lease" in uninstall.lower() and "finalizer" in uninstall
    notes = render({"pool": {"enabled": True}})["kvmesh/templates/NOTES.txt"]
    assert "uninstall" in notes.lower()
