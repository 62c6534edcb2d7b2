"""Routers first: the one rollout whose order matters, the first reconcile of a pool made before the internal token.

A pool made by an operator before the internal token (engine/internal_token.py) runs engines and routers whose pod
templates lack INTERNAL_TOKEN_FILE_ENV. The new templates mount the pool's token into both; a new engine refuses
every request without it, and an old router sends none. Rolled at once, routers that lag the engines (new router
pods that cannot be scheduled, a pull error) would be left with no engine that answers them once the old engines
are gone: 503s. So while any engine Deployment of the pool is still legacy and the router Deployment has not rolled
out its template with the token, each legacy engine Deployment keeps its live pod template (its replicas and
everything else are applied as usual); once the routers are rolled out, the engines get the new template (the
scaling tick applies it: `handlers.release_engines`, or the next reconcile). A pool whose engines have the token
(every pool this operator made) is never held.

A pure function of the objects to apply and the live Deployments (by role, the router's under "router").
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.internal_token import INTERNAL_TOKEN_FILE_ENV
from kvmesh.engine.protocol import ROLE_LABEL

ROUTER = "router"
REASON = "RoutersFirst"  # the Progressing condition's reason and the Event's while engines are held


@dataclass(frozen=True)
class Rollout:
    """What to apply: `objects`, in which each Deployment named in `held` carries its live pod template."""

    objects: list[dict[str, Any]]
    held: tuple[str, ...] = ()  # names of the engine Deployments whose template is kept


def has_token(deployment: Mapping[str, Any]) -> bool:
    """Whether the Deployment's pod template gives a container the internal token's file (INTERNAL_TOKEN_FILE_ENV)."""
    spec = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    return any(e.get("name") == INTERNAL_TOKEN_FILE_ENV for c in spec.get("containers") or []
               for e in c.get("env") or [])


def rolled_out(deployment: Mapping[str, Any]) -> bool:
    """Whether the Deployment's pods all run its current template and are available, with no old pod left: its
    controller has seen the template (observedGeneration), updatedReplicas and availableReplicas reach
    spec.replicas, and status.replicas counts no pod beyond the updated ones."""
    wanted = int((deployment.get("spec") or {}).get("replicas") or 0)
    status = deployment.get("status") or {}
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    return (int(status.get("observedGeneration") or 0) >= generation and updated >= wanted
            and int(status.get("availableReplicas") or 0) >= wanted and int(status.get("replicas") or 0) <= updated)


def routers_ready(live: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the routers can use engines that ask for the token: the router Deployment has rolled out a template
    with it, or runs no pod."""
    router = live.get(ROUTER)
    if router is None:
        return False  # about to be created: its pods are not up yet
    if (router.get("spec") or {}).get("replicas") == 0:
        return True
    return has_token(router) and rolled_out(router)


def legacy_engines(live: Mapping[str, Mapping[str, Any]], roles: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The engine roles (of `roles`, or all) whose live Deployment's template lacks the token."""
    return tuple(r for r, d in live.items() if r != ROUTER and (roles is None or r in roles) and not has_token(d))


def routers_first(objects: list[dict[str, Any]], live: Mapping[str, Mapping[str, Any]]) -> Rollout:
    """`objects` as given, but while the routers are not ready (`routers_ready`), each engine Deployment among them
    whose live Deployment is legacy keeps the live `spec.template`. The objects are copied where changed."""
    wanted = {o["metadata"]["labels"].get(ROLE_LABEL) for o in objects if o["kind"] == "Deployment"}
    legacy = set(legacy_engines(live, tuple(r for r in wanted if r)))
    if not legacy or routers_ready(live):
        return Rollout(list(objects))
    out: list[dict[str, Any]] = []
    held: list[str] = []
    for obj in objects:
        role = obj["metadata"].get("labels", {}).get(ROLE_LABEL)
        if obj["kind"] == "Deployment" and role in legacy and "template" in (live[role].get("spec") or {}):
            obj = copy.deepcopy(obj)
            obj["spec"]["template"] = copy.deepcopy(live[role]["spec"]["template"])
            held.append(obj["metadata"]["name"])
        out.append(obj)
    return Rollout(out, tuple(held))


def held_message(held: tuple[str, ...]) -> str:
    """The Progressing condition's message and the Event's while engines are held."""
    verb = "keeps its" if len(held) == 1 else "keep their"
    return (f"upgrading to the internal token: the routers roll out first; {', '.join(held)} {verb} pod template "
            "(no token) until the router Deployment has rolled out its pods with the token, so that no old router is "
            "left with only engines that refuse it")
