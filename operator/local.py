"""The operator's decisions on one machine: `kvmesh up -f pool.yaml` reads the pool through operator/crd.py (the
same defaults and checks as the cluster), writes the same engine and router settings, and runs the same scaler
over its local engines, whose decisions `kvmesh up` carries out, so scaling works without Kubernetes.

Locally the engines listen on 127.0.0.1 at ports `kvmesh up` picks, and the router follows them in a pods file
that `kvmesh up` rewrites; everything else in the two files is what the operator's ConfigMap holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.operator.crd import Pool
from kvmesh.operator.desired import engine_settings, router_settings
from kvmesh.operator.forecast import Scaler
from kvmesh.operator.scaling import Decision

__all__ = ["Scaler", "describe", "local_engine_settings", "local_router_settings"]

# Settings the cluster's files carry that a local pool sets otherwise (addresses, discovery).
CLUSTER_ONLY_ENGINE = ("host", "port")
CLUSTER_ONLY_ROUTER = ("host", "port", "discovery", "namespace")


def local_engine_settings(pool: Pool) -> dict[str, Any]:
    return {k: v for k, v in engine_settings(pool).items() if k not in CLUSTER_ONLY_ENGINE}


def local_router_settings(pool: Pool) -> dict[str, Any]:
    return {k: v for k, v in router_settings(pool).items() if k not in CLUSTER_ONLY_ROUTER}


def describe(decision: Decision, replicas: Mapping[str, int]) -> list[str]:
    """One line per role whose replicas the decision changes."""
    return [f"{role}: {replicas.get(role)} -> {n} ({decision.roles[role].reason}; predicted KV "
            f"{decision.roles[role].predicted_usage:.0%}, P(>95%) {decision.roles[role].overload_probability:.0%})"
            for role, n in decision.changed(replicas).items()]
