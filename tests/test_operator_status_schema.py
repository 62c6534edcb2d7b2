"""A pool's status under an older CRD than the operator's (`helm upgrade` leaves a chart's crds/ alone): the CRD of
2026-12-05 allows five condition types, without `MetricsAvailable`, which the operator writes once a Ready engine
pod's /metrics does not answer. A real API server refuses every status patch that carries it (422, naming the
field); kopf applied the patch after the handler, so the refusal ended the pool's scaling timer for good (kopf
stops a timer whose patch raises), and replicas, Ready and kvUsage went stale with nothing said on the pool.

kmock's emulator validates nothing against a schema: `OldCrdCluster` answers that one refusal as the API server
does (a Status with reason Invalid and a cause naming `status.conditions[i].type`), a minimal mock, and stores
everything else."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import kmock
import pytest

from kvmesh.engine.protocol import POOL_LABEL, ROLE_LABEL, OperatorMetric
from kvmesh.operator import handlers
from kvmesh.operator.conditions import RefusedStatus, refused_status
from kvmesh.operator.crd import KIND, PLURAL
from kvmesh.processes import free_port
from tests.test_operator import NS, POOLS, Cluster, Env, conditions, eventually, operator, pool_body, run

# the condition types of the CRD of 2026-12-05 (fb6858d)
OLD_CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "AdaptersLoaded", "RouterStateShared")


def invalid_condition(name: str, index: int, value: str) -> kmock.KubernetesError:
    """The API server's answer to a custom resource whose status.conditions[index].type is outside its CRD's enum."""
    supported = ", ".join(f'"{t}"' for t in OLD_CONDITION_TYPES)
    field = f"status.conditions[{index}].type"
    cause = f'Unsupported value: "{value}": supported values: {supported}'
    return kmock.KubernetesError(
        status=422, reason="Invalid", message=f'{KIND}.kvmesh.io "{name}" is invalid: {field}: {cause}',
        details={"name": name, "group": "kvmesh.io", "kind": KIND,
                 "causes": [{"reason": "FieldValueNotSupported", "message": cause, "field": field}]})


class OldCrdCluster(Cluster):
    """The emulator, but the pools' status is checked against the old CRD's condition types until `upgraded`."""

    upgraded = False

    async def _handle(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else {}
        if (not self.upgraded and request.action == kmock.action.UPDATE and request.subresource == "status"
                and request.resource is not None and request.resource.plural == PLURAL):
            for index, condition in enumerate((data.get("status") or {}).get("conditions") or []):
                if condition.get("type") not in OLD_CONDITION_TYPES:
                    raise invalid_condition(request.name, index, condition.get("type"))
        return await super()._handle(request)


def silent_pod(name: str, ip: str) -> dict[str, Any]:
    """A Ready engine pod whose /metrics does not answer (nothing listens at its address)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {POOL_LABEL: "chat", ROLE_LABEL: "both",
                                                                   "app.kubernetes.io/component": "engine"}},
            "spec": {"containers": [{"name": "engine", "image": "kvmesh"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def refusals(env: Env) -> list[dict[str, Any]]:
    return env.events(handlers.STATUS_REFUSED)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_status_the_old_crd_refuses_is_said_and_the_rest_of_it_still_lands(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "STATUS_RECHECK_SECONDS", 2.0)

    async def main() -> None:
        async with operator(tmp_path, cluster=OldCrdCluster) as env:
            assert isinstance(env.k8s, OldCrdCluster)
            await env.k8s.post(POOLS, json=pool_body(engine={"port": free_port()},
                                                     scaling={"intervalSeconds": 1}))
            await eventually(lambda: env.pool().get("status", {}).get("observedGeneration") == 1)
            await env.k8s.post(f"/api/v1/namespaces/{NS}/pods", json=silent_pod("chat-both-0", "127.0.0.2"))

            async def clock() -> None:  # the operator's clock runs 10x faster than the test's
                while True:
                    await asyncio.sleep(0.05)
                    env.clock[0] += 0.5

            ticking = asyncio.create_task(clock())
            # The pod's metrics do not answer: MetricsAvailable False, which the old CRD refuses. The refusal is
            # an Event naming the cause and the fix, and an error in the log...
            (event, *_) = await eventually(lambda: refusals(env))
            first_refused = time.monotonic()
            assert event["type"] == "Warning"
            assert "MetricsAvailable" in event["message"] and handlers.CRD_APPLY in event["message"]
            assert "status.conditions[" in event["message"]  # the API server's own words
            logged = [r for r in caplog.records if r.levelno == logging.ERROR and handlers.CRD_APPLY in r.message]
            assert logged
            # ... the pool is still evaluated (kopf had stopped its timer for good), and the rest of its status
            # lands at every tick: here the engines' ready count, which only a tick writes
            ok = env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok") or 0
            await eventually(lambda: (env.sample(f"{OperatorMetric.EVALUATIONS}_total", outcome="ok") or 0) >= ok + 3)
            await env.k8s.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-both/status",
                                json={"status": {"readyReplicas": 1}})
            await eventually(lambda: env.pool()["status"].get("ready") == "both 1/1")
            assert env.pool()["status"]["replicas"]["both"] == {"desired": 1, "ready": 1}
            assert "MetricsAvailable" not in conditions(env)
            # one Event per recheck of the whole status, not one per tick (ten a second here)
            assert len(refusals(env)) <= 2 + (time.monotonic() - first_refused) / handlers.STATUS_RECHECK_SECONDS

            # The reconcile's status too: an edit of the spec is observed.
            await env.k8s.patch(f"{POOLS}/chat", json={"spec": {"router": {"replicas": 1}}})
            await eventually(lambda: env.pool()["status"]["observedGeneration"] == 2)

            # The CRD applied: the next recheck writes the whole status, MetricsAvailable with it.
            env.k8s.upgraded = True
            metrics = await eventually(lambda: conditions(env).get("MetricsAvailable"))
            assert (metrics["status"], metrics["reason"]) == ("False", "PodsNotAnswering")
            ticking.cancel()

    run(main)


def test_refused_status_drops_what_the_answer_names() -> None:
    """The pure part: the patch without the conditions (by their index in the patch sent: a merge patch replaces
    the list whole) and the status fields the 422 names, or None when it names none that the patch has."""
    patch = {"conditions": [{"type": "Degraded", "status": "False"}, {"type": "MetricsAvailable", "status": "False"},
                            {"type": "Ready", "status": "True"}],
             "replicas": {"both": {"desired": 2}}, "kvUsage": {"observed": 0.5}}
    answer = invalid_condition("chat", 1, "MetricsAvailable")
    body = {"kind": "Status", "code": 422, "reason": answer.reason, "message": answer.message,
            "details": answer.details}
    refusal = refused_status(patch, body)
    assert refusal == RefusedStatus(frozenset({"MetricsAvailable"}), frozenset())
    kept = refusal.left_out_of(patch)
    assert [c["type"] for c in kept["conditions"]] == ["Degraded", "Ready"]
    assert kept["replicas"] == patch["replicas"] and kept["kvUsage"] == patch["kvUsage"]
    assert len(patch["conditions"]) == 3  # not changed

    # a field outside the conditions: that field goes
    other = {**body, "details": {"causes": [{"reason": "FieldValueInvalid", "field": "status.kvUsage.observed"}]}}
    refusal = refused_status(patch, other)
    assert refusal == RefusedStatus(frozenset(), frozenset({"kvUsage"}))
    assert "kvUsage" not in refusal.left_out_of(patch) and "replicas" in refusal.left_out_of(patch)
    # a condition it cannot tell by its index: the whole list goes
    beyond = {**body, "details": {"causes": [{"field": "status.conditions[7].type"}]}}
    assert refused_status(patch, beyond) == RefusedStatus(frozenset(), frozenset({"conditions"}))

    # nothing named (no causes, or fields the patch lacks): no smaller patch to try
    assert refused_status(patch, {"kind": "Status", "code": 422}) is None
    assert refused_status(patch, {**body, "details": {"causes": [{"field": "status.routerAddress"}]}}) is None
    assert refused_status(patch, {**body, "details": {"causes": [{"field": "metadata.name"}]}}) is None
