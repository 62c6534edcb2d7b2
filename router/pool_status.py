"""The pool as one router replica sees it: a row a pod with its state, load, KV use and forecast, and the blocks of
its cache the router's prefix index holds by tier. Served as JSON at `GET /kvmesh/pool` and printed by `kvmesh
status`: the picture the picker decides on, for an operator asking why a request went where it went.

Pure: it reads the pod set's records, their snapshots and the index, and returns plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.engine.protocol import HEALTH_LOADING, HEALTH_WARMING, TIERS
from kvmesh.router.index import PrefixIndex
from kvmesh.router.picker import PodState
from kvmesh.router.pods import Pod

POOL_STATUS_PATH = "/kvmesh/pool"
# the 403 of a key whose tenant may not read it (Router.reads_pool_status), saying what the operator sets
POOL_STATUS_REFUSED_CODE = "pool_status_not_allowed"
POOL_STATUS_REFUSED = ("the pool's status shows every engine's load, so the other tenants' traffic: this API key's "
                       "tenant may not read it; an operator's tenant needs `read_pool_status: true` in the router's "
                       "`tenants` config")


def pod_state(pod: Pod) -> str:
    """One word for a pod (engine/protocol.POD_STATES, the router's pods gauge's states): refused (its configuration
    does not match the router's), draining, warming (up, waiting for its warm-up), loading (starting: its model
    loads), else healthy or unhealthy."""
    if pod.refused:
        return "refused"
    if pod.draining:
        return "draining"
    if pod.warming:
        return HEALTH_WARMING
    if pod.loading:
        return HEALTH_LOADING
    return "healthy" if pod.healthy else "unhealthy"


def pool_status(pods: Mapping[str, Pod], states: Sequence[PodState], index: PrefixIndex, now: float
                ) -> dict[str, Any]:
    """The status document: `pods` (one row each, in the pod set's order) and `index` (distinct blocks held by any
    pod). `now` is the clock the pods' scrape times are on (monotonic); a pod never scraped has no age."""
    snapshots = {s.name: s for s in states}
    rows = []
    for name, pod in pods.items():
        s = snapshots[name]
        published = pod.metrics.get("events_seq")
        rows.append({
            "name": name,
            "state": pod_state(pod),
            "load_progress": pod.load_progress,  # while loading: the share of its weights read
            "reason": pod.refused,
            "role": s.role,
            "model": s.model,
            "adapters": sorted(s.models - {s.model}),
            "stale": s.stale,
            "metrics_age_seconds": round(now - pod.scraped_at, 3) if pod.scraped_at else None,
            "running": s.running,
            "waiting": s.waiting,
            "inflight": s.inflight,
            "kv_usage": s.kv_usage,
            "forecast_usage_p90": s.forecast_usage_p90,
            "overload_probability": s.overload_probability,
            "num_blocks": s.num_blocks,
            "block_size": s.block_size,
            "indexed_blocks": index.held_blocks(name),
            "event_lag_batches": None if published is None else max(int(published) - index.resume_point(name)[1], 0),
        })
    return {"pods": rows, "index": {"blocks": index.size(), "tiers": list(TIERS)}}
