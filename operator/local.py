"""The operator's decisions on one machine: `kvmesh up -f pool.yaml` reads the pool through operator/crd.py (the
same defaults and checks as the cluster), writes the same engine and router settings, and runs the operator's
scaling tick over its local engines: the same scaler, the same warm-ups of new engines from the peer whose cache
serves the most hits, and the same /metrics registry. `kvmesh up` carries the decisions out, so scaling works
without Kubernetes.

Locally the engines listen on 127.0.0.1 at ports `kvmesh up` picks, and the router follows them in a pods file
that `kvmesh up` rewrites; everything else in the two files is what the operator's ConfigMap holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.operator.crd import Pool
from kvmesh.operator.desired import engine_settings, router_settings
from kvmesh.operator.engines import http_open_gates, http_warm
from kvmesh.operator.forecast import Scaler, parse_pod
from kvmesh.operator.memory import PoolMemory, pod_hit_rates
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.operator.scale_in import deletion_costs
from kvmesh.operator.scaling import Decision
from kvmesh.operator.warmup import (
    GateOpener,
    PodPlace,
    Warmer,
    WarmupPlan,
    WarmupSettings,
    carry_out,
    plan_tick_warmups,
)

__all__ = ["LocalOperator", "LocalPod", "describe", "local_engine_settings", "local_router_settings"]

# Settings the cluster's files carry that a local pool sets otherwise (addresses, discovery).
CLUSTER_ONLY_ENGINE = ("host", "port")
CLUSTER_ONLY_ROUTER = ("host", "port", "discovery", "namespace", "ext_proc_port", "ext_proc_tls",
                       "ext_proc_cert_dir")  # no Gateway locally


def local_engine_settings(pool: Pool) -> dict[str, Any]:
    return {k: v for k, v in engine_settings(pool).items() if k not in CLUSTER_ONLY_ENGINE}


def local_router_settings(pool: Pool) -> dict[str, Any]:
    return {k: v for k, v in router_settings(pool).items() if k not in CLUSTER_ONLY_ROUTER}


def describe(decision: Decision, replicas: Mapping[str, int]) -> list[str]:
    """One line per role whose replicas the decision changes."""
    return [decision.describe(role, replicas) for role in decision.changed(replicas)]


@dataclass(frozen=True)
class LocalPod:
    """A local engine that answered its /metrics this tick (the cluster's pod with an address that answered)."""

    name: str
    role: str
    url: str
    metrics: str  # its /metrics text
    ready: bool  # its /health answered 200 (the pod's Ready condition): False while its warm-up gate holds it


@dataclass(frozen=True)
class Tick:
    decision: Decision
    warmups: WarmupPlan  # the engines that began serving since the last tick: whom to warm from whom, whom to open
    deletion_costs: Mapping[str, int]  # per engine scraped, the operator's pod-deletion cost: the cheapest drains first


class LocalOperator:
    """The operator's scaling tick for one local pool, less the Kubernetes calls: `decide` observes and plans,
    `kvmesh up` warms (`warm_up`) and scales, and `record` exports the outcome under the operator's own metric
    names and labels."""

    def __init__(self, pool: Pool, warm: Warmer = http_warm, open_gates: GateOpener = http_open_gates) -> None:
        self.pool = pool
        self.metrics = OperatorMetrics()
        self.scaler = Scaler(pool)
        self.memory = PoolMemory(scaler=self.scaler)  # what the timer keeps between ticks: hits, serving pods
        self.warmup = WarmupSettings.of(pool)
        self._warm, self._open_gates = warm, open_gates

    @property
    def gated(self) -> bool:
        """Engines the scaler adds wait for their warm-up."""
        return self.warmup.gated

    def decide(self, now: float, pods: list[LocalPod], replicas: Mapping[str, int]) -> Tick:
        scraped = [parse_pod(p.name, p.role, p.metrics) for p in pods]
        decision = self.scaler.observe(now, scraped, replicas)
        hit_rates = pod_hit_rates(self.memory, now, scraped)
        places = {p.name: PodPlace(p.url, p.ready) for p in pods}
        warmups = plan_tick_warmups(self.memory, scraped, places, hit_rates, self.warmup)
        costs = {name: cost for role in self.pool.roles
                 for name, cost in deletion_costs(role, scraped, hit_rates).items()}
        return Tick(decision, warmups, costs)

    def warm_up(self, plan: WarmupPlan) -> list[str]:
        """Carry out a tick's warm-ups with the operator's HTTP calls, and open the gates of new engines left with
        nothing copied; one line per engine saying what it got. A failure is reported, never raised: the engine
        serves anyway (its grace opens its gate at the latest), computing those prefixes itself."""
        results = carry_out(plan, self.warmup.limit, self.warmup.gated, self._warm, self._open_gates)
        return [o.message for _, _, o in results.warmed] + [o.message for _, o in results.opened]

    def record(self, decision: Decision, replicas: Mapping[str, int], before: Mapping[str, int]) -> None:
        """The replicas carried out (`before` them: what the decision saw), as the operator's timer records them."""
        self.metrics.record(self.pool, decision, replicas, before)

