"""Which engine pods leave first when a role shrinks: the ones worth least. The cluster operator writes these costs
on its pods (`controller.kubernetes.io/pod-deletion-cost`) and Kubernetes removes the cheapest; `kvmesh up`
drains the same engines itself, in the order a ReplicaSet would. Pure: one choice for both.

A pod's worth is counted in tokens the pool would compute again without it: the cached prompt tokens it served
per second lately, over `CACHE_WORTH_SECONDS` (what its cache saves until the survivors have taken its prefixes
over), plus the KV tokens its requests in flight hold now (a drained pod keeps them to the end, a migrated stream
computes them again elsewhere). A pod with 200 streams and no hits is worth more than an idle one with a few:
hits alone ranked them the other way. A pod whose /metrics did not answer is worth the most: its load is unknown
(it may be the busiest, timing its scrape out), and it must not tie with the coldest pod at Kubernetes' default of 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.operator.forecast import PodMetrics
from kvmesh.operator.scaling import scale_in_order

CACHE_WORTH_SECONDS = 60.0  # about a pod's start-up: how long a departed cache's hits are missed


def pod_worth(metrics: PodMetrics, hit_rate: float) -> float:
    """Tokens the pool would compute again without this pod (see the module's docstring)."""
    o = metrics.observation
    in_flight_tokens = o.usage * o.num_blocks * metrics.block_size
    return hit_rate * CACHE_WORTH_SECONDS + in_flight_tokens


def deletion_costs(role: str, scraped: Sequence[PodMetrics], hit_rates: Mapping[str, float],
                   pods: Iterable[str] = ()) -> dict[str, int]:
    """Per pod of `role`, its deletion cost (lowest leaves first): the scraped ones by their worth (`pod_worth`),
    then by requests in flight (`scaling.scale_in_order`); `pods`, the role's other pods (listed, not scraped),
    above them all. The caller writes every one of them at each scale-in, so that no cost written at an earlier
    one stays on a pod whose worth has changed since."""
    mine = [m for m in scraped if m.observation.role == role]
    return scale_in_order({m.observation.name: (pod_worth(m, hit_rates.get(m.observation.name, 0.0)),
                                                m.observation.running + m.observation.waiting) for m in mine},
                          unscraped=pods)


@dataclass(frozen=True)
class Candidate:
    """A pod of a shrinking role: its name, and whether it is Ready (serving, not starting or warming up)."""

    name: str
    ready: bool


def removal_order(candidates: Sequence[Candidate], costs: Mapping[str, int]) -> list[str]:
    """`candidates` (listed newest first) in the order a ReplicaSet removes them: pods not Ready first (they hold
    no cache and serve nobody), then the lowest deletion cost, and among equals the newest. A pod with no cost
    (not scraped) ranks above every costed one, as `deletion_costs` writes it."""
    unknown = max(costs.values(), default=-1) + 1
    return [c.name for c in sorted(candidates, key=lambda c: (c.ready, costs.get(c.name, unknown)))]
