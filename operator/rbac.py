"""Every Kubernetes API verb and resource the operator, the router and the gateway use: the one list.

The operator's ClusterRole, its Role for leader election, each pool's router Role and the gateway's ClusterRole
are built from it (desired.py, the Helm chart), the emulator tests record the requests the operator makes and
fail on any outside it, and the chart's RBAC is checked against it. Kubernetes refuses to let a subject grant
permissions it does not hold itself, so the operator's list includes the router's (it creates the routers' Roles).
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


# objects every pool owns: applied by create-then-patch (read first when the name exists, to patch only the pool's
# own: operator/kube.py same_owner), removed by the GC with it
APPLY = ("create", "get", "patch")
OWN = ("list", "create", "get", "patch", "delete")  # objects some specs ask for: also listed, pruned when not wanted

ROUTER: tuple[Permission, ...] = (
    Permission("discovery.k8s.io", "endpointslices", ("list", "watch"),
               "the router follows the engine pods of its pool (router/discovery.py)"),
)

OPERATOR: tuple[Permission, ...] = (
    Permission(GROUP, PLURAL, ("list", "watch", "patch"),
               "kopf watches pools and keeps its progress and finalizer in their metadata"),
    Permission(GROUP, f"{PLURAL}/status", ("patch",), "conditions, replicas, KV usage"),
    Permission("", "events", ("create",), "an Event for every decision"),
    Permission("", "configmaps", APPLY, "the engine and router configuration files"),
    Permission("", "services", APPLY, "the engines' headless Service and the router's Service"),
    Permission("", "serviceaccounts", APPLY, "the router's identity"),
    Permission("", "secrets", ("create", "get"),
               "each pool's internal token: created once when missing, read to call its engines, never rewritten"),
    Permission("", "pods", ("list", "patch"), "scraping engine forecasts; pod-deletion-cost for cache-aware scale-in"),
    Permission("apps", "deployments", OWN, "engines per role and the router; replicas"),
    Permission("policy", "poddisruptionbudgets", OWN, "voluntary disruptions take one pod at a time"),
    Permission("autoscaling", "horizontalpodautoscalers", OWN, "scaling.mode: hpa"),
    Permission("rbac.authorization.k8s.io", "roles", APPLY, "the router's Role"),
    Permission("rbac.authorization.k8s.io", "rolebindings", APPLY, "the router's RoleBinding"),
    Permission("inference.networking.k8s.io", "inferencepools", OWN, "Gateway API Inference Extension interop"),
    *ROUTER,
)


# Leader election (operator/leader.py), in the operator's own namespace only: the chart's Role, not the ClusterRole.
LEADER_ELECTION = Permission("coordination.k8s.io", "leases", ("get", "create", "update"),
                             "the operator replicas' leader election on one Lease (operator/leader.py)")


# `kvmesh gateway` (router/gateway_app.py): the pools' router addresses, listed at every refresh (the chart's
# gateway ClusterRole, bound cluster-wide or in gateway.namespace).
GATEWAY: tuple[Permission, ...] = (
    Permission(GROUP, PLURAL, ("list",), "the gateway finds every pool's router in its status"),
)


def allows(permissions: tuple[Permission, ...], group: str, resource: str, verb: str) -> bool:
    return any(p.group == group and p.resource == resource and verb in p.verbs for p in permissions)


def cluster_role(name: str = "kvmesh-operator") -> dict[str, object]:
    """The operator's ClusterRole (the Helm chart renders the same rules)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": [p.rule() for p in OPERATOR]}
