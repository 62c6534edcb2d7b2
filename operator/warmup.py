"""Warming new engine pods from a peer's hottest prefixes (issue 5): which pods, from whom, with what.

A pod is new when it serves (answers its /metrics) now and did not at the last scaling tick: a scale-up's
pods, or a replaced one. Each is asked to pull, over contract 4, the hottest cached prefix chains of a serving
pod of its role, so the prefixes the pool reuses most are a local hit from its first requests instead of one
full prefill per prefix. With the engines' warm-up gate on, a new pod answers /metrics but not yet /health
(so it is in no Service and no router's set) until its warm-up ends; a new pod with nothing to copy is told so
at once, so a pool's first pods are not held for the whole grace. Pure: the operator's handler and
`kvmesh up -f` (operator/local.py) do the HTTP; both plan a tick's warm-ups with `plan_tick_warmups`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.protocol import DEFAULT_KV_CACHE_DTYPE
from kvmesh.operator.crd import Pool
from kvmesh.operator.desired import warmup_grace_seconds
from kvmesh.operator.forecast import PodMetrics
from kvmesh.operator.memory import PoolMemory


@dataclass(frozen=True)
class ServingPod:
    name: str
    role: str
    url: str  # http://ip:port of its engine
    hit_rate: float = 0.0  # cached prompt tokens per second it served lately: how warm its cache is
    ready: bool = True  # its Kubernetes Ready condition: False while loading, warming up or draining
    kv_format: str = DEFAULT_KV_CACHE_DTYPE  # its KV cache's format: blocks copy only between equal formats
    weights: str = ""  # the weights its KV is computed with: an engine refuses blocks of other weights

    @property
    def stores_like(self) -> tuple[str, str, str]:
        """Pods whose blocks can warm each other: one role, one KV format, one set of weights."""
        return self.role, self.kv_format, self.weights


@dataclass(frozen=True)
class Warmup:
    """Warm `targets` from `source`'s hottest chains (all of one role)."""

    role: str
    source: ServingPod
    targets: tuple[ServingPod, ...]


@dataclass(frozen=True)
class WarmupPlan:
    """One tick's warm-ups, and the new pods whose warm-up gate opens at once (nothing to copy into them)."""

    warmups: tuple[Warmup, ...] = ()
    open_now: tuple[ServingPod, ...] = ()


def plan_warmups(known: frozenset[str] | None, serving: Sequence[ServingPod], limit: int,
                 gated: bool = False) -> WarmupPlan:
    """Per role, KV format and weights (`ServingPod.stores_like`: during a rollout of new weights or a new format,
    old pods' blocks are no use to new ones), the new pods in `serving` (those not in `known`, the pods that
    served at the last tick), warmed from the old pod alike whose cache serves the most hits (ties: the first
    name). On the operator's first tick (`known` None) only the pods not Ready yet are new: a restarted operator
    must not re-warm a whole pool, yet must not leave a pod that was warming up to its grace. With the engines'
    gate on (`gated`), new pods with nothing to copy (no old pod alike: a pool's first pods, or the first pods of a
    rolling change of kvCacheDtype or of the model's weights; or `limit` 0, warm-up off) are opened at once."""
    warmups: list[Warmup] = []
    open_now: list[ServingPod] = []
    for kind in sorted({p.stores_like for p in serving}):
        role = kind[0]
        pods = sorted((p for p in serving if p.stores_like == kind), key=lambda p: p.name)
        new = tuple(p for p in pods if (not p.ready if known is None else p.name not in known))
        old = [p for p in pods if p not in new]
        if new and old and limit > 0:
            source = max(old, key=lambda p: p.hit_rate)  # max keeps the first of equals: the first name
            warmups.append(Warmup(role, source, new))
        elif new and gated:
            open_now.extend(new)
    return WarmupPlan(tuple(warmups), tuple(open_now))


@dataclass(frozen=True)
class WarmupSettings:
    """A pool's warm-up settings: how many hot chains a new pod copies (`scaling.warmupPrefixes`; 0: warm-up off),
    and whether new engines wait for their warm-up behind the gate (a grace is set while warm-up is on)."""

    limit: int
    gated: bool

    @classmethod
    def of(cls, pool: Pool) -> WarmupSettings:
        return cls(pool.spec["scaling"]["warmupPrefixes"], warmup_grace_seconds(pool) > 0)


@dataclass(frozen=True)
class PodPlace:
    """Where a scraped pod serves and whether it is Ready (its /health answers 200), as its caller knows it."""

    url: str
    ready: bool


