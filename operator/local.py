"""The operator's decisions on one machine: `kvmesh up -f pool.yaml` reads the pool through operator/crd.py (the
same defaults and checks as the cluster), writes the same engine and router settings, and runs the operator's
scaling tick over its local engines: the same scaler, the same warm-ups of new engines from the peer whose cache
serves the most hits, the same LoRA adapter sync (operator/lora.py), the same scale to zero (an idle clock, and the
requests its router holds, which wake a pool at zero: `RouterView`), and the same /metrics registry. `kvmesh up`
carries the decisions out, so scaling works without Kubernetes. It follows edits of the pool file as the operator
follows the CRD (`follow`): replica bounds, the scaler's settings and adapters change under running engines; an
edit of what the engines or the router read at start (`needs_restart`, from `start_inputs`: which file each field
feeds) is applied as the cluster's rollout applies it, by replacing the processes (`restarts` says how: the
engines one at a time, then the router), except what every process must share (the model, the mode, the pool's
name, the KV hashing), which only a new `kvmesh up` can change; the cluster's own fields are ignored.

Locally the engines listen on 127.0.0.1 at ports `kvmesh up` picks, and the router follows them in a pods file
that `kvmesh up` rewrites; everything else in the two files is what the operator's ConfigMap holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from kvmesh.operator.crd import Pool
from kvmesh.operator.desired import API_KEYS_DIR, engine_adapters, engine_settings, router_settings
from kvmesh.operator.engines import http_open_gates, http_warm
from kvmesh.operator.forecast import parse_pod
from kvmesh.operator.lora import AdapterMemory, AdapterTick, EnginePod, Life, adapter_tick, http_act, http_served
from kvmesh.operator.memory import PoolMemory, RouterView, pod_hit_rates
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.operator.scale_in import deletion_costs
from kvmesh.operator.scaling import Decision
from kvmesh.operator.warmup import (
    GateOpener,
    PodPlace,
    Warmer,
    WarmupPlan,
    WarmupSettings,
    carry_out,
    plan_tick_warmups,
)

__all__ = ["LocalOperator", "LocalPod", "Restarts", "describe", "ignored_locally",
           "local_engine_settings", "local_router_settings", "needs_restart", "restarts", "start_inputs"]

# Settings the cluster's files carry that a local pool sets otherwise (addresses, discovery).
CLUSTER_ONLY_ENGINE = ("host", "port")
CLUSTER_ONLY_ROUTER = ("host", "port", "discovery", "namespace", "ext_proc_port", "ext_proc_tls",
                       "ext_proc_cert_dir")  # no Gateway locally


def local_engine_settings(pool: Pool) -> dict[str, Any]:
    return {k: v for k, v in engine_settings(pool).items() if k not in CLUSTER_ONLY_ENGINE}


def local_router_settings(pool: Pool) -> dict[str, Any]:
    """The router's settings less those of the cluster; the keys file where `router.apiKeys` mounts it (a Secret)
    exists only in a pod, so locally auth takes `router.settings.api_keys_file`, a file of this machine."""
    settings = {k: v for k, v in router_settings(pool).items() if k not in CLUSTER_ONLY_ROUTER}
    if str(settings.get("api_keys_file", "")).startswith(f"{API_KEYS_DIR}/"):
        del settings["api_keys_file"]
    return settings


def start_inputs(pool: Pool) -> dict[str, Any]:
    """What `kvmesh up` writes and starts a pool's processes with, the one list of which file each spec field
    feeds (`kvmesh/up.py` writes them from these same functions), keyed by where it goes:
    - `engine.yaml KEY` and `engine-scaled.yaml KEY` (the initial engines, those the scaler adds): the engine
      settings (`local_engine_settings`: spec.engine, spec.model, scaling.horizonSeconds ...) less `lora_modules`,
      which the adapter sync changes under running engines and `kvmesh up` rewrites in both files;
    - `engine-scaled.yaml warmup_grace_seconds`: the warm-up gate of added engines (scaling.warmupPrefixes,
      scaling.warmupGraceSeconds);
    - `router.yaml KEY`: the router settings (`local_router_settings`: spec.router, scaling.slo ...) and the
      pool's name;
    - `engines`: the model the engines load and the roles they start with (spec.model.source, spec.mode).
    Running processes read none of them again, so an edit changing one needs a restart (`needs_restart`: of the
    processes they feed, `restarts`). The rest of the spec is live (replica bounds, the scaler's own policy in
    spec.scaling, model.loraAdapters) or means nothing locally (`ignored_locally`)."""
    from kvmesh.operator.desired import LORA_MODULES, warmup_grace_seconds

    engine = {k: v for k, v in local_engine_settings(pool).items() if k != LORA_MODULES}
    return {**{f"engine.yaml {k}": v for k, v in engine.items()},
            "engine-scaled.yaml warmup_grace_seconds": warmup_grace_seconds(pool),
            **{f"router.yaml {k}": v for k, v in local_router_settings(pool).items()},
            "router.yaml pool": pool.name,
            "engines model": pool.spec["model"]["source"],
            "engines roles": (pool.mode, pool.roles)}


def needs_restart(old: Pool, new: Pool) -> list[str]:
    """What an edit from `old` to `new` changes in the files and flags the pool's processes started with
    (`start_inputs` keys, sorted): running processes cannot take it on, new ones must (`restarts`). Empty when
    the running processes can follow the edit as they are."""
    before, after = start_inputs(old), start_inputs(new)
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# What no process of a running pool can change alone, so no rollout applies it: the model (the router tokenizes for
# it, the engines load it: a pool half rolled would answer one name with two models), the roles the engines start
# with, the pool's name (every process's metrics and the work folder carry it), and the KV hashing (a router
# refuses engines that hash otherwise than it does, so a rolled engine would never be routed to).
FIXED_INPUTS = ("engines model", "engine.yaml model", "router.yaml model", "engines roles", "router.yaml pool",
                "engine.yaml block_size", "engine.yaml hash_algo", "router.yaml block_size", "router.yaml hash_algo")


@dataclass(frozen=True)
class Restarts:
    """How a running local pool takes on an edit of what its processes started with (`needs_restart`'s keys,
    each in one group): as the cluster's rollout of a new ConfigMap, by replacing processes, not by telling them."""

    engines: tuple[str, ...]  # `engine.yaml` keys: every engine is replaced, one at a time, by one started anew
    gate: tuple[str, ...]  # `engine-scaled.yaml` keys: the warm-up gate matters only to engines started from now on
    router: tuple[str, ...]  # `router.yaml` keys: the router restarts on its port (after the engines' roll)
    refused: tuple[str, ...]  # FIXED_INPUTS: only a new `kvmesh up` applies them

    @property
    def rolls(self) -> bool:
        return bool(self.engines or self.router)


