"""Load shedding by priority: when the pool is overloaded, refuse the least important requests first.

Overload is how far the chosen pod (the best the pool has) is past the pool's limits: its estimated TTFT over
the TTFT SLO, or its probability of running out of KV (the engine's own forecast) over the threshold. A request
of priority p is shed when overload passes (1 + headroom) ** p: at priority 0 as soon as the SLO breaks, at
higher priorities only as overload grows, at negative ones before it breaks, and never on an idle pool.

Fair sharing decides whom, among tenants, that refusal falls on: when the pool would shed, a tenant holding more
than its weighted share of the router's requests in flight is shed, while a tenant within its share, whose
request would be shed only because another tenant's burst overloads the pool, is served (up to one priority
level more overload: shedding the burst is what relieves the pool). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvmesh.router.picker import Decision


@dataclass(frozen=True)
class ShedPolicy:
    ttft_slo_seconds: float | None = None  # None: never shed on TTFT
    overload_probability: float = 0.9  # shed when the chosen pod's forecast says it runs out of KV this likely
    priority_headroom: float = 0.5  # each priority level tolerates this much more overload


@dataclass(frozen=True)
class Shed:
    """A refusal: the 429's message and its Retry-After; `fair_share` when its tenant was above its share."""

    overload: float
    retry_after_seconds: int
    message: str
    fair_share: bool = False


@dataclass(frozen=True)
class FairShare:
    """A tenant's requests in flight (the one deciding included), its weighted share of all the pool's, and
    whether another tenant holds more than its own share."""

    inflight: int
    share: float
    others_over: bool

    @property
    def over(self) -> bool:
        return self.inflight > self.share + 1e-9


def fair_share(inflight: Mapping[str, int], weight: Callable[[str], float], tenant: str) -> FairShare:
    """Each tenant with requests in flight is owed weight / (the weights of those tenants) of them all: a tenant
    alone owns the whole pool, and an idle tenant's share goes to those who use the pool."""
    active = {name: count for name, count in inflight.items() if count > 0}
    total, weights = sum(active.values()), sum(weight(name) for name in active | {tenant: 0})

    def share(name: str) -> float:
        return total * weight(name) / weights

    others_over = any(count > share(name) + 1e-9 for name, count in active.items() if name != tenant)
    return FairShare(active.get(tenant, 0), share(tenant), others_over)


def overload(decision: Decision, policy: ShedPolicy) -> float:
    """1.0 means exactly at the pool's limits; above means past them."""
    if decision.pod is None:
        return 0.0
    levels = [decision.pod.overload_probability / policy.overload_probability]
    if policy.ttft_slo_seconds:
        levels.append(decision.estimated_ttft_seconds / policy.ttft_slo_seconds)
    return max(levels)


def should_shed(decision: Decision, priority: int, policy: ShedPolicy, fair: FairShare | None = None) -> Shed | None:
    """The refusal for a request of this priority (of a tenant whose place is `fair`), or None to serve it."""
    level = overload(decision, policy)
    limit = _limit(priority, policy)
    if level <= limit:
        return None
    if fair is not None and not fair.over and fair.others_over and level <= _limit(priority + 1, policy):
        return None  # another tenant's burst overloads the pool: it is shed, not this tenant within its share
    wait = decision.estimated_ttft_seconds - (policy.ttft_slo_seconds or 0.0)
    over = fair is not None and fair.over
    why = (f"; your tenant holds {fair.inflight} of the pool's requests in flight, above its fair share of "
           f"{fair.share:.1f}" if fair is not None and over else "")
    return Shed(
        overload=level,
        retry_after_seconds=max(1, math.ceil(wait)),
        message=f"the pool is overloaded ({level:.2f}x its limits; requests of priority {priority} are shed "
        f"above {limit:.2f}x{why}); retry later or with a higher x-kvmesh-priority",
        fair_share=over,
    )


def _limit(priority: int, policy: ShedPolicy) -> float:
    """The overload a request of this priority tolerates."""
    return (1.0 + policy.priority_headroom) ** max(min(priority, 64), -64)


def priority_label(priority: int) -> str:
    """A bounded label for metrics."""
    return "low" if priority < 0 else "normal" if priority == 0 else "high"
