"""A change of mode, make before break (operator/desired.py `retained_roles`, operator/handlers.py `prune` and
`finish_switch`): the previous mode's Deployment (with its budget and HPA) keeps serving until every new role has a
ready pod, and goes at the scaling tick that sees them ready, without a further edit. The decision as a pure
function of the spec and the Deployments' status; then kopf against the emulator (which has no Deployment
controller: the tests set each Deployment's readyReplicas): the switch, a switch back while the first is pending, HPA
mode, a pool deleted mid-switch, and an operator restarted mid-switch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmesh.engine.protocol import OperatorMetric
from kvmesh.operator.conditions import pool_conditions
from kvmesh.operator.crd import GROUP, PLURAL, VERSION, Pool, parse_pool, spec_roles
from kvmesh.operator.desired import retained_objects, retained_roles
from kvmesh.operator.memory import current_replicas, decided_replicas, status_replicas
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.operator.scaling import Decision, RoleDecision

from .test_operator import NS, POOLS, Env, conditions, eventually, operator, pool_body, run
from .test_operator_lora_state import cluster, operator_run

DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


def parsed(mode: str, **spec: Any) -> Pool:
    body = pool_body(mode=mode, replicas={"both": {"min": 1, "max": 4}, "prefill": {"min": 1, "max": 4},
                                          "decode": {"min": 1, "max": 4}}, **spec)
    body["metadata"]["uid"] = "uid-1"
    return parse_pool(body)


def deployment(ready: int, replicas: int = 1) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def test_the_previous_roles_are_kept_until_every_new_role_has_a_ready_pod() -> None:
    disaggregated = parsed("disaggregated")
    both = deployment(2, replicas=2)
    assert retained_roles(disaggregated, {"both": both}) == ("both",), "the new roles are not even created yet"
    assert retained_roles(disaggregated, {"both": both, "prefill": deployment(0), "decode": deployment(0)}) == \
        ("both",)
    assert retained_roles(disaggregated, {"both": both, "prefill": deployment(1), "decode": deployment(0)}) == \
        ("both",), "a prefill pod alone answers no request"
    assert retained_roles(disaggregated, {"both": both, "prefill": deployment(1), "decode": deployment(1)}) == ()
    assert retained_roles(disaggregated, {"both": deployment(0), "prefill": deployment(0)}) == (), \
        "an old role that serves nobody is not kept for nothing"
    assert retained_roles(disaggregated, {"both": both, "prefill": deployment(0, 0), "decode": deployment(0, 0)}) \
        == (), "roles held at 0 (scale to zero) need no pod: the routers wake them"
    assert retained_roles(disaggregated, {"prefill": deployment(0), "decode": deployment(0)}) == (), "no switch"

    aggregated = parsed("aggregated")  # back, or the other way: both roles of the previous mode are kept
    assert retained_roles(aggregated, {"both": deployment(0), "prefill": deployment(1), "decode": deployment(0)}) \
        == ("prefill", "decode")
    assert retained_roles(aggregated, {"both": deployment(1), "prefill": deployment(1), "decode": deployment(1)}) \
        == ()
    assert retained_objects(aggregated, ("prefill",)) == {
        ("Deployment", "chat-prefill"), ("PodDisruptionBudget", "chat-prefill"),
        ("HorizontalPodAutoscaler", "chat-prefill")}


def test_a_pool_switching_mode_is_ready_through_its_previous_pods() -> None:
    roles, replicas = ("prefill", "decode"), {"prefill": 1, "decode": 1}
    found = {c.kind: c for c in pool_conditions(roles, replicas, {
        "both": deployment(2), "prefill": deployment(0), "decode": deployment(1), "router": deployment(1)},
        kept=("both",))}
    assert (found["Ready"].value, found["Ready"].reason) == (True, "SwitchingMode")
    assert (found["Progressing"].value, found["Progressing"].reason) == (True, "SwitchingMode")
    assert "previous both 2" in found["Progressing"].message and "prefill 0/1" in found["Progressing"].message
    no_router = {c.kind: c for c in pool_conditions(roles, replicas, {
        "both": deployment(2), "prefill": deployment(0), "decode": deployment(0), "router": deployment(0)},
        kept=("both",))}
    assert (no_router["Ready"].value, no_router["Ready"].reason) == (False, "PodsNotReady")


def decision(**replicas: int) -> Decision:
    return Decision(0.0, {r: RoleDecision(n, n, "HoldWithinTarget", 0.5, 0.01) for r, n in replicas.items()}, ())


def test_the_operator_drops_the_series_of_the_roles_a_change_of_mode_removed() -> None:
    """A `desired_replicas{role="both"}` left after the switch would read as both engines wanted and none up: the
    chart's critical KvmeshPoolEnginesUnavailable (tests/test_alerts.py, "a change of mode away from a role")."""
    metrics = OperatorMetrics()

    def sample(name: str, role: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"pool_namespace": NS, "pool": "chat", "role": role, **labels})

    metrics.record(parsed("aggregated"), decision(both=2), {"both": 2}, {"both": 1})
    assert sample(OperatorMetric.DESIRED_REPLICAS, "both") == 2
    assert sample(f"{OperatorMetric.SCALING_DECISIONS}_total", "both", direction="up") == 1
    metrics.record(parsed("disaggregated"), decision(prefill=1, decode=1), {"prefill": 1, "decode": 1},
                   {"prefill": 1, "decode": 1})
    for name in (OperatorMetric.DESIRED_REPLICAS, OperatorMetric.PREDICTED_KV_USAGE,
                 OperatorMetric.OVERLOAD_PROBABILITY):
        assert sample(name, "both") is None
        assert sample(name, "prefill") is not None and sample(name, "decode") is not None
    assert sample(f"{OperatorMetric.SCALING_DECISIONS}_total", "both", direction="up") is None
    metrics.record(parsed("aggregated"), decision(both=1), {"both": 1}, {"both": 1})  # and back
    assert sample(OperatorMetric.DESIRED_REPLICAS, "both") == 1 and sample(OperatorMetric.DESIRED_REPLICAS,
                                                                            "prefill") is None
    metrics.forget(NS, "chat")
    assert sample(OperatorMetric.DESIRED_REPLICAS, "both") is None


