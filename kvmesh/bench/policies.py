"""Routing policies for the cluster simulator: the baselines gateways use, an oracle, and kvmesh's router.

kvmesh's policy is the router's own code path: pod snapshots, the prefix index fed by the instances' KV
events, `picker.pick` with a `PickerConfig`, a provisional index entry for the decision, and `pull.plan_pull`.
Changing a weight in the config changes what it does, exactly as in `kvmesh router`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from kvmesh.bench.sim import Choice, Cluster, Instance, SimRequest
from kvmesh.router.config import RouterConfig
from kvmesh.router.picker import PickerConfig, RequestInfo, pick
from kvmesh.router.pull import PullPolicy, plan_pull


@dataclass
class RandomPolicy:
    seed: int = 0
    name: str = "random"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        return Choice(self._rng.choice(candidates))


@dataclass
class RoundRobinPolicy:
    name: str = "round-robin"
    _turn: itertools.count = field(default_factory=itertools.count)

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        return Choice(candidates[next(self._turn) % len(candidates)])


@dataclass
class LeastRequestPolicy:
    """Fewest outstanding requests, ties broken at random (Envoy's and the gateways' load balancing)."""

    seed: int = 0
    name: str = "least-request"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        fewest = min(c.outstanding for c in candidates)
        return Choice(self._rng.choice([c for c in candidates if c.outstanding == fewest]))


@dataclass
class OraclePolicy:
    """Knows each instance's exact queued work and sends the request where its prefill starts soonest, blind to
    what each instance caches of this request: the best a cache-blind router can do."""

    seed: int = 0
    name: str = "oracle (queued work)"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        work = {c.name: c.queued_work_seconds() for c in candidates}
        least = min(work.values())
        return Choice(self._rng.choice([c for c in candidates if work[c.name] <= least + 1e-9]))


@dataclass
class RouterPolicy:
    """The router's pipeline over the simulated instances, with the router's settings for what the picker does
    not own: how many leading tokens it hashes, how long it trusts its own decisions, and pulls (priced at the
    simulated link's speed, as an operator sets `pull_bytes_per_second` to its network)."""

    picker: PickerConfig = field(default_factory=PickerConfig)
    name: str = "kvmesh"
    pulls: bool = True
    router: RouterConfig = field(default_factory=RouterConfig)

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        latency = cluster.spec.latency
        hashed = self.router.max_hashed_tokens // cluster.spec.block_size
        info = RequestInfo("", request.prompt_tokens, request.block_hashes[:hashed])
        states = [c.pod_state() for c in candidates]
        matches = cluster.index.match(info.block_hashes, [s.name for s in states], cluster.now)
        decision = pick(info, states, matches, self.picker, tuple(sorted({c.role for c in candidates})))
        assert decision.pod is not None, "the simulator offers only ready instances"
        chosen = cluster.instances[decision.pod.name]
        cluster.index.add_provisional(chosen.name, info.block_hashes, cluster.now, self.router.provisional_ttl_seconds)
        if not self.pulls:
            return Choice(chosen)
        policy = PullPolicy(latency.transfer_bytes_per_second, latency.transfer_setup_seconds)
        plan = plan_pull(decision.pod, info, states, matches, latency.kv_bytes_per_token * cluster.spec.block_size,
                         self.picker, policy)
        return Choice(chosen, None if plan is None else (plan.source.name, plan.tokens))