def restarts(old: Pool, new: Pool) -> Restarts:
    """Sort what an edit from `old` to `new` changes of the processes' start (`needs_restart`) by how it applies."""
    changed = needs_restart(old, new)
    refused = tuple(k for k in changed if k in FIXED_INPUTS)
    rest = [k for k in changed if k not in FIXED_INPUTS]
    engines = tuple(k for k in rest if k.startswith("engine.yaml "))
    gate = tuple(k for k in rest if k.startswith("engine-scaled.yaml "))
    router = tuple(k for k in rest if k.startswith("router.yaml "))
    assert len(engines) + len(gate) + len(router) == len(rest), rest  # every start input has its way to apply
    return Restarts(engines, gate, router, refused)


# The spec fields a running local pool takes on: the scaler's bounds and policy, and the adapters.
LIVE_FIELDS = ("replicas", "scaling", "model.loraAdapters")


def ignored_locally(old: Pool, new: Pool) -> list[str]:
    """The spec fields (dotted, sorted) an edit changed that are neither live (LIVE_FIELDS) nor feed what the
    pool's processes start with (changed alone, the field changes no `start_inputs`): a cluster's only
    (engine.resources, engine.image, router.replicas, ...), which change nothing locally."""
    def flat(pool: Pool) -> dict[str, Any]:
        fields = {}
        for key, value in pool.spec.items():
            if isinstance(value, Mapping):
                fields.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                fields[key] = value
        return {k: v for k, v in fields.items() if k not in LIVE_FIELDS and k.split(".")[0] not in LIVE_FIELDS}

    before, after = flat(old), flat(new)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return [k for k in changed if not needs_restart(old, _with_field(old, new, k))]