def test_status_drops_removed_roles_and_a_role_added_back_is_not_read_from_an_older_status() -> None:
    aggregated, disaggregated = parsed("aggregated"), parsed("disaggregated")
    counts = {"prefill": {"desired": 2, "ready": 1}, "decode": {"desired": 1, "ready": 1}}
    # a merge patch: null removes the role the pool no longer runs (kopf merge-patches status)
    assert status_replicas(disaggregated, counts) == {"both": None, **counts}
    assert status_replicas(aggregated, {"both": {"desired": 1, "ready": 0}}) == {
        "prefill": None, "decode": None, "both": {"desired": 1, "ready": 0}}
    # what an operator before this one left: the removed role's count, decided before the switch
    stale = {"replicas": {"both": {"desired": 3, "ready": 3}, **counts}}
    assert current_replicas(aggregated, stale) == {"both": 3}
    assert current_replicas(aggregated, stale, added=("both",)) == {"both": 1}, "back to aggregated: its minimum"
    assert decided_replicas(aggregated, stale, added=("both",)) == {}
    assert current_replicas(disaggregated, stale, added=("both",)) == {"prefill": 2, "decode": 1}
    assert current_replicas(aggregated, {"replicas": {"both": None}}) == {"both": 1}
    assert spec_roles({"mode": "disaggregated"}) == ("prefill", "decode") and spec_roles({}) == ("both",)
    assert spec_roles(None) == ()


# ---- against the emulator ------------------------------------------------------------------------------------------


def exists(env: Env, kind_path: str, name: str) -> bool:
    return env.get(kind_path, name) is not None


def deployments(env: Env) -> set[str]:
    return {o["metadata"]["name"] for o in env.owned() if o["kind"] == "Deployment"}


async def set_ready(env: Env, name: str, ready: int) -> None:
    await env.k8s.patch(f"{DEPLOYMENTS}/{name}/status", json={"status": {"readyReplicas": ready}})


def set_ready_in_store(env: Env, name: str, ready: int) -> None:
    """`set_ready` written into the emulator's store: after an operator stopped, a write through the emulator
    waits on the stopped operator's watches (the operator lists Deployments, it does not watch them)."""
    (stored,) = [o for (r, ns, n), o in env.k8s.objects.items() if r.plural == "deployments" and n == name]
    stored.patch({"status": {"readyReplicas": ready}})


async def ticks(env: Env, count: int = 3) -> None:
    """Wait for `count` more scaling ticks to end (each evaluates the pool: the clock runs)."""
    begun = env.ticks()
    await eventually(lambda: env.ticks() >= begun + count)


