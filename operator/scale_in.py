"""Which engine pods leave first when a role shrinks: the ones whose caches are worth least. The cluster operator
writes these costs on its pods (`controller.kubernetes.io/pod-deletion-cost`) and Kubernetes removes the cheapest;
`kvmesh up` drains the same engines itself, in the order a ReplicaSet would. Pure: one choice for both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.operator.forecast import PodMetrics
from kvmesh.operator.scaling import scale_in_order


def deletion_costs(role: str, scraped: Sequence[PodMetrics], hit_rates: Mapping[str, float]) -> dict[str, int]:
    """Per pod of `role` scraped this tick, its deletion cost (lowest leaves first): by the cached prompt tokens
    it served per second lately, then by requests in flight (`scaling.scale_in_order`)."""
    return scale_in_order({m.observation.name: (hit_rates.get(m.observation.name, 0.0),
                                                m.observation.running + m.observation.waiting)
                           for m in scraped if m.observation.role == role})


@dataclass(frozen=True)
class Candidate:
    """A pod of a shrinking role: its name, and whether it is Ready (serving, not starting or warming up)."""

    name: str
    ready: bool


def removal_order(candidates: Sequence[Candidate], costs: Mapping[str, int]) -> list[str]:
    """`candidates` (listed newest first) in the order a ReplicaSet removes them: pods not Ready first (they hold
    no cache and serve nobody), then the lowest deletion cost (an unscraped pod has none: 0, as Kubernetes reads a
    missing annotation), and among equals the newest."""
    return [c.name for c in sorted(candidates, key=lambda c: (c.ready, costs.get(c.name, 0)))]