def _with_field(old: Pool, new: Pool, dotted: str) -> Pool:
    """`old` with one field (`key` or `key.sub`) as `new` has it, or without it where `new` has none."""
    spec = {k: dict(v) if isinstance(v, Mapping) else v for k, v in old.spec.items()}
    key, _, sub = dotted.partition(".")
    where, source = (spec, new.spec) if not sub else (spec.setdefault(key, {}), new.spec.get(key) or {})
    name = sub or key
    if name in source:
        where[name] = source[name]
    else:
        where.pop(name, None)
    return replace(old, spec=spec)


def describe(decision: Decision, replicas: Mapping[str, int]) -> list[str]:
    """One line per role whose replicas the decision changes."""
    return [decision.describe(role, replicas) for role in decision.changed(replicas)]


# The local adapter sync's budget per tick (the cluster's is ADAPTER_BUDGET_SECONDS): `kvmesh up` runs it on its
# supervision thread, which also notices a child's death, publishes engines that came up and stops drained ones,
# so a hanging load holds those up for at most this (plus the sync's BUDGET_GRACE_SECONDS). A small budget rather
# than a thread of its own: the memory, the pool and the metrics stay single-threaded, and a stop never waits for
# a hanging call. It costs nothing locally: a load not answered in time goes on in the engine, and the next tick
# sees it in /v1/models (the engines and their adapter files are on this machine).
LOCAL_ADAPTER_BUDGET_SECONDS = 1.0


@dataclass(frozen=True)
class LocalPod:
    """A local engine that answered its /metrics this tick (the cluster's pod with an address that answered)."""

    name: str
    role: str
    url: str
    metrics: str  # its /metrics text
    ready: bool  # its /health answered 200 (the pod's Ready condition): False while its warm-up gate holds it


@dataclass(frozen=True)
class Tick:
    decision: Decision
    warmups: WarmupPlan  # the engines that began serving since the last tick: whom to warm from whom, whom to open
    deletion_costs: Mapping[str, int]  # per engine scraped, the operator's pod-deletion cost: the cheapest drains first


