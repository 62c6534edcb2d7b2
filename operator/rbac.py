"""Every Kubernetes API verb and resource the operator and the router use: the one list.

The operator's ClusterRole and each pool's router Role are built from it (desired.py, the Helm chart), the
emulator tests record the requests the operator makes and fail on any outside it, and the chart's RBAC is
checked against it. Kubernetes refuses to let a subject grant permissions it does not hold itself, so the
operator's list includes the router's (it creates the routers' Roles).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.operator.crd import GROUP, PLURAL


@dataclass(frozen=True)
class Permission:
    group: str  # "" is the core API group
    resource: str  # plural, with "/subresource" where one is used
    verbs: tuple[str, ...]
    why: str

    def rule(self) -> dict[str, list[str]]:
        """As a Role's rule."""
        return {"apiGroups": [self.group], "resources": [self.resource], "verbs": list(self.verbs)}


APPLY = ("get", "list", "watch", "create", "patch", "delete")  # what the operator does to objects it owns

ROUTER: tuple[Permission, ...] = (
    Permission("discovery.k8s.io", "endpointslices", ("get", "list", "watch"),
               "the router follows the engine pods of its pool (router/discovery.py)"),
)

OPERATOR: tuple[Permission, ...] = (
    Permission(GROUP, PLURAL, ("get", "list", "watch", "patch"),
               "kopf watches pools and keeps its progress in their annotations"),
    Permission(GROUP, f"{PLURAL}/status", ("get", "patch"), "conditions, replicas, KV usage"),
    Permission("", "events", ("create", "patch"), "an Event for every decision (kopf posts them)"),
    Permission("", "configmaps", APPLY, "the engine and router configuration files"),
    Permission("", "services", APPLY, "the engines' headless Service and the router's Service"),
    Permission("", "serviceaccounts", APPLY, "the router's identity"),
    Permission("", "pods", ("get", "list", "watch", "patch"),
               "scraping engine forecasts; pod-deletion-cost for cache-aware scale-in"),
    Permission("apps", "deployments", APPLY, "engines per role and the router"),
    Permission("apps", "deployments/scale", ("get", "patch"), "setting replicas"),
    Permission("policy", "poddisruptionbudgets", APPLY, "voluntary disruptions take one engine at a time"),
    Permission("autoscaling", "horizontalpodautoscalers", APPLY, "scaling.mode: hpa"),
    Permission("rbac.authorization.k8s.io", "roles", APPLY, "the router's Role"),
    Permission("rbac.authorization.k8s.io", "rolebindings", APPLY, "the router's RoleBinding"),
    Permission("inference.networking.k8s.io", "inferencepools", APPLY, "Gateway API Inference Extension interop"),
    *ROUTER,
)


def allows(permissions: tuple[Permission, ...], group: str, resource: str, verb: str) -> bool:
    return any(p.group == group and p.resource == resource and verb in p.verbs for p in permissions)


def cluster_role(name: str = "kvmesh-operator") -> dict[str, object]:
    """The operator's ClusterRole (the Helm chart renders the same rules)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": [p.rule() for p in OPERATOR]}
