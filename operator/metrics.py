"""The operator's own /metrics: per pool and role, the replicas it wants, its predictions, its decisions.

One registry shape for the cluster operator (operator/handlers.py) and the local one inside `kvmesh up -f`
(operator/local.py), so dashboards and alerts read both the same way. Kopf-free: `kvmesh up` imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvmesh.engine.protocol import (
    EVALUATION_OUTCOMES,
    LORA_ACTIONS,
    LORA_OUTCOMES,
    SCALING_DIRECTIONS,
    OperatorMetric,
)
from kvmesh.operator.crd import Pool
from kvmesh.operator.lora import EngineSync
from kvmesh.operator.scaling import Decision


class OperatorMetrics:
    """The operator's series, labelled `pool_namespace`, `pool`, `role` (the heartbeat's per pool, without
    `role`); a deleted pool's are dropped."""

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
        # The heartbeat: a stuck timer, a crash loop or lost permissions stop it or turn it to errors, while the
        # series above just stop changing. The interval lets an alert say "several periods" for any pool.
        pool_labels = ["pool_namespace", "pool"]
        self.evaluations = Counter(OperatorMetric.EVALUATIONS, "Scaling evaluations of a pool, by outcome (error: "
                                   "it raised or could not read its inputs).", [*pool_labels, "outcome"],
                                   registry=self.registry)
        self.last_evaluation = Gauge(OperatorMetric.LAST_EVALUATION, "When the operator last evaluated the pool, "
                                     "either outcome (Unix seconds).", pool_labels, registry=self.registry)
        self.interval = Gauge(OperatorMetric.EVALUATION_INTERVAL, "The pool's scaling.intervalSeconds: how often "
                              "it is due for an evaluation.", pool_labels, registry=self.registry)
        self._keys: set[tuple[str, str, str]] = set()
        self._lora_keys: set[tuple[str, str, str]] = set()
        self._pools: set[tuple[str, str]] = set()

    @contextmanager
    def evaluation(self, pool: Pool) -> Iterator[None]:
        """Count the block as one scaling evaluation of `pool`: ok, or error if it raises (the exception goes on).
        The one place both operators count their ticks."""
        ok = False
        try:
            yield
            ok = True
        finally:
            self.evaluated(pool.namespace, pool.name, ok, pool.spec["scaling"]["intervalSeconds"])

    def evaluated(self, namespace: str, name: str, ok: bool, interval_seconds: float | None = None) -> None:
        """One evaluation of a pool, stamped now (wall clock: alerts compare it with Prometheus' time()); without
        `interval_seconds` (a spec that does not parse) the last one known stays."""
        key = (namespace, name)
        self._pools.add(key)
        for outcome in EVALUATION_OUTCOMES:  # both series exist from the first evaluation
            self.evaluations.labels(*key, outcome)
        self.evaluations.labels(*key, "ok" if ok else "error").inc()
        self.last_evaluation.labels(*key).set_to_current_time()
        if interval_seconds is not None:
            self.interval.labels(*key).set(interval_seconds)

    def record(self, pool: Pool, decision: Decision, replicas: Mapping[str, int], before: Mapping[str, int]) -> None:
        """A tick's decision per role. The series of a role the decision no longer has (the pool's mode changed)
        are dropped: a `desired_replicas` left for it would read as engines wanted and none up (the chart's
        KvmeshPoolEnginesUnavailable) until the operator restarts."""
        self.record_adapters(pool, ())  # the adapter series exist from the pool's first tick, with or without any
        for key in [k for k in self._keys if k[:2] == (pool.namespace, pool.name) and k[2] not in decision.roles]:
            self._drop_role(key)
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

    def _drop_role(self, key: tuple[str, str, str]) -> None:
        """Remove one pool role's decision series."""
        self._keys.discard(key)
        for gauge in (self.desired, self.predicted, self.overload):
            gauge.remove(*key)
        for direction in SCALING_DIRECTIONS:
            self.decisions.remove(*key, direction)

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted pool's series."""
        if (namespace, name) in self._pools:
            self._pools.discard((namespace, name))
            for outcome in EVALUATION_OUTCOMES:
                self.evaluations.remove(namespace, name, outcome)
            self.last_evaluation.remove(namespace, name)
            self.interval.remove(namespace, name)
        for key in [k for k in self._keys if k[:2] == (namespace, name)]:
            self._drop_role(key)
        for key in [k for k in self._lora_keys if k[:2] == (namespace, name)]:
            self._lora_keys.discard(key)
            for action in LORA_ACTIONS:
                for outcome in LORA_OUTCOMES:
                    self.lora_actions.remove(*key, action, outcome)


class LeaderMetrics:
    """The leader election's series (operator/leader.py), only in an operator run with --leader-elect: whether
    this replica leads, and how often it took the lease (summed over replicas: the lease's first holder, then
    every failover and handover)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.leader = Gauge(OperatorMetric.LEADER, "1 while this operator process holds the leader lease, else 0.",
                            registry=registry)
        self.transitions = Counter(OperatorMetric.LEADER_TRANSITIONS,
                                   "Times this operator process took the leader lease.", registry=registry)

    def acquired(self) -> None:
        self.leader.set(1)
        self.transitions.inc()

    def stopped(self) -> None:
        self.leader.set(0)
