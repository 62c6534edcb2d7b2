"""Routers first (operator/routers_first.py, operator/handlers.py `release_engines`): a pool made before the internal
token keeps its engines' pod template until its routers have rolled out with the token, so no old router is left
with only engines that refuse it. The decision as a pure function of the objects and the live Deployments; then
kopf against the emulator (which has no Deployment controller: the test sets the router's rollout status), from a
pool left as an older operator left it to its engines rolled with the token, with no further edit."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV
from kvmesh.operator.crd import parse_pool
from kvmesh.operator.desired import desired_objects
from kvmesh.operator.kube import LAST_APPLIED_ANNOTATION, three_way_patch
from kvmesh.operator.routers_first import has_token, legacy_engines, rolled_out, routers_first, routers_ready

from .test_operator import NS, POOLS, Env, conditions, eventually, operator, pool_body, run

DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


def legacy(deployment: dict[str, Any]) -> dict[str, Any]:
    """`deployment` as an operator before the internal token made it: no token file in the env, no token volume."""
    out = copy.deepcopy(deployment)
    spec = out["spec"]["template"]["spec"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "internal-token"]
    for c in spec["containers"]:
        c["env"] = [e for e in c["env"] if e["name"] != INTERNAL_TOKEN_FILE_ENV]
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "internal-token"]
    return out


def rolled(deployment: dict[str, Any], replicas: int | None = None) -> dict[str, Any]:
    out = copy.deepcopy(deployment)
    n = out["spec"]["replicas"] if replicas is None else replicas
    out["spec"]["replicas"] = n
    out["metadata"]["generation"] = 3
    out["status"] = {"observedGeneration": 3, "replicas": n, "updatedReplicas": n, "availableReplicas": n,
                     "readyReplicas": n}
    return out


def objects_and_live(mode: str = "aggregated") -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    body = pool_body(mode=mode, replicas={"both": {"min": 1, "max": 4}, "prefill": {"min": 1, "max": 4},
                                          "decode": {"min": 1, "max": 4}})
    body["metadata"]["uid"] = "uid-1"
    objects = desired_objects(parse_pool(body), {"both": 2, "prefill": 1, "decode": 1})
    live = {o["metadata"]["labels"]["kvmesh.io/role"]: o for o in objects if o["kind"] == "Deployment"}
    return objects, live


def deployment(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    return found


def test_legacy_engines_keep_their_template_until_the_routers_have_rolled_out_with_the_token() -> None:
    objects, live = objects_and_live()
    old_engine, old_router = legacy(live["both"]), legacy(live["router"])
    old_engine["spec"]["replicas"] = 1
    assert not has_token(old_engine) and has_token(live["both"])
    assert legacy_engines({"both": old_engine, "router": old_router}) == ("both",)

    # as the upgrade finds it: engines and routers of the older operator
    plan = routers_first(objects, {"both": old_engine, "router": old_router})
    assert plan.held == ("chat-both",)
    engine = deployment(plan.objects, "chat-both")
    assert engine["spec"]["template"] == old_engine["spec"]["template"], "the engines do not roll yet"
    assert engine["spec"]["replicas"] == 2, "everything else is applied"
    assert deployment(plan.objects, "chat-router")["spec"]["template"] == live["router"]["spec"]["template"]
    assert has_token(deployment(objects, "chat-both")), "the objects given are left as they were"

    # the router's new template applied, its rollout not done: each way it can be unfinished holds the engines
    new_router = rolled(live["router"], 2)
    assert rolled_out(new_router) and routers_ready({"router": new_router})
    unfinished = [
        {"metadata": {"generation": 4}},  # not yet seen by its controller
        {"status": {"updatedReplicas": 1}},  # new pods still to start
        {"status": {"availableReplicas": 1}},  # new pods not yet available
        {"status": {"replicas": 3}},  # old pods still there
    ]
    for change in unfinished:
        router = copy.deepcopy(new_router)
        for key, value in change.items():
            router[key] |= value
        assert not rolled_out(router), change
        assert routers_first(objects, {"both": old_engine, "router": router}).held == ("chat-both",), change
    assert routers_first(objects, {"both": old_engine, "router": rolled(old_router)}).held == ("chat-both",), \
        "rolled out, but an old template: it sends no token"
    assert routers_first(objects, {"both": old_engine}).held == ("chat-both",), "the router is yet to be created"

    # rolled out with the token: the engines get theirs
    plan = routers_first(objects, {"both": old_engine, "router": new_router})
    assert plan.held == () and plan.objects == objects


def test_a_router_at_zero_replicas_holds_nothing() -> None:
    objects, live = objects_and_live()
    old_engine, old_router = legacy(live["both"]), legacy(live["router"])
    old_router["spec"]["replicas"] = 0
    old_router["status"] = {"replicas": 0}
    assert routers_first(objects, {"both": old_engine, "router": old_router}).held == ()
    assert routers_first(objects, {"both": old_engine, "router": rolled(live["router"], 0)}).held == ()


def test_a_pool_with_no_legacy_engine_is_never_held() -> None:
    objects, live = objects_and_live()
    unrolled = legacy(live["router"])  # whatever the routers' state
    assert routers_first(objects, {}).held == (), "a new pool"
    assert routers_first(objects, {"both": live["both"], "router": unrolled}).held == ()
    # a change of mode: the new roles have no Deployment yet, the previous one is not applied (pruned)
    objects, _ = objects_and_live("disaggregated")
    plan = routers_first(objects, {"both": legacy(live["both"]), "router": unrolled})
    assert plan.held == () and plan.objects == objects


def test_disaggregated_legacy_engines_are_each_held() -> None:
    objects, live = objects_and_live("disaggregated")
    old = {"prefill": legacy(live["prefill"]), "decode": live["decode"], "router": legacy(live["router"])}
    assert routers_first(objects, old).held == ("chat-prefill",), "only the legacy one"
    old["decode"] = legacy(live["decode"])
    assert routers_first(objects, old).held == ("chat-prefill", "chat-decode")


def test_a_held_apply_leaves_the_record_such_that_the_new_template_still_applies() -> None:
    """The held Deployment is patched without its template (operator/handlers.py `apply_pool`), so its record has
    none; the later apply of the new template, three ways against that record, deletes nothing of it."""
    objects, _ = objects_and_live()
    engine = deployment(objects, "chat-both")
    held_record = {**engine, "spec": {k: v for k, v in engine["spec"].items() if k != "template"}}
    patch = three_way_patch(held_record, engine, keep=(("spec", "replicas"),))
    assert patch["spec"]["template"] == engine["spec"]["template"]
    assert "null" not in json.dumps(patch["spec"]["template"])


# ---- against the emulator ------------------------------------------------------------------------------------------


async def advance(env: Env) -> None:
    while True:
        await asyncio.sleep(0.05)
        env.clock[0] += 0.5


def engine_token(env: Env) -> bool:
    found = env.get("apps/v1/deployments", "chat-both")
    return found is not None and has_token(found)


async def ticks(env: Env, count: int = 3) -> None:
    begun = env.ticks()
    await eventually(lambda: env.ticks() >= begun + count)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_upgraded_pool_rolls_its_routers_before_its_engines(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body(scaling={"intervalSeconds": 1}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            # as an operator before the internal token left them: no token, no record of what it applied
            for name in ("chat-both", "chat-router"):
                found = env.get("apps/v1/deployments", name)
                assert found is not None
                await env.k8s.patch(f"{DEPLOYMENTS}/{name}", json={
                    "metadata": {"annotations": {LAST_APPLIED_ANNOTATION: None}},
                    "spec": {"template": legacy(found)["spec"]["template"]}})
            assert not engine_token(env)
            old_template = env.get("apps/v1/deployments", "chat-both")["spec"]["template"]  # type: ignore[index]

            # the new operator's first reconcile (here: an edit); the router Deployment has no rollout status yet
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"replicas": {"both": {"min": 2, "max": 4}},
                                                                "engine": {"env": [{"name": "X", "value": "1"}]}}})
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 2)
            engine = env.get("apps/v1/deployments", "chat-both")
            assert engine is not None and engine["spec"]["template"] == old_template, "the engines wait"
            assert engine["spec"]["replicas"] == 2, "the rest is applied"
            held = json.loads(engine["metadata"]["annotations"][LAST_APPLIED_ANNOTATION])
            assert "template" not in held["spec"], "applied without its template (apply_pool): none recorded"
            router = env.get("apps/v1/deployments", "chat-router")
            assert router is not None and has_token(router), "the routers roll first"
            progressing = conditions(env)["Progressing"]
            assert (progressing["status"], progressing["reason"]) == ("True", "RoutersFirst")
            assert "chat-both" in progressing["message"] and "router" in progressing["message"]
            assert conditions(env)["Degraded"]["status"] == "False"
            (event,) = await eventually(lambda: env.events("RoutersFirst"))
            assert event["type"] == "Normal" and "chat-both" in event["message"]

            clock = asyncio.create_task(advance(env))
            await ticks(env)  # the router's new pods are not up: the ticks keep the engines as they are
            assert not engine_token(env)
            assert conditions(env)["Progressing"]["reason"] == "RoutersFirst"
            # the new pods up, an old one still there (the router's 2 replicas: the CRD's default)
            router = env.get("apps/v1/deployments", "chat-router")
            assert router is not None and router["spec"]["replicas"] == 2
            await env.k8s.patch(f"{DEPLOYMENTS}/chat-router/status", json={"status": {
                "observedGeneration": router["metadata"].get("generation") or 1, "replicas": 3,
                "updatedReplicas": 2, "availableReplicas": 2, "readyReplicas": 2}})
            await ticks(env)
            assert not engine_token(env)

            await env.k8s.patch(f"{DEPLOYMENTS}/chat-router/status", json={"status": {"replicas": 2}})  # rolled
            await eventually(lambda: engine_token(env))
            engine = env.get("apps/v1/deployments", "chat-both")
            assert engine is not None
            env_names = [e["name"] for e in engine["spec"]["template"]["spec"]["containers"][0]["env"]]
            assert "X" in env_names, "the spec's template, as the last reconcile computed it"
            assert any(v["name"] == "internal-token" for v in engine["spec"]["template"]["spec"]["volumes"])
            assert engine["spec"]["replicas"] == 2
            record = json.loads(engine["metadata"]["annotations"][LAST_APPLIED_ANNOTATION])
            assert has_token(record), "the record has the template now"
            (done,) = await eventually(lambda: env.events("RoutersRolledOut"))
            assert "chat-both" in done["message"]
            await eventually(lambda: conditions(env)["Progressing"]["reason"] != "RoutersFirst")
            assert env.pool()["status"]["observedGeneration"] == 2
            clock.cancel()

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_pool_waits_for_no_router(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await env.k8s.post(POOLS, json=pool_body())
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            assert engine_token(env)
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"engine": {"env": [{"name": "X", "value": "1"}]}}})
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 2)
            engine = env.get("apps/v1/deployments", "chat-both")
            assert engine is not None and "X" in [e["name"] for e in
                                                  engine["spec"]["template"]["spec"]["containers"][0]["env"]]
            assert conditions(env)["Progressing"]["reason"] != "RoutersFirst"
            assert not env.events("RoutersFirst")

    run(main)