class LocalOperator:
    """The operator's scaling tick for one local pool, less the Kubernetes calls: `tick` decides (`decide` observes
    and plans) and has `kvmesh up` carry it out: scale, `record` the outcome under the operator's own metric names
    and labels, and warm (`warm_up`). Its calls to the engines carry the pool's internal token, `auth` (`kvmesh up`'s
    `InternalToken` over the token file of its work folder); `warm` and `open_gates` (tests) replace those calls."""

    def __init__(self, pool: Pool, warm: Warmer | None = None, open_gates: GateOpener | None = None,
                 auth: httpx.Auth | None = None) -> None:
        self.pool = pool
        self.auth = auth
        self.metrics = OperatorMetrics()
        self.memory = PoolMemory()  # what the timer keeps between ticks: the scaler, hits, serving pods
        self.warmup = WarmupSettings.of(pool)
        self.adapters = AdapterMemory()  # in memory only: a restarted `kvmesh up` starts new engines too
        self._warm = warm or functools.partial(http_warm, auth=auth)
        self._open_gates = open_gates or functools.partial(http_open_gates, auth=auth)

    def follow(self, pool: Pool) -> None:
        """Carry on under an edited spec (one `restarts` refuses nothing of): the scaler keeps what it learnt of the
        traffic (`PoolMemory.scaler_for`), as the cluster operator's timer keeps it when a spec changes."""
        assert not restarts(self.pool, pool).refused, restarts(self.pool, pool)
        self.pool = pool
        self.warmup = WarmupSettings.of(pool)

    @property
    def gated(self) -> bool:
        """Engines the scaler adds wait for their warm-up."""
        return self.warmup.gated

    def tick(self, now: float, pods: list[LocalPod], replicas: Mapping[str, int],
             carry_out: Callable[[Tick], None], router: RouterView | None = None,
             unanswered: Mapping[str, int] | None = None) -> Tick:
        """One scaling evaluation of the pool: `decide`, then `carry_out` the tick (`kvmesh up` starts and drains
        engines, records, warms), counted in the operator's heartbeat as the cluster's timer counts a tick, which
        also applies what it decided: an error if either part raises (the exception goes on)."""
        with self.metrics.evaluation(self.pool):
            tick = self.decide(now, pods, replicas, router, unanswered)
            carry_out(tick)
            return tick

    def decide(self, now: float, pods: list[LocalPod], replicas: Mapping[str, int],
               router: RouterView | None = None, unanswered: Mapping[str, int] | None = None) -> Tick:
        """Observe the engines (and, for a pool that scales to zero, its router: `router`) and plan: the replicas
        per role, the warm-ups, the cost of deleting each engine. The idle clock runs as the cluster operator's
        does: a request held, running, waiting or counted since the last tick restarts it, and so does a tick at
        which the router or a serving engine did not answer (`RouterView.unseen`). `unanswered`: per role, serving
        engines whose /metrics did not answer this tick: their role is not scaled down, as in the cluster."""
        scraped = [parse_pod(p.name, p.role, p.metrics) for p in pods]
        view = router or RouterView()
        idle = self.memory.idle.update(now, scraped, view)
        decision = self.memory.scaler_for(self.pool).observe(now, scraped, replicas, view.held, idle, unanswered)
        hit_rates = pod_hit_rates(self.memory, now, scraped)
        places = {p.name: PodPlace(p.url, p.ready) for p in pods}
        warmups = plan_tick_warmups(self.memory, scraped, places, hit_rates, self.warmup)
        costs = {name: cost for role in self.pool.roles
                 for name, cost in deletion_costs(role, scraped, hit_rates).items()}
        return Tick(decision, warmups, costs)

    def warm_new(self, now: float, pods: list[LocalPod]) -> list[str]:
        """Warm, between two ticks, the engines that began serving since the last one, and open their gates, as the
        tick would (the same plan and memory, so the tick does not warm them again): an engine rolled in for an
        old one is warmed as soon as it answers, and a roll of N engines waits for no N ticks. The hit rates read
        here start the next tick's window, as a tick's own would."""
        scraped = [parse_pod(p.name, p.role, p.metrics) for p in pods]
        places = {p.name: PodPlace(p.url, p.ready) for p in pods}
        plan = plan_tick_warmups(self.memory, scraped, places, pod_hit_rates(self.memory, now, scraped), self.warmup)
        return self.warm_up(plan)

    def warm_up(self, plan: WarmupPlan) -> list[str]:
        """Carry out a tick's warm-ups with the operator's HTTP calls, and open the gates of new engines left with
        nothing copied; one line per engine saying what it got. A failure is reported, never raised: the engine
        serves anyway (its grace opens its gate at the latest), computing those prefixes itself."""
        results = carry_out(plan, self.warmup.limit, self.warmup.gated, self._warm, self._open_gates)
        return [o.message for _, _, o in results.warmed] + [o.message for _, o in results.opened]

    def sync_adapters(self, serving: list[EnginePod], alive: Collection[Life]) -> AdapterTick:
        """Keep the `serving` engines' LoRA adapters equal to the spec's, as the cluster operator's tick does
        (operator/lora.py `adapter_tick`, with a budget of its own per tick: LOCAL_ADAPTER_BUDGET_SECONDS), and
        count the actions in the operator's metrics."""
        tick = adapter_tick(engine_adapters(self.pool), serving, self.adapters, alive,
                            budget=LOCAL_ADAPTER_BUDGET_SECONDS, read=functools.partial(http_served, auth=self.auth),
                            act=functools.partial(http_act, auth=self.auth))
        self.metrics.record_adapters(self.pool, tick.syncs)
        return tick

    def record(self, decision: Decision, replicas: Mapping[str, int], before: Mapping[str, int]) -> None:
        """The replicas carried out (`before` them: what the decision saw), as the operator's timer records them."""
        self.metrics.record(self.pool, decision, replicas, before)

