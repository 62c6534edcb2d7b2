"""The operator's own /metrics: per pool and role, the replicas it wants, its predictions, its decisions.

One registry shape for the cluster operator (operator/handlers.py) and the local one inside `kvmesh up -f`
(operator/local.py), so dashboards and alerts read both the same way. Kopf-free: `kvmesh up` imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvmesh.engine.protocol import LORA_ACTIONS, LORA_OUTCOMES, SCALING_DIRECTIONS, OperatorMetric
from kvmesh.operator.crd import Pool
from kvmesh.operator.lora import EngineSync
from kvmesh.operator.scaling import Decision


class OperatorMetrics:
    """The operator's series, labelled `pool_namespace`, `pool`, `role`; a deleted pool's are dropped."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["pool_namespace", "pool", "role"]
        self.desired = Gauge(OperatorMetric.DESIRED_REPLICAS, "Replicas the operator wants per role.", labels,
                             registry=self.registry)
        self.decisions = Counter(OperatorMetric.SCALING_DECISIONS, "Scaling decisions that changed replicas.",
                                 [*labels, "direction"], registry=self.registry)
        self.predicted = Gauge(OperatorMetric.PREDICTED_KV_USAGE, "Predicted KV demand at the policy's level over "
                               "the role's capacity at the horizon.", labels, registry=self.registry)
        self.overload = Gauge(OperatorMetric.OVERLOAD_PROBABILITY, "P(KV usage > 95 % within the horizon).", labels,
                              registry=self.registry)
        self.lora_actions = Counter(OperatorMetric.LORA_ACTIONS, "LoRA adapter loads and unloads in running "
                                    "engines, by outcome.", [*labels, "action", "outcome"], registry=self.registry)
        self._keys: set[tuple[str, str, str]] = set()
        self._lora_keys: set[tuple[str, str, str]] = set()

    def record(self, pool: Pool, decision: Decision, replicas: Mapping[str, int], before: Mapping[str, int]) -> None:
        self.record_adapters(pool, ())  # the adapter series exist from the pool's first tick, with or without any
        for role, d in decision.roles.items():
            key = (pool.namespace, pool.name, role)
            self._keys.add(key)
            for direction in SCALING_DIRECTIONS:  # every series exists from the first tick
                self.decisions.labels(*key, direction)
            if replicas[role] != before.get(role, replicas[role]):
                self.decisions.labels(*key, "up" if replicas[role] > before[role] else "down").inc()
            self.desired.labels(*key).set(replicas[role])
            self.predicted.labels(*key).set(d.predicted_usage)
            self.overload.labels(*key).set(d.overload_probability)

    def record_adapters(self, pool: Pool, syncs: Sequence[EngineSync]) -> None:
        """Count a tick's adapter actions per engine role; every action and outcome series exists from the first
        tick."""
        for role in sorted(set(pool.roles) | {s.pod.role for s in syncs}):  # a pod of a role left by a mode change
            key = (pool.namespace, pool.name, role)
            self._lora_keys.add(key)
            for action in LORA_ACTIONS:
                for outcome in LORA_OUTCOMES:
                    self.lora_actions.labels(*key, action, outcome)
        for sync in syncs:
            for result in sync.results:
                self.lora_actions.labels(pool.namespace, pool.name, sync.pod.role, result.action.kind,
                                         result.outcome).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted pool's series."""
        for key in [k for k in self._keys if k[:2] == (namespace, name)]:
            self._keys.discard(key)
            for gauge in (self.desired, self.predicted, self.overload):
                gauge.remove(*key)
            for direction in SCALING_DIRECTIONS:
                self.decisions.remove(*key, direction)
        for key in [k for k in self._lora_keys if k[:2] == (namespace, name)]:
            self._lora_keys.discard(key)
            for action in LORA_ACTIONS:
                for outcome in LORA_OUTCOMES:
                    self.lora_actions.remove(*key, action, outcome)
