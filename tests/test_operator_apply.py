"""Applying a pool's objects deletes what the spec no longer asks for: `Kube.apply` sends a JSON merge patch (RFC
7386), which keeps every key it does not name, so the operator records what it applied on each object
(`kvmesh.io/last-applied`) and nulls what that record has and the new patch lacks (`three_way_patch`), as kubectl's
client-side apply does. The diff as a pure function, then the operator against the emulator (tests/test_operator.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.operator.desired import HANDED_OFF
from kvmesh.operator.kube import LAST_APPLIED_ANNOTATION, last_applied, merged, recorded, three_way_patch
from tests.test_operator import NS, POOLS, eventually, operator, pool_body, run

DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


def test_keys_removed_at_any_depth_are_nulled_and_the_rest_is_the_new_patch() -> None:
    last = {"metadata": {"labels": {"a": "1", "b": "2"}},
            "spec": {"replicas": 2, "paused": False,
                     "template": {"spec": {"nodeSelector": {"gpu": "a100", "zone": "z1"}, "priorityClassName": "high",
                                           "tolerations": [{"key": "gpu"}], "containers": [{"name": "x"}]}}}}
    new = {"metadata": {"labels": {"a": "1"}},
           "spec": {"replicas": 2, "template": {"spec": {"nodeSelector": {"gpu": "a100"},
                                                         "containers": [{"name": "x", "image": "y"}]}}}}
    patch = three_way_patch(last, new)
    assert patch == {"metadata": {"labels": {"a": "1", "b": None}},
                     "spec": {"replicas": 2, "paused": None,
                              "template": {"spec": {"nodeSelector": {"gpu": "a100", "zone": None},
                                                    "priorityClassName": None, "tolerations": None,
                                                    "containers": [{"name": "x", "image": "y"}]}}}}
    assert new["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "a100"}  # not changed in place


def test_a_map_removed_whole_is_nulled_whole_and_a_map_replaced_by_a_value_is_not_descended() -> None:
    last = {"spec": {"affinity": {"nodeAffinity": {"x": 1}}, "selector": {"a": 1}, "ports": [1, 2]}}
    assert three_way_patch(last, {"spec": {"selector": "all", "ports": [1]}}) == \
        {"spec": {"affinity": None, "selector": "all", "ports": [1]}}
    assert three_way_patch(last, {}) == {"spec": None}


def test_nothing_the_operator_never_applied_is_nulled() -> None:
    """Fields the API server defaults, others' annotations and labels, a scaler's fields: absent from the record,
    so left as they are, on an object made by an older operator (no record) too."""
    live = {"metadata": {"annotations": {"deployment.kubernetes.io/revision": "3", "team": "ml"}},
            "spec": {"progressDeadlineSeconds": 600, "replicas": 5,
                     "template": {"spec": {"dnsPolicy": "ClusterFirst", "nodeSelector": {"gpu": "a100"}}}}}
    new = {"spec": {"template": {"spec": {"nodeSelector": {"gpu": "h100"}}}}}
    assert three_way_patch({"spec": {"template": {"spec": {"nodeSelector": {"gpu": "a100"}}}}}, new) == new
    assert three_way_patch(None, new) == new
    after = merged(live, three_way_patch(None, new))
    assert after["metadata"] == live["metadata"] and after["spec"]["replicas"] == 5
    assert after["spec"]["template"]["spec"] == {"dnsPolicy": "ClusterFirst", "nodeSelector": {"gpu": "h100"}}


def test_replicas_handed_to_an_autoscaler_are_never_nulled() -> None:
    """A pool moved to scaling.mode hpa stops applying the engines' replicas; nulling them would reset the
    Deployment to 1 under its HPA."""
    last = {"spec": {"replicas": 3, "template": {"spec": {"priorityClassName": "high"}}}}
    new = {"spec": {"template": {"spec": {}}}}
    assert three_way_patch(last, new, HANDED_OFF) == {"spec": {"template": {"spec": {"priorityClassName": None}}}}
    assert three_way_patch(last, new) == {"spec": {"replicas": None, "template": {"spec": {"priorityClassName": None}}}}


def test_the_record_is_compact_json_of_the_patch_and_a_bad_one_reads_as_none() -> None:
    patch = {"spec": {"b": 1, "a": {"c": [1, 2]}}}
    obj = recorded({"metadata": {"name": "x", "annotations": {"team": "ml"}}, **patch}, patch)
    text = obj["metadata"]["annotations"][LAST_APPLIED_ANNOTATION]
    assert text == '{"spec":{"a":{"c":[1,2]},"b":1}}' and obj["metadata"]["annotations"]["team"] == "ml"
    assert last_applied(obj) == patch
    for bad in ("not json", "[1]", None):
        assert last_applied({"metadata": {"annotations": {LAST_APPLIED_ANNOTATION: bad}}}) is None
    assert last_applied({"metadata": {}}) is None and last_applied({}) is None


SCHEDULING = {"nodeSelector": {"gpu": "a100", "zone": "z1"},
              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}},
              "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                             "whenUnsatisfiable": "ScheduleAnyway"}],
              "priorityClassName": "high", "runtimeClassName": "nvidia"}
FIELDS = (*SCHEDULING, "imagePullSecrets")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_scheduling_fields_removed_from_the_spec_are_removed_from_the_deployments(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            def pod(name: str) -> dict[str, Any]:
                return env.get("apps/v1/deployments", name)["spec"]["template"]["spec"]  # type: ignore[index]

            async def edit(spec: dict[str, Any]) -> None:
                generation = env.pool()["metadata"]["generation"]
                await env.k8s.patch(f"{POOLS}/chat", json={"spec": spec})
                await eventually(lambda: env.pool()["status"].get("observedGeneration") == generation + 1)

            await env.k8s.post(POOLS, json=pool_body(engine={"scheduling": SCHEDULING,
                                                             "imagePullSecrets": [{"name": "regcred"}]},
                                                     router={"scheduling": {"nodeSelector": {"pool": "cpu"}}}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            assert {k: pod("chat-both")[k] for k in SCHEDULING} == SCHEDULING
            for name in ("chat-both", "chat-router"):
                assert pod(name)["imagePullSecrets"] == [{"name": "regcred"}]
            assert pod("chat-router")["nodeSelector"] == {"pool": "cpu"}
            # others' fields on the object: an annotation and a field the API server would default
            await env.k8s.patch(f"{DEPLOYMENTS}/chat-both", json={
                "metadata": {"annotations": {"team": "ml"}},
                "spec": {"template": {"spec": {"dnsPolicy": "ClusterFirst"}}}})

            await edit({"engine": {"scheduling": {"nodeSelector": {"zone": None}}}})  # one key of a map
            assert pod("chat-both")["nodeSelector"] == {"gpu": "a100"}

            await edit({"engine": {"scheduling": None, "imagePullSecrets": None}, "router": {"scheduling": None}})
            for name in ("chat-both", "chat-router"):
                assert not set(FIELDS) & set(pod(name)), pod(name)
            engines = env.get("apps/v1/deployments", "chat-both")
            assert engines["metadata"]["annotations"]["team"] == "ml"  # type: ignore[index]
            assert pod("chat-both")["dnsPolicy"] == "ClusterFirst"
            assert "nodeSelector" not in json.loads(
                engines["metadata"]["annotations"][LAST_APPLIED_ANNOTATION])["spec"]["template"]["spec"]  # type: ignore[index]

            # what the pool's own env gave is gone too (a list: replaced whole)
            await edit({"engine": {"env": [{"name": "FOO", "value": "1"}]}})
            assert {"name": "FOO", "value": "1"} in pod("chat-both")["containers"][0]["env"]
            await edit({"engine": {"env": None}})
            assert all(e["name"] != "FOO" for e in pod("chat-both")["containers"][0]["env"])

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_object_from_an_older_operator_gets_the_record_and_moving_to_hpa_keeps_the_replicas(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(engine={"scheduling": {"priorityClassName": "high"}}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            deployment = env.get("apps/v1/deployments", "chat-both")
            assert last_applied(deployment)["spec"]["replicas"] == 1  # type: ignore[arg-type,index]
            # as an operator before the record made it: no annotation
            await env.k8s.patch(f"{DEPLOYMENTS}/chat-both",
                                json={"metadata": {"annotations": {LAST_APPLIED_ANNOTATION: None}}})
            assert last_applied(env.get("apps/v1/deployments", "chat-both")) is None  # type: ignore[arg-type]
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"engine": {"scheduling": None}}})
            await eventually(lambda: env.pool()["status"].get("observedGeneration") == 2)
            pod = env.get("apps/v1/deployments", "chat-both")["spec"]["template"]["spec"]  # type: ignore[index]
            assert pod["priorityClassName"] == "high"  # no record: a plain patch, once
            assert last_applied(env.get("apps/v1/deployments", "chat-both")) is not None  # type: ignore[arg-type]

            # the engines' replicas handed to an HPA (scaled to 3 meanwhile) are not deleted, though no longer applied
            await env.k8s.patch(f"{DEPLOYMENTS}/chat-both", json={"spec": {"replicas": 3}})
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"scaling": {"mode": "hpa"}}})
            await eventually(lambda: env.get("autoscaling/v2/horizontalpodautoscalers", "chat-both"))
            await eventually(lambda: env.pool()["status"].get("observedGeneration") == 3)
            await asyncio.sleep(0.5)
            deployment = env.get("apps/v1/deployments", "chat-both")
            assert deployment["spec"]["replicas"] == 3  # type: ignore[index]
            assert "replicas" not in last_applied(deployment)["spec"]  # type: ignore[arg-type,index]

    run(main)
