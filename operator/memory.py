"""What the operator remembers of a pool: between scaling ticks in its process (`PoolMemory`), and across
restarts in the pool's status (its conditions, the replicas last decided per role).

Kopf-free: the cluster operator (operator/handlers.py) keeps one `PoolMemory` per pool in kopf's memo, and the
local operator inside `kvmesh up -f` (operator/local.py) keeps one for its pool.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.operator import desired
from kvmesh.operator.crd import Pool
from kvmesh.operator.forecast import PodMetrics, Scaler
from kvmesh.operator.scaling import SCALED_ROLES


def now_timestamp() -> str:
    """Now, as Kubernetes writes times in status (RFC 3339, UTC, seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_condition(conditions: list[dict[str, Any]] | None, kind: str, status: bool, reason: str, message: str,
                   generation: int) -> list[dict[str, Any]]:
    """`conditions` with one set; its transition time moves only when its status changes."""
    old = {c["type"]: c for c in conditions or []}
    value = "True" if status else "False"
    previous = old.get(kind)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else now_timestamp()
    old[kind] = {"type": kind, "status": value, "reason": reason, "message": message[:1024],
                 "lastTransitionTime": since, "observedGeneration": generation}
    return [old[k] for k in sorted(old)]


def decided_replicas(pool: Pool, status: Mapping[str, Any], added: Collection[str] = ()) -> dict[str, int]:
    """The replicas last decided for the pool's roles that status keeps a count of (within each role's bounds).
    Not for a role in `added`, one the change being applied adds back to the pool: a count status still holds for
    it was decided before it was removed (the operator writes null for the roles a pool does not run, but a status
    written before that, or by an operator before this one, may keep one), not for the pods it runs now."""
    decided = status.get("replicas") or {}
    out: dict[str, int] = {}
    for role in pool.roles:
        entry = decided.get(role) if isinstance(decided, Mapping) else None
        count = entry.get("desired") if isinstance(entry, Mapping) else None
        # not a bool (an int to Python: `max(True, 1)` is True, rendered as `replicas: true`), written by hand
        if role not in added and isinstance(count, int) and not isinstance(count, bool):
            low, high = pool.bounds(role)
            out[role] = min(max(count, low), high)
    return out


def current_replicas(pool: Pool, status: Mapping[str, Any], added: Collection[str] = ()) -> dict[str, int]:
    """The replicas last decided per role (kept in status: `decided_replicas`), else each role's minimum."""
    return desired.initial_replicas(pool) | decided_replicas(pool, status, added)


def status_replicas(pool: Pool, counts: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """status.replicas as a merge patch: `counts` per role of the pool, and null for every other engine role, so a
    role a change of mode removed leaves status (kopf merge-patches status: a key left out would stay)."""
    return {role: None for role in SCALED_ROLES if role not in pool.roles} | {r: dict(counts[r]) for r in pool.roles}


@dataclass(frozen=True)
class RouterView:
    """What scale to zero reads besides the engines, from the pool's router pods (or `kvmesh up`'s router): the
    requests they hold for want of a serving engine (kvmesh_router_requests_waiting_for_pods, summed), and whether
    a Ready router or a serving engine did not answer its scrape this tick, which leaves the pool's idleness
    unknown."""

    held: int = 0
    unseen: bool = False


@dataclass
class IdleClock:
    """How long the pool has had no request, for scale to zero: any request running or waiting in an engine, held
    by a router, or begun or ended between two ticks (an engine's counters moved) restarts it. An engine seen for
    the first time says nothing either way (its counters have no earlier value); the clock starts at the first
    tick, so a restarted operator waits a whole idle time before it stops a pool."""

    since: float | None = None  # the last tick that saw a request
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)  # pod -> (finished, prompt tokens)

    def update(self, now: float, metrics: list[PodMetrics], routers: RouterView = RouterView()) -> float:
        """The seconds idle as of `now`. `routers.unseen`: a ready engine or a router did not answer its scrape this
        tick, which says nothing of idleness, so it counts as busy (a pool the operator cannot see for the idle
        time, behind a new NetworkPolicy or under a load that times its /metrics out, must not be stopped)."""
        seen = {m.observation.name: (m.counters.finished, m.counters.prompt_tokens) for m in metrics}
        busy = (routers.unseen or routers.held > 0
                or any(m.observation.running or m.observation.waiting for m in metrics)
                or any(name in self.counters and self.counters[name] != counters for name, counters in seen.items()))
        self.counters = seen
        if self.since is None or busy:
            self.since = now
        return now - self.since


@dataclass
class PoolMemory:
    """What the scaler remembers of one pool between ticks."""

    scaler: Scaler | None = None
    last_evaluated: float = -1e18
    hits: dict[str, tuple[float, float]] = field(default_factory=dict)  # pod -> (time, cached tokens counter)
    serving: frozenset[str] | None = None  # engine pods that served at the last tick; None before the first
    # The one view of the pool's conditions that both handlers update and write whole: a merge patch replaces
    # the list, so two handlers writing their own stale copies would undo each other's conditions.
    conditions: list[dict[str, Any]] | None = None
    idle: IdleClock = field(default_factory=IdleClock)  # scale to zero's

    def condition(self, status: Mapping[str, Any], kind: str, value: bool, reason: str, message: str,
                  generation: int) -> list[dict[str, Any]]:
        if self.conditions is None:  # a restarted operator: carry on from what the pool shows
            self.conditions = list(status.get("conditions") or [])
        self.conditions = with_condition(self.conditions, kind, value, reason, message, generation)
        return self.conditions

    def scaler_for(self, pool: Pool) -> Scaler:
        """The pool's scaler; under an edited spec, a new one that keeps what the last learnt (the traffic estimate,
        the recent recommendations): an edit of the bounds or the policy must not blind it or restart its
        stabilization window."""
        if self.scaler is None:
            self.scaler = Scaler(pool)
        elif self.scaler.pool != pool:
            self.scaler = Scaler(pool, self.scaler.traffic, self.scaler.history)
        return self.scaler


def pod_hit_rates(state: PoolMemory, now: float, metrics: list[PodMetrics]) -> dict[str, float]:
    """Cached prompt tokens per second each pod served since the last tick: how much its cache is worth now."""
    rates: dict[str, float] = {}
    seen: dict[str, tuple[float, float]] = {}
    for m in metrics:
        name, hits = m.observation.name, m.counters.cached_tokens
        seen[name] = (now, hits)
        if name in state.hits and now > state.hits[name][0] and hits >= state.hits[name][1]:
            rates[name] = (hits - state.hits[name][1]) / (now - state.hits[name][0])
    state.hits = seen
    return rates
