"""Warming new engine pods from a peer's hottest prefixes (issue 5): which pods, from whom, with what.

A pod is new when it serves (answers its /metrics) now and did not at the last scaling tick: a scale-up's
pods, or a replaced one. Each is asked to pull, over contract 4, the hottest cached prefix chains of a serving
pod of its role, so the prefixes the pool reuses most are a local hit from its first requests instead of one
full prefill per prefix. Pure: the operator's handler does the HTTP calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServingPod:
    name: str
    role: str
    url: str  # http://ip:port of its engine
    hit_rate: float = 0.0  # cached prompt tokens per second it served lately: how warm its cache is


@dataclass(frozen=True)
class Warmup:
    """Warm `targets` from `source`'s hottest chains (all of one role)."""

    role: str
    source: ServingPod
    targets: tuple[ServingPod, ...]


def plan_warmups(known: frozenset[str] | None, serving: Sequence[ServingPod], limit: int) -> list[Warmup]:
    """Per role, the pods in `serving` not in `known` (the pods that served at the last tick), warmed from the
    old pod whose cache serves the most hits (ties: the first name). Nothing when `known` is None (the
    operator's first tick cannot tell new pods from old, and must not re-warm a whole pool after a restart),
    when `limit` is 0 (warm-up off), or for a role with no old pod to copy (a pool's first pods are all cold)."""
    if known is None or limit <= 0:
        return []
    plans: list[Warmup] = []
    for role in sorted({p.role for p in serving}):
        pods = sorted((p for p in serving if p.role == role), key=lambda p: p.name)
        new = tuple(p for p in pods if p.name not in known)
        old = [p for p in pods if p.name in known]
        if new and old:
            source = max(old, key=lambda p: p.hit_rate)  # max keeps the first of equals: the first name
            plans.append(Warmup(role, source, new))
    return plans


def warm_body(source: str, hot: Mapping[str, Any], limit: int) -> dict[str, Any] | None:
    """The POST /v1/kv/warm body that copies the first `limit` chains of a peer's GET /v1/kv/hot answer `hot`;
    None when it lists none (its cache holds nothing reused yet). Raises ValueError for an answer that is not
    a list of chains of block hashes."""
    chains = hot.get("chains")
    if not isinstance(chains, list):
        raise ValueError(f"the peer's hot listing has no chains: {str(hot)[:200]}")
    picked: list[list[int]] = []
    for chain in chains[:limit]:
        hashes = chain.get("hashes") if isinstance(chain, Mapping) else None
        if not isinstance(hashes, list) or not hashes or not all(type(h) is int for h in hashes):
            raise ValueError(f"the peer's hot listing holds a malformed chain: {str(chain)[:200]}")
        picked.append(hashes)
    return {"source": source, "chains": picked} if picked else None
