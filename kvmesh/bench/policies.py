"""Routing policies for the cluster simulator: the baselines gateways use, an oracle, and kvmesh's router.

kvmesh's policy is the router's own code path: pod snapshots, the prefix index fed by the instances' KV
events, `picker.pick` with a `PickerConfig`, a provisional index entry for the decision, and `pull.plan_pull`.
Changing a weight in the config changes what it does, exactly as in `kvmesh router`. RouterPolicy knows every
instance's state exactly, as one router whose scrapes and counters miss nothing would; RouterReplicasPolicy runs
the same path as several replicas, each with only what it scraped, what it sent itself and its own provisional
entries, as replicas behind a Service run.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace

from kvmesh.bench.sim import Choice, Cluster, Instance, SimRequest
from kvmesh.router.config import RouterConfig
from kvmesh.router.index import PrefixIndex
from kvmesh.router.picker import Decision, PickerConfig, PodState, RequestInfo, pick
from kvmesh.router.pods import Unseen
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
        """One router that knows each instance's state exactly (the study's kvmesh row)."""
        return self.route(request, [c.pod_state() for c in candidates], cluster.index, cluster)[0]

    def route(self, request: SimRequest, states: list[PodState], index: PrefixIndex,
              cluster: Cluster) -> tuple[Choice, Decision]:
        """The router's path over one router's view: its pod snapshots `states` and its prefix `index`, which
        gets the decision's provisional entries."""
        latency = cluster.spec.latency
        hashed = self.router.max_hashed_tokens // cluster.spec.block_size
        info = RequestInfo("", request.prompt_tokens, request.block_hashes[:hashed])
        matches = index.match(info.block_hashes, [s.name for s in states], cluster.now)
        decision = pick(info, states, matches, self.picker, tuple(sorted({s.role for s in states})))
        assert decision.pod is not None, "the simulator offers only ready instances"
        chosen = cluster.instances[decision.pod.name]
        index.add_provisional(chosen.name, info.block_hashes, cluster.now, self.router.provisional_ttl_seconds)
        if not self.pulls:
            return Choice(chosen), decision
        policy = PullPolicy(latency.transfer_bytes_per_second, latency.transfer_setup_seconds)
        plan = plan_pull(decision.pod, info, states, matches, latency.kv_bytes_per_token * cluster.spec.block_size,
                         self.picker, policy)
        return Choice(chosen, None if plan is None else (plan.source.name, plan.tokens)), decision


@dataclass
class PodView:
    """One instance as one router replica knows it (router/pods.py's Pod): the numbers of its last scrape, and
    the replica's own requests there: those in flight, and of them what that scrape could not count yet."""

    scraped: PodState
    unseen: Unseen = field(default_factory=Unseen)
    inflight: int = 0

    def state(self) -> PodState:
        """The snapshot the picker reads, as router/pods.py's PodSet.snapshot makes it."""
        return replace(self.scraped, inflight=self.inflight, unseen_requests=self.unseen.requests,
                       unseen_prefill_tokens=self.unseen.tokens, ended_requests=self.unseen.ended_requests)


