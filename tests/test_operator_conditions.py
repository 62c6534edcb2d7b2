"""The pool's Ready, Progressing and stuck-rollout conditions (operator/conditions.py), from Deployments as the API
server reports them: a scale-up still serves, a rollout is Progressing until every pod runs the new template, and
one past its deadline is Degraded even while the old pods keep the pool Ready."""

from __future__ import annotations

from typing import Any

from kvmesh.operator.conditions import pool_conditions


def deployment(replicas: int, ready: int, updated: int | None = None, generation: int = 1, observed: int = 1,
               stuck: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}] if stuck else []
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready, "updatedReplicas": replicas if updated is None else updated,
                       "observedGeneration": observed, "conditions": conditions}}


def by_kind(roles: tuple[str, ...], replicas: dict[str, int], deployments: dict[str, Any]) -> dict[str, Any]:
    return {c.kind: c for c in pool_conditions(roles, replicas, deployments)}


def test_a_pool_with_every_pod_ready_is_ready_and_stable() -> None:
    found = by_kind(("both",), {"both": 2}, {"both": deployment(2, 2), "router": deployment(2, 2)})
    assert (found["Ready"].value, found["Ready"].reason) == (True, "PodsReady")
    assert (found["Progressing"].value, found["Progressing"].reason) == (False, "Stable")
    assert "Degraded" not in found


def test_a_scale_up_waiting_for_its_new_pods_still_serves() -> None:
    found = by_kind(("both",), {"both": 3}, {"both": deployment(3, 2), "router": deployment(1, 1)})
    assert (found["Ready"].value, found["Ready"].reason) == (True, "Scaling")
    assert (found["Progressing"].value, found["Progressing"].reason) == (True, "WaitingForPods")
    assert "both 2/3" in found["Ready"].message


def test_a_role_with_no_ready_pod_or_no_router_is_not_ready() -> None:
    roles = ("prefill", "decode")
    found = by_kind(roles, {"prefill": 1, "decode": 2},
                    {"prefill": deployment(1, 0), "decode": deployment(2, 2), "router": deployment(1, 1)})
    assert (found["Ready"].value, found["Ready"].reason) == (False, "PodsNotReady")
    found = by_kind(("both",), {"both": 1}, {"both": deployment(1, 1), "router": deployment(1, 0)})
    assert found["Ready"].value is False


def test_a_role_scaled_to_zero_needs_no_ready_pod() -> None:
    found = by_kind(("both",), {"both": 0}, {"both": deployment(0, 0), "router": deployment(1, 1)})
    assert (found["Ready"].value, found["Ready"].reason) == (True, "PodsReady")


def test_a_rollout_is_progressing_until_every_pod_runs_the_new_template() -> None:
    """The old pods are all ready, so counts alone read Stable; the Deployment's own status says it rolls."""
    rolling = deployment(2, 2, updated=1, generation=2, observed=2)
    found = by_kind(("both",), {"both": 2}, {"both": rolling, "router": deployment(1, 1)})
    assert found["Ready"].value is True
    assert (found["Progressing"].value, found["Progressing"].reason) == (True, "RollingOut")
    unseen = deployment(2, 2, generation=3, observed=2)  # the controller has not read the new template yet
    assert by_kind(("both",), {"both": 2}, {"both": unseen, "router": deployment(1, 1)})["Progressing"].value


def test_a_rollout_past_its_deadline_is_degraded_while_the_old_pods_serve() -> None:
    stalled = deployment(2, 2, updated=1, generation=2, observed=2, stuck=True)
    found = by_kind(("both",), {"both": 2}, {"both": stalled, "router": deployment(1, 1)})
    assert found["Ready"].value is True
    assert (found["Degraded"].value, found["Degraded"].reason) == (True, "RolloutStuck")
    assert "both" in found["Degraded"].message