def plan_tick_warmups(memory: PoolMemory, scraped: Sequence[PodMetrics], places: Mapping[str, PodPlace],
                      hit_rates: Mapping[str, float], settings: WarmupSettings) -> WarmupPlan:
    """One scaling tick's warm-ups, for the cluster operator and `kvmesh up -f` alike: the pods scraped this tick
    (those with a place) with their hit rates and KV formats, planned against the pods that served at the last
    tick (`memory.serving`), which then remembers these. The caller carries the plan out (`carry_out`)."""
    serving = [ServingPod(name, m.observation.role, places[name].url, hit_rates.get(name, 0.0), places[name].ready,
                          m.kv_format, m.weights)
               for m in scraped if (name := m.observation.name) in places]
    plan = plan_warmups(memory.serving, serving, settings.limit, settings.gated)
    memory.serving = frozenset(p.name for p in serving)
    return plan


class WarmupUnanswered(Exception):
    """The target took the warm request but did not answer in time: it is still copying, and opens its own gate
    when the copy ends (or its grace does)."""


def left_closed(plan: Warmup, answers: Mapping[str, object]) -> tuple[ServingPod, ...]:
    """The targets whose gate a warm-up left closed: the peer had nothing to copy (None), or it failed before
    or while asking them (an error). An engine opens its gate itself when a warm request ends, however it went,
    so neither a target that answered nor one still copying (WarmupUnanswered) is among them."""
    return tuple(t for t in plan.targets
                 if not isinstance(answers.get(t.name), Mapping | WarmupUnanswered))


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


@dataclass(frozen=True)
class WarmupOutcome:
    """What one target's warm-up came to, in words: `ok` True (warmed), False (failed) or None (nothing to copy,
    or still copying)."""

    ok: bool | None
    message: str


def warmup_outcome(source: str, target: str, answer: Mapping[str, Any] | Exception | None) -> WarmupOutcome:
    """Describe `target`'s /v1/kv/warm answer (None: the peer listed nothing reused; an Exception: the call
    failed), for the operator's Events and logs and `kvmesh up`'s output alike."""
    if answer is None:
        return WarmupOutcome(None, f"{source} has no reused prefixes to warm {target} with")
    if isinstance(answer, WarmupUnanswered):
        return WarmupOutcome(None, f"warming {target} from {source}: {answer}; its gate opens when the copy ends")
    if isinstance(answer, Exception) or answer.get("failed"):
        why = answer if isinstance(answer, Exception) else "; ".join(answer.get("errors") or [])
        return WarmupOutcome(False, f"warming {target} from {source} failed: {why}")
    return WarmupOutcome(True, f"warmed {target} from {source}: {answer.get('blocks_pulled', 0)} blocks pulled, "
                               f"{answer.get('blocks_present', 0)} already held")


# a warm-up and its chain limit -> per target pod, its /v1/kv/warm answer, None (nothing to pull) or the error
Warmer = Callable[[Warmup, int], dict[str, dict[str, Any] | Exception | None]]
# pods to tell "nothing to copy, serve now" -> per pod, None or the error
GateOpener = Callable[[Sequence[ServingPod]], dict[str, Exception | None]]


@dataclass(frozen=True)
class WarmupResults:
    """A tick's warm-ups carried out: per target, what its warm-up came to; per pod told to serve now, how that
    went (ok None: it serves now; False: the call failed, and its grace opens it in the end)."""

    warmed: list[tuple[Warmup, str, WarmupOutcome]]
    opened: list[tuple[str, WarmupOutcome]]


def carry_out(plan: WarmupPlan, limit: int, gated: bool, warm: Warmer, open_gates: GateOpener) -> WarmupResults:
    """Warm each target of `plan` from its source, then, with the engines' gate on, tell the pods left with nothing
    copied (the plan's first pods, and targets a warm-up never reached) to serve now. The cluster operator and
    `kvmesh up` both call this with their HTTP calls; neither raises for a pod that fails: it serves anyway."""
    warmed: list[tuple[Warmup, str, WarmupOutcome]] = []
    opening = list(plan.open_now)
    for warmup in plan.warmups:
        answers = warm(warmup, limit)
        warmed += [(warmup, target, warmup_outcome(warmup.source.name, target, answer))
                   for target, answer in answers.items()]
        if gated:
            opening.extend(left_closed(warmup, answers))
    opened = [(name, WarmupOutcome(None, f"{name} has nothing to copy: it serves now") if error is None
               else WarmupOutcome(False, f"could not open {name}'s warm-up gate: {error}"))
              for name, error in (open_gates(opening) if opening else {}).items()]
    return WarmupResults(warmed, opened)