class RouterReplica:
    """One replica of the router. It reads every instance's KV events as they are published (its own stream of
    each pod: the index's confirmed blocks are every replica's), but its provisional entries are its own
    decisions only; it scrapes each instance every `scrape_interval` seconds (each at a seeded phase), and between
    scrapes counts only the requests it sent itself. So a burst dealt to several replicas is seen whole by none."""

    def __init__(self, cluster: Cluster, index: PrefixIndex, scrape_interval: float, phases: random.Random) -> None:
        self.cluster, self.index, self.scrape_interval = cluster, index, scrape_interval
        self._phases = phases
        self.pods: dict[str, PodView] = {}
        self._booked: dict[str, list[tuple[PodView, int, int]]] = {}  # rid -> (pod, scrape epoch, uncached tokens)

    def view(self, instance: Instance) -> PodView:
        """The replica's view of `instance`; scraped at once when first seen (its scrape loop starts then), then
        every scrape interval from a seeded phase within the first."""
        known = self.pods.get(instance.name)
        if known is not None:
            return known
        view = self.pods[instance.name] = PodView(instance.pod_state())
        self.cluster.at(self.cluster.now + self._phases.uniform(0, self.scrape_interval),
                        lambda: self._scrape_loop(instance))
        return view

    def _scrape_loop(self, instance: Instance) -> None:
        if instance.name not in self.cluster.instances:  # gone: discovery removed it
            del self.pods[instance.name]
            return
        self.scrape(instance)
        self.cluster.at(self.cluster.now + self.scrape_interval, lambda: self._scrape_loop(instance))

    def scrape(self, instance: Instance) -> None:
        """Read the instance's /metrics (instantly): what this replica sent before, the numbers now hold."""
        view = self.pods[instance.name]
        epoch = view.unseen.reading()
        view.scraped = instance.pod_state()
        view.unseen.read(epoch)

    def choose(self, request: SimRequest, candidates: list[Instance], router: RouterPolicy) -> Choice:
        views = [self.view(c) for c in candidates]
        choice, decision = router.route(request, [v.state() for v in views], self.index, self.cluster)
        uncached = max(0, request.prompt_tokens - decision.predicted_cached_tokens)  # as router/app.py books it
        view = self.pods[choice.instance.name]
        view.inflight += 1
        self._booked.setdefault(request.rid, []).append((view, view.unseen.sent(uncached), uncached))
        return choice

    def finished(self, request: SimRequest) -> None:
        """The request's answer ended: its bookings close (router/app.py's Booking.close)."""
        for view, epoch, uncached in self._booked.pop(request.rid, ()):
            view.inflight -= 1
            view.unseen.ended(epoch, uncached)


@dataclass
class RouterReplicasPolicy:
    """kvmesh's router run as `replicas` independent replicas (RouterReplica) behind a Service that deals each
    request to one at random (seeded); a request's later hops (a decode pod) are chosen by the replica that took
    it, and its bookings close when it finishes. One replica here differs from RouterPolicy only in reading
    scraped numbers instead of exact ones, so comparing replica counts within this policy isolates the replicas'
    blindness to each other's decisions."""

    replicas: int = 1
    seed: int = 0
    router_policy: RouterPolicy = field(default_factory=RouterPolicy)
    name: str = ""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.name = self.name or f"kvmesh, {self.replicas} router replica{'s' if self.replicas > 1 else ''}"
        self._dealer = random.Random(self.seed)
        self._phases = random.Random(f"scrape phases {self.seed}")
        self.router_replicas: list[RouterReplica] = []
        self.taken_by: dict[str, RouterReplica] = {}  # rid -> the replica it was dealt, until it finishes

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice:
        if not self.router_replicas:  # the first request: the replicas start with the cluster's first events
            self._start(cluster, candidates)
        replica = self.taken_by.get(request.rid)
        if replica is None:
            replica = self.taken_by[request.rid] = self._dealer.choice(self.router_replicas)
        return replica.choose(request, candidates, self.router_policy)

    def _start(self, cluster: Cluster, candidates: list[Instance]) -> None:
        """Every replica scrapes the instances now, before the first request: a replica is not first dealt a
        request of a burst after its peers have sent theirs, and so sees a fresher state than they did."""
        interval = self.router_policy.router.scrape_interval_seconds
        indexes = [cluster.index, *(cluster.add_router_index() for _ in range(self.replicas - 1))]
        self.router_replicas = [RouterReplica(cluster, index, interval, self._phases) for index in indexes]
        for replica in self.router_replicas:
            for instance in candidates:
                replica.view(instance)
        cluster.finish_listeners.append(self._finished)

    def _finished(self, request: SimRequest) -> None:
        replica = self.taken_by.pop(request.rid, None)
        if replica is not None:
            replica.finished(request)