async def advance(env: Env) -> None:
    """The operator's clock runs 10x faster than the test's, so each pool's interval passes quickly."""
    while True:
        await asyncio.sleep(0.05)
        env.clock[0] += 0.5


def progressing(env: Env) -> str:
    return str(conditions(env)["Progressing"]["reason"])


async def serving_pool(env: Env, **spec: Any) -> None:
    """An aggregated pool whose engine and router have a ready pod."""
    await env.k8s.post(POOLS, json=pool_body(**spec))
    await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
    await set_ready(env, "chat-both", 1)
    await set_ready(env, "chat-router", 1)


def generation_applied(env: Env, generation: int) -> Callable[[], bool]:
    return lambda: env.pool().get("status", {}).get("observedGeneration") == generation


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_change_of_mode_keeps_the_old_role_until_the_new_roles_are_ready(tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await serving_pool(env, scaling={"intervalSeconds": 1})
            clock = asyncio.create_task(advance(env))
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(generation_applied(env, 2))
            # the new roles are created beside the old one, which keeps serving, with its budget
            assert deployments(env) == {"chat-both", "chat-prefill", "chat-decode", "chat-router"}
            assert exists(env, "policy/v1/poddisruptionbudgets", "chat-both")
            (event,) = await eventually(lambda: env.events("SwitchingMode"))
            assert "both" in event["message"] and "prefill and decode" in event["message"]
            await eventually(lambda: progressing(env) == "SwitchingMode")

            await ticks(env)  # ticks while the new pods load: the pool serves through its old pods
            assert exists(env, "apps/v1/deployments", "chat-both")
            ready = conditions(env)["Ready"]
            assert (ready["status"], ready["reason"]) == ("True", "SwitchingMode")
            await set_ready(env, "chat-prefill", 1)
            await ticks(env)
            assert exists(env, "apps/v1/deployments", "chat-both"), "a prefill pod alone serves no request"

            await set_ready(env, "chat-decode", 1)  # both new roles serve: the old one goes, with no edit
            await eventually(lambda: not exists(env, "apps/v1/deployments", "chat-both")
                             and not exists(env, "policy/v1/poddisruptionbudgets", "chat-both"))
            assert deployments(env) == {"chat-prefill", "chat-decode", "chat-router"}
            (done,) = await eventually(lambda: env.events("ModeSwitched"))
            assert "Deployment/chat-both" in done["message"]
            await eventually(lambda: progressing(env) != "SwitchingMode")
            assert env.pool()["metadata"]["generation"] == 2
            clock.cancel()

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_switch_back_before_the_new_roles_serve_keeps_what_serves_in_hpa_mode_too(tmp_path: Path) -> None:
    """In HPA mode the old role's autoscaler stays with its Deployment; switched back before the new roles have a
    ready pod, the pool drops the unready new roles at once and never its serving one."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await serving_pool(env, scaling={"mode": "hpa", "intervalSeconds": 1})
            clock = asyncio.create_task(advance(env))
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(generation_applied(env, 2))
            for name in ("chat-both", "chat-prefill", "chat-decode"):
                assert exists(env, "autoscaling/v2/horizontalpodautoscalers", name)
            await ticks(env)
            assert exists(env, "apps/v1/deployments", "chat-both")
            assert exists(env, "autoscaling/v2/horizontalpodautoscalers", "chat-both")

            await set_ready(env, "chat-prefill", 1)  # one new role ready: still not enough
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "aggregated"}})
            await eventually(generation_applied(env, 3))
            assert deployments(env) == {"chat-both", "chat-router"}
            for name in ("chat-prefill", "chat-decode"):
                assert not exists(env, "autoscaling/v2/horizontalpodautoscalers", name)
                assert not exists(env, "policy/v1/poddisruptionbudgets", name)
            assert exists(env, "autoscaling/v2/horizontalpodautoscalers", "chat-both")
            await eventually(lambda: progressing(env) != "SwitchingMode")
            clock.cancel()

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_deleted_mid_switch_goes_as_any_other(tmp_path: Path) -> None:
    """Its objects, old and new, carry its owner references for the garbage collector (which the emulator lacks);
    the operator holds nothing back. (No scaling tick writes meanwhile: the emulator answers kopf's finalizer patch
    of a pool whose status a tick just wrote with a 500, not a conflict, and kopf retries it unchanged.)"""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await serving_pool(env)
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(generation_applied(env, 2))
            assert deployments(env) == {"chat-both", "chat-prefill", "chat-decode", "chat-router"}
            uid = env.pool()["metadata"]["uid"]
            assert all(o["metadata"]["ownerReferences"][0]["uid"] == uid for o in env.owned()
                       if o["kind"] == "Deployment")
            await env.k8s.delete(f"{POOLS}/chat")
            await eventually(lambda: env.get(f"{GROUP}/{VERSION}/{PLURAL}", "chat") is None)

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_operator_restarted_mid_switch_carries_it_on_from_what_it_observes(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster() as (k8s, server):
            async with operator_run(k8s, server, tmp_path) as first:
                await serving_pool(first, scaling={"intervalSeconds": 1})
                await k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
                await eventually(generation_applied(first, 2))
                await eventually(lambda: progressing(first) == "SwitchingMode")

            async with operator_run(k8s, server, tmp_path) as second:  # a new process: nothing in memory
                await ticks(second)
                assert deployments(second) == {"chat-both", "chat-prefill", "chat-decode", "chat-router"}
                set_ready_in_store(second, "chat-prefill", 2)
                set_ready_in_store(second, "chat-decode", 1)
                await eventually(lambda: deployments(second) == {"chat-prefill", "chat-decode", "chat-router"})
                await eventually(lambda: progressing(second) != "SwitchingMode")

    run(main, 140)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_switch_leaves_no_trace_of_the_removed_role_and_a_role_switched_back_to_starts_afresh(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with operator(tmp_path) as env:
            await serving_pool(env, scaling={"intervalSeconds": 1})
            clock = asyncio.create_task(advance(env))
            await ticks(env)
            assert env.sample(OperatorMetric.DESIRED_REPLICAS, role="both") == 1
            # the scaler had scaled `both` to 3 (as its tick writes it)
            await env.k8s.patch(f"{POOLS}/chat/status", json={"status": {"replicas": {"both": {"desired": 3,
                                                                                               "ready": 3}}}})
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(generation_applied(env, 2))
            assert "both" not in env.pool()["status"]["replicas"], "the reconcile drops the role it switched from"
            await set_ready(env, "chat-prefill", 1)
            await set_ready(env, "chat-decode", 1)
            await eventually(lambda: not exists(env, "apps/v1/deployments", "chat-both"))
            await ticks(env)
            status = env.pool()["status"]
            assert set(status["replicas"]) == {"prefill", "decode"}
            assert set(status["lastDecision"]["replicas"]) == {"prefill", "decode"}
            assert env.sample(OperatorMetric.DESIRED_REPLICAS, role="both") is None
            assert env.sample(OperatorMetric.DESIRED_REPLICAS, role="decode") == 1

            # as an operator before this one left it: the removed role's count, decided before the switch
            await env.k8s.patch(f"{POOLS}/chat/status", json={"status": {"replicas": {"both": {"desired": 3,
                                                                                               "ready": 3}}}})
            clock.cancel()  # no tick writes status meanwhile: the reconcile of the switch back reads that one
            await asyncio.sleep(0.3)
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "aggregated"}})
            await eventually(generation_applied(env, 3))
            assert env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 1  # type: ignore[index]
            assert env.pool()["status"]["replicas"] == {"both": {"desired": 1, "ready": 0}}

    run(main)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_switch_back_while_the_old_role_still_serves_keeps_its_pods(tmp_path: Path) -> None:
    """Switched back before the new roles serve, the previous mode's Deployment is the pool's again: it keeps the
    replicas it runs, though status no longer holds its count."""
    async def main() -> None:
        async with operator(tmp_path) as env:
            await serving_pool(env)
            await env.k8s.patch(f"{DEPLOYMENTS}/chat-both", json={"spec": {"replicas": 3}})
            await env.k8s.patch(f"{POOLS}/chat/status", json={"status": {"replicas": {"both": {"desired": 3,
                                                                                               "ready": 1}}}})
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "disaggregated"}})
            await eventually(generation_applied(env, 2))
            assert "both" not in env.pool()["status"]["replicas"] and exists(env, "apps/v1/deployments", "chat-both")
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"mode": "aggregated"}})
            await eventually(generation_applied(env, 3))
            assert env.get("apps/v1/deployments", "chat-both")["spec"]["replicas"] == 3  # type: ignore[index]
            assert env.pool()["status"]["replicas"]["both"]["desired"] == 3

    run(main)
