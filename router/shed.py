"""Load shedding by priority: when the pool is overloaded, refuse the least important requests first.

Overload is how far the chosen pod (the best the pool has) is past the pool's limits: its estimated TTFT over
the TTFT SLO, or its probability of running out of KV (the engine's own forecast) over the threshold. A request
of priority p is shed when overload passes (1 + headroom) ** p: at priority 0 as soon as the SLO breaks, at
higher priorities only as overload grows, at negative ones before it breaks, and never on an idle pool.
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.router.picker import Decision


@dataclass(frozen=True)
class ShedPolicy:
    ttft_slo_seconds: float | None = None  # None: never shed on TTFT
    overload_probability: float = 0.9  # shed when the chosen pod's forecast says it runs out of KV this likely
    priority_headroom: float = 0.5  # each priority level tolerates this much more overload


@dataclass(frozen=True)
class Shed:
    """A refusal: the 429's message and its Retry-After."""

    overload: float
    retry_after_seconds: int
    message: str


def overload(decision: Decision, policy: ShedPolicy) -> float:
    """1.0 means exactly at the pool's limits; above means past them."""
    if decision.pod is None:
        return 0.0
    levels = [decision.pod.overload_probability / policy.overload_probability]
    if policy.ttft_slo_seconds:
        levels.append(decision.estimated_ttft_seconds / policy.ttft_slo_seconds)
    return max(levels)


def should_shed(decision: Decision, priority: int, policy: ShedPolicy) -> Shed | None:
    """The refusal for a request of this priority, or None to serve it."""
    level = overload(decision, policy)
    limit = (1.0 + policy.priority_headroom) ** max(min(priority, 64), -64)
    if level <= limit:
        return None
    wait = decision.estimated_ttft_seconds - (policy.ttft_slo_seconds or 0.0)
    return Shed(
        overload=level,
        retry_after_seconds=max(1, math.ceil(wait)),
        message=f"the pool is overloaded ({level:.2f}x its limits; requests of priority {priority} are shed "
        f"above {limit:.2f}x); retry later or with a higher x-kvmesh-priority",
    )


def priority_label(priority: int) -> str:
    """A bounded label for metrics."""
    return "low" if priority < 0 else "normal" if priority == 0 else "high"
