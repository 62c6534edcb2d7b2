"""The pool's Ready, Progressing and rollout health, as a pure function of its Deployments and the replicas decided.

Ready means the pool serves: every role that should run has a ready engine, and a router is ready. A scale-up
waiting for its new pods is still Ready (reason Scaling); only a role with no ready pod, or no router, is not.
Progressing is True while a Deployment rolls out a new template or waits for pods, read from the Deployment's own
status (updatedReplicas, observedGeneration), so a rollout whose new pods never become ready is not reported
Stable because the old ones still serve. A Deployment past its progressDeadlineSeconds is a stuck rollout: the
pool is Degraded/RolloutStuck, naming it. After a change of mode, while the previous mode's roles are kept serving
until the new ones can (desired.retained_roles), the pool is Ready and Progressing with reason SwitchingMode.

Also which part of a status patch the API server refused as invalid (`refused_status`): a CRD older than the
operator (its schema limits the condition types to those it knew) refuses every patch that carries a newer
condition, and the rest of the status is then written without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STUCK_REASON = "ProgressDeadlineExceeded"  # a Deployment's Progressing condition once its deadline passed


@dataclass(frozen=True)
class Condition:
    kind: str
    value: bool
    reason: str
    message: str


def _status(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    return deployment.get("status") or {}


def ready_replicas(deployments: Mapping[str, Mapping[str, Any]], roles: tuple[str, ...]) -> dict[str, int]:
    """Each role's ready pods, as its Deployment reports them (0 for one not there)."""
    return {role: int(_status(deployments.get(role) or {}).get("readyReplicas") or 0) for role in roles}


def rolling(deployment: Mapping[str, Any]) -> bool:
    """Whether the Deployment has not yet brought all its pods to its current template (or not yet seen it)."""
    wanted = int((deployment.get("spec") or {}).get("replicas") or 0)
    status = _status(deployment)
    seen = int(status.get("observedGeneration") or 0) >= int((deployment.get("metadata") or {}).get("generation")
                                                               or 0)
    return not seen or int(status.get("updatedReplicas") or 0) < wanted


def stuck(deployment: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Progressing" and c.get("status") == "False" and c.get("reason") == STUCK_REASON
               for c in _status(deployment).get("conditions") or [])


def switching(roles: tuple[str, ...], kept: tuple[str, ...]) -> str:
    """What a change of mode waits for, in the words of the Progressing condition and the SwitchingMode Event."""
    return (f"switching mode: the previous {' and '.join(kept)} pods serve until {' and '.join(roles)} "
            f"{'each have' if len(roles) > 1 else 'has'} a ready pod, then they are deleted")


def pool_conditions(roles: tuple[str, ...], replicas: Mapping[str, int],
                    deployments: Mapping[str, Mapping[str, Any]], kept: tuple[str, ...] = ()) -> list[Condition]:
    """Ready and Progressing, and Degraded when a rollout is stuck (None of it otherwise: the reconcile owns
    Degraded). `deployments` by role, the router's under "router"; `replicas` the engines' decided counts; `kept`
    the previous mode's roles still serving after a change of mode (desired.retained_roles: some has a ready pod)."""
    ready = ready_replicas(deployments, (*roles, *kept, "router"))
    summary = ", ".join(f"{r} {ready[r]}/{replicas[r]}" for r in roles) + "".join(
        f", previous {r} {ready[r]}" for r in kept) + f", router {ready['router']}"
    own = all(ready[r] >= 1 for r in roles if replicas[r] > 0)
    serving = (own or bool(kept)) and ready["router"] >= 1
    all_ready = serving and all(ready[r] >= replicas[r] for r in roles)
    reason = ("PodsNotReady" if not serving else "SwitchingMode" if kept else "PodsReady" if all_ready
              else "Scaling")
    out = [Condition("Ready", serving, reason, summary)]
    moving = sorted(r for r, d in deployments.items() if rolling(d))
    if kept:
        out.append(Condition("Progressing", True, "SwitchingMode", f"{switching(roles, kept)}; {summary}"))
    elif moving:
        out.append(Condition("Progressing", True, "RollingOut", f"rolling out {', '.join(moving)}; {summary}"))
    elif not all_ready:
        out.append(Condition("Progressing", True, "WaitingForPods", summary))
    else:
        out.append(Condition("Progressing", False, "Stable", summary))
    stalled = sorted(r for r, d in deployments.items() if stuck(d))
    if stalled:
        out.append(Condition("Degraded", True, "RolloutStuck",
                             f"the rollout of {', '.join(stalled)} made no progress within its deadline (new pods "
                             "not becoming ready: see their events and logs); the old pods serve meanwhile"))
    return out


# The fields a 422's causes name, as the API server writes them: `status.conditions[5].type`, `status.kvUsage.observed`
_CONDITION_FIELD = re.compile(r"^status\.conditions\[(\d+)\]")
_STATUS_FIELD = re.compile(r"^status\.([^.\[]+)")


@dataclass(frozen=True)
class RefusedStatus:
    """What the API server refused in a pool's status: condition types (an older CRD's enum lacks them), and other
    top-level status fields."""

    condition_types: frozenset[str]
    fields: frozenset[str]

    def __or__(self, other: RefusedStatus) -> RefusedStatus:
        return RefusedStatus(self.condition_types | other.condition_types, self.fields | other.fields)

    def __str__(self) -> str:
        return " and ".join([f"the condition {t}" for t in sorted(self.condition_types)]
                            + [f"status.{f}" for f in sorted(self.fields)])

    def left_out_of(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """`patch` (a status merge patch; not changed) without these: a merge patch replaces the conditions list
        whole, so the stored list is the one sent, less the refused types."""
        out = {k: v for k, v in patch.items() if k not in self.fields}
        if isinstance(out.get("conditions"), list):
            out["conditions"] = [c for c in out["conditions"] if c.get("type") not in self.condition_types]
        return out


def refused_status(patch: Mapping[str, Any], answer: Mapping[str, Any]) -> RefusedStatus | None:
    """What the API server's 422 `answer` (a Status) refused of the status merge patch `patch`, from the fields
    its causes name: a condition by its index in the list sent, any other field as the top-level key holding it.
    None when it names nothing the patch has (no smaller patch would do)."""
    details = answer.get("details")
    causes = details.get("causes") if isinstance(details, Mapping) else None
    conditions = patch.get("conditions")
    conditions = conditions if isinstance(conditions, list) else []
    types: set[str] = set()
    fields: set[str] = set()
    for cause in causes if isinstance(causes, list) else []:
        field = str(cause.get("field") or "") if isinstance(cause, Mapping) else ""
        if (found := _CONDITION_FIELD.match(field)) and int(found[1]) < len(conditions):
            types.add(str(conditions[int(found[1])].get("type")))
        elif (found := _STATUS_FIELD.match(field)) and found[1] in patch:
            fields.add(found[1])
    return RefusedStatus(frozenset(types), frozenset(fields)) if types or fields else None
