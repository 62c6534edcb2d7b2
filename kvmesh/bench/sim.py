"""The cluster simulator: every routing, deployment and autoscaling study replays traces through this one core.

Event-driven and in process, deterministic for a seed. Simulated instances keep their caches in the engine's
own KV manager (accounting only, any block size) and publish its KV events into the router's own prefix index,
as pods do in production; a routing policy (kvmesh's is the router's real picker, see policies.py) chooses the
instance. Time comes from a latency model: prefill at a fixed token rate, decode steps whose time grows with
the batch, KV moved between instances at a link's bandwidth.

An instance runs one operation at a time: the prefill of the request at the head of its queue (prefill goes
first, as in vLLM without chunked prefill, so a long prompt stalls the decodes beside it), else decode steps
of its whole batch until the next request finishes or a new one arrives. Roles follow the pods': `both`
serves whole requests, `prefill` hands the KV to a `decode` instance (or, with no decode pool, ends the request
at its first token: the routing study simulates Mooncake's prefill pool only). Instances can be added (ready
after a start-up delay) and drained while the trace runs, down to none; a scaling policy is asked on a period. While
no instance is ready the router holds requests, as the real one does for a pool starting from zero, and sends
them on when one is (past its hold or its cap of held requests, a request fails: the router's 503).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, block_token_ids
from kvmesh.engine.forecast import Forecast, OutputLengthModel, RequestLoad, forecast_usage
from kvmesh.engine.kv.blocks import KVCacheManager, SequenceBlocks
from kvmesh.engine.protocol import DEFAULT_HASH_ROOT, DecodeStepCost, KVEvent, KVEventBatch, hash_block, workload_class
from kvmesh.engine.step_cost import DecodeStepFit
from kvmesh.router.index import PrefixIndex
from kvmesh.router.picker import PodState

ROLES = ("both", "prefill", "decode")
MAX_TOKENS = 4096  # what the simulated clients ask for: the engine's forecast caps outputs by it, not by the trace


@dataclass(frozen=True)
class LatencyModel:
    """How long an instance takes. The defaults describe a 70B-class model on one 8-GPU node (Mooncake's
    setting): 320 KiB of KV per token (80 layers, 8 KV heads of 128, fp16), RDMA between nodes."""

    prefill_tokens_per_second: float = 8000.0
    decode_step_seconds: float = 0.03  # one decode step of a batch of one
    decode_step_per_sequence_seconds: float = 0.0003  # each further sequence in the batch
    kv_bytes_per_token: int = 320 * 1024
    transfer_bytes_per_second: float = 25e9
    transfer_setup_seconds: float = 0.002

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_second

    def step_seconds(self, batch: int) -> float:
        return self.decode_step_seconds + self.decode_step_per_sequence_seconds * max(batch - 1, 0)

    def transfer_seconds(self, tokens: int) -> float:
        return self.transfer_setup_seconds + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_second


@dataclass(frozen=True)
class ClusterSpec:
    """The instances at the start, by role, and what each is."""

    pools: dict[str, int]  # role -> instances
    cache_tokens: int = 3_000_000  # device KV per instance
    block_size: int = MOONCAKE_BLOCK_TOKENS
    latency: LatencyModel = LatencyModel()
    startup_seconds: float = 60.0  # an added instance serves after this long (simulated seconds, whatever the speed-up)
    # The router's hold while no instance is ready (hold_without_pods_seconds, max_held_requests): past either, the
    # request fails (the router's 503). The defaults hold until one is ready, however long, as a pool never at 0 needs.
    hold_seconds: float = math.inf
    max_held: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.pools) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; known: {', '.join(ROLES)}")
        if not any(self.pools.get(r, 0) for r in ("both", "prefill")):
            raise ValueError("the cluster needs at least one instance that prefills (role both or prefill)")
        if self.cache_tokens < self.block_size:
            raise ValueError("an instance's cache must hold at least one block")
        if not self.hold_seconds > 0 or (self.max_held is not None and self.max_held < 1):
            raise ValueError("the router's hold must be positive and hold at least one request")

    @property
    def num_blocks(self) -> int:
        return self.cache_tokens // self.block_size


@dataclass(frozen=True)
class SLO:
    """A request meets its SLO when its TTFT and its mean inter-token latency are both within these."""

    ttft_seconds: float = 10.0
    itl_seconds: float = 0.1


# ---- requests ------------------------------------------------------------------------------------------------


class SyntheticPrompt(Sequence[int]):
    """A prompt's token ids (traces.block_token_ids per block id), produced only when read: the KV manager reads
    its length and takes slices, and reads tokens only to hash blocks whose hashes it does not have yet."""

    def __init__(self, hash_ids: Sequence[int], length: int, block_size: int, start: int = 0) -> None:
        self._ids, self._len, self._bs, self._start = hash_ids, length, block_size, start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step == 1:  # a view, not a copy: slicing a prompt costs nothing
                return SyntheticPrompt(self._ids, max(stop - start, 0), self._bs, self._start + start)
            return [self[i] for i in range(start, stop, step)]
        if not -self._len <= index < self._len:
            raise IndexError(index)
        position = self._start + index % self._len
        return self._ids[position // self._bs] * self._bs + position % self._bs


@dataclass(eq=False)
class SimRequest:
    """One request of a replay, and what happened to it."""

    rid: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per block of the prompt (the trace's, or fresh ones: nothing shared)
    block_hashes: tuple[int, ...]  # the engine's chained hashes of the full blocks (contract 1)
    # filled in by the simulation
    prefill_instance: str = ""
    decode_instance: str = ""
    pull: tuple[str, int] | None = None  # (peer, tokens) the router asked the instance to fetch first
    expected_uncached: int = 0  # what the instance expected to compute when the request arrived there
    cached_tokens: int = -1  # at the first prefill: device hits plus pulled tokens (contract 0); -1 = not yet
    pulled_tokens: int = 0
    generated: int = 0
    prefilled: bool = False  # its prompt's KV exists (a decode instance only admits it)
    first_token_at: float = math.nan
    last_token_at: float = math.nan
    finished_at: float = math.nan
    held_seconds: float = 0.0  # in the router while no instance was ready (part of its TTFT)
    failed_at: float = math.nan  # answered 503 by the router: held past its hold, or past its cap of held requests

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival

    @property
    def mean_itl(self) -> float:
        """Mean seconds between output tokens after the first (0 for a one-token answer)."""
        return (self.finished_at - self.first_token_at) / (self.generated - 1) if self.generated > 1 else 0.0

    def tokens(self, block_size: int) -> SyntheticPrompt:
        return SyntheticPrompt(self.hash_ids, self.prompt_tokens, block_size)


def build_requests(trace: Sequence[TraceRequest], block_size: int = MOONCAKE_BLOCK_TOKENS) -> list[SimRequest]:
    """Simulated requests for a trace, with the engine's block hashes computed once per distinct block id.

    The Mooncake ids are chained (loader-checked), so the hash of a block follows from its id and its
    predecessor's hash; this equals protocol.block_hashes over the prompt's synthetic tokens (tested). A
    request without ids (the Azure trace) shares nothing: fresh ids, and stand-ins for hashes, since hashing
    tokens no other request has would only cost time."""
    if block_size != MOONCAKE_BLOCK_TOKENS and any(r.hash_ids for r in trace):
        raise ValueError(f"the trace's hash ids name {MOONCAKE_BLOCK_TOKENS}-token blocks, not {block_size}")
    memo: dict[int, int] = {}
    fresh = itertools.count(max((max(r.hash_ids) for r in trace if r.hash_ids), default=-1) + 1)
    requests = []
    for i, r in enumerate(sorted(trace, key=lambda t: t.arrival)):
        if not r.hash_ids:  # shares nothing: unique stand-ins serve as hashes (no content to agree on)
            ids = tuple(next(fresh) for _ in range(-(-r.input_tokens // block_size)))
            stand_ins = tuple(1 << 63 | h for h in ids[: r.input_tokens // block_size])
            requests.append(SimRequest(f"r{i}", r.arrival, r.input_tokens, max(r.output_tokens, 1), ids, stand_ins))
            continue
        ids = r.hash_ids
        hashes = []
        parent = DEFAULT_HASH_ROOT
        for h in ids[: r.input_tokens // block_size]:
            if h not in memo:
                memo[h] = hash_block(parent, block_token_ids(h, block_size))
            parent = memo[h]
            hashes.append(parent)
        requests.append(SimRequest(f"r{i}", r.arrival, r.input_tokens, max(r.output_tokens, 1), ids, tuple(hashes)))
    return requests


# ---- instances -----------------------------------------------------------------------------------------------


class Instance:
    """One simulated engine: a queue, a decode batch, the engine's KV manager, and its KV event stream."""

    def __init__(self, name: str, role: str, cluster: Cluster, ready_at: float) -> None:
        spec = cluster.spec
        self.name, self.role, self.cluster = name, role, cluster
        self.latency = spec.latency
        self.block_size = spec.block_size
        self._events: list[KVEvent] = []
        self.kv = KVCacheManager(spec.num_blocks, spec.block_size, on_event=self._events.append)
        self.seq = 0
        self.queue: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.prefilling: SimRequest | None = None
        self.ready_at = ready_at
        self.draining = False
        self.busy_seconds = 0.0
        self.op_start = self.op_end = 0.0
        self._step = 0.0  # seconds per step of the current decode run; 0 = not decoding
        self._planned_steps = 0
        self.finished = self.finished_prompt_tokens = 0  # the engine's request and prompt-token counters
        self.lengths = OutputLengthModel()  # what the engine learns of output lengths, for its forecast
        self.step_cost = DecodeStepFit()  # what the engine learns of its decode step's cost (engine/step_cost.py)
        self._version = 0  # bumps when the planned end of the current operation changes

    # ---- what the router and the scaler see -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.cluster.now >= self.ready_at

    @property
    def outstanding(self) -> int:
        return len(self.queue) + len(self.running) + (self.prefilling is not None)

    def _pending_prefill(self, request: SimRequest) -> int:
        """As the engine counts it: a queued request's uncached part (estimated on arrival), the unfinished part
        of the prefill in flight, nothing for a decoding one."""
        if request is self.prefilling:
            return max(0, int((self.op_end - self.cluster.now) * self.latency.prefill_tokens_per_second))
        return 0 if request.prefilled or request in self.running else request.expected_uncached

    def pending_prefill_tokens(self) -> int:
        """The engine's gauge: uncached prompt tokens waiting or in flight."""
        queued = sum(r.expected_uncached for r in self.queue if not r.prefilled)
        return queued + (self._pending_prefill(self.prefilling) if self.prefilling else 0)

    def queued_work_seconds(self) -> float:
        """Exactly how long until this instance could start a new prefill: the operation in flight and every
        queued prefill, at the uncached sizes they will compute (the oracle's knowledge)."""
        queued = sum(self.latency.prefill_seconds(r.expected_uncached) for r in self.queue if not r.prefilled)
        return max(self.op_end - self.cluster.now, 0.0) + queued

    def forecast(self, horizon_seconds: float) -> Forecast:
        """The engine's own KV forecast (engine/forecast.py) over this instance's requests, as it exports it."""
        loads = [RequestLoad(r.prompt_tokens + r.generated, r.generated, MAX_TOKENS,
                             workload_class("chat", r.prompt_tokens), min(self._pending_prefill(r), r.prompt_tokens))
                 for r in (*self.running, *([self.prefilling] if self.prefilling else []), *self.queue)]
        return forecast_usage(loads, self.kv.pool.num_blocks, self.block_size, horizon_seconds,
                              self.latency.step_seconds(max(len(self.running), 1)),
                              self.latency.prefill_tokens_per_second, self.lengths)

    def pod_state(self) -> PodState:
        """This instance as the router's pod snapshot. `inflight` is what one router has sent and not seen
        finish, which with one router is everything outstanding (as in production, where both are counted)."""
        stats = self.kv.stats()
        return PodState(
            name=self.name, url=self.name, role=self.role, healthy=self.ready, draining=self.draining,
            running=len(self.running) + (self.prefilling is not None), waiting=len(self.queue),
            inflight=self.outstanding, kv_usage=stats.usage, pending_prefill_tokens=self.pending_prefill_tokens(),
            prefill_tokens_per_second=self.latency.prefill_tokens_per_second,
            decode_step_seconds=self.latency.step_seconds(max(len(self.running), 1)),
            num_blocks=stats.total, block_size=self.block_size,
        )

    def cached_prefix_tokens(self, request: SimRequest) -> int:
        """Prompt tokens this instance would not compute now (its own device hits)."""
        self._know(request)
        return self.kv.find_prefix(request.rid, request.tokens(self.block_size)).num_tokens

    # ---- the simulation drives these -------------------------------------------------------------------------

    def enqueue(self, request: SimRequest) -> None:
        if not request.prefilled:
            request.expected_uncached = request.prompt_tokens - self.cached_prefix_tokens(request)
        self.queue.append(request)
        if self._step:  # decoding: stop after the step in flight, so the newcomer waits at most one step
            now = self.cluster.now
            steps = min(math.ceil((now - self.op_start) / self._step - 1e-9), self._planned_steps)
            self._plan(self.op_start + steps * self._step, lambda: self._end_decode(steps))
        elif self.prefilling is None:
            self._next()

    def _know(self, request: SimRequest) -> None:
        """Give the KV manager the request's block hashes, computed once per trace (build_requests), so that it
        does not hash the same blocks again for every instance and every policy."""
        if request.rid not in self.kv.seqs:
            self.kv.seqs[request.rid] = SequenceBlocks(hashes=list(request.block_hashes))

    def _plan(self, end: float, then: Callable[[], None]) -> None:
        self._version += 1
        self.op_end = end
        version = self._version
        self.cluster.at(end, lambda: version == self._version and then())

    def _next(self) -> None:
        """Start the next operation: admit decode newcomers, else prefill the queue's head, else decode."""
        while self.queue and self.queue[0].prefilled:
            if not self._admit_decode(self.queue[0]):
                break
            self.queue.popleft()
        if self.queue and not self.queue[0].prefilled and self._start_prefill(self.queue[0]):
            self.queue.popleft()
        elif self.running:
            self._start_decode()
        elif self.draining and not self.queue:
            self.cluster.remove(self)

    def _admit_decode(self, request: SimRequest) -> bool:
        """A handed-off request joins the batch when its blocks fit (what the instance lacked was pulled)."""
        self._know(request)
        tokens = request.tokens(self.block_size)
        hit = self.kv.find_prefix(request.rid, tokens)
        if not self.kv.allocate(request.rid, request.prompt_tokens + request.generated, hit):
            return False
        self.kv.commit(request.rid, tokens, request.prompt_tokens)
        self._publish()
        self.running.append(request)
        return True

    def _start_prefill(self, request: SimRequest) -> bool:
        self._know(request)
        tokens = request.tokens(self.block_size)
        pulled, pull_seconds = self._pull(request, tokens)
        hit = self.kv.find_prefix(request.rid, tokens)
        context = request.prompt_tokens + request.generated  # a preempted request recomputes what it generated
        admitted = self.kv.allocate(request.rid, context, hit)
        self.kv.free(f"pull:{request.rid}")  # the request holds the pulled blocks now (or they stay cached)
        if not admitted:
            self._publish()
            return False
        if request.cached_tokens < 0:
            request.cached_tokens = hit.num_tokens
            request.pulled_tokens = min(pulled, hit.num_tokens)
            request.prefill_instance = self.name
        self.prefilling = request
        seconds = pull_seconds + self.latency.prefill_seconds(context - hit.num_tokens)
        self.op_start = self.cluster.now
        self._plan(self.cluster.now + seconds, self._end_prefill)
        self._publish()
        return True

    def _pull(self, request: SimRequest, tokens: SyntheticPrompt) -> tuple[int, float]:
        """Fetch the blocks the router said a peer holds beyond this instance's own prefix (Mooncake's pull,
        as the engine does it: keep the local prefix, import the rest under a key, register it). The peer
        may have evicted some since the router looked: only what it still holds, in order, comes."""
        if request.pull is None or request.cached_tokens >= 0:
            return 0, 0.0
        peer = self.cluster.instances.get(request.pull[0])
        if peer is None:
            return 0, 0.0
        want = request.pull[1] // self.block_size
        key = f"pull:{request.rid}"
        have = len(self.kv.pin_cached(key, request.block_hashes[:want]))
        extra = []
        for h in request.block_hashes[have:want]:
            if peer.kv.pool.lookup(h) is None:
                break
            extra.append(h)
        if not extra:
            return 0, 0.0
        ids = self.kv.allocate_unregistered(key, len(extra))
        if ids is None:
            return 0, 0.0
        self.kv.register_filled(ids, extra, request.block_hashes[have - 1] if have else None)
        tokens_moved = len(extra) * self.block_size
        return tokens_moved, self.latency.transfer_seconds(tokens_moved)

    def _end_prefill(self) -> None:
        request, self.prefilling = self.prefilling, None
        assert request is not None
        now = self.cluster.now
        self.busy_seconds += now - self.op_start
        self.kv.commit(request.rid, request.tokens(self.block_size), request.prompt_tokens)
        self._publish()
        if not request.generated:  # the first token comes with the prefill
            request.generated = 1
            request.first_token_at = request.last_token_at = now
        if request.generated >= request.output_tokens:
            self.finish(request)
        elif self.role == "prefill":
            self.cluster.hand_off(request, self)
        else:  # both, or a decode instance recomputing a preempted request
            self.running.append(request)
        self._next()

    def _start_decode(self) -> None:
        self._step = self.latency.step_seconds(len(self.running))
        self._planned_steps = min(r.output_tokens - r.generated for r in self.running)
        self.op_start = self.cluster.now
        steps = self._planned_steps
        self._plan(self.op_start + steps * self._step, lambda: self._end_decode(steps))

    def _end_decode(self, steps: int) -> None:
        now, step = self.cluster.now, self._step
        self._step = 0.0
        self.busy_seconds += now - self.op_start
        if steps:  # one sample a run of equal steps: its batch and the KV its middle step attends to
            self.step_cost.add(len(self.running), sum(r.prompt_tokens + r.generated + (steps + 1) // 2
                                                      for r in self.running), step)
            for r in self.running:
                self.cluster.record_gaps(self.op_start + step - r.last_token_at, 1, step, steps - 1)
                r.generated += steps
                r.last_token_at = now
            for r in list(self.running):
                if r.generated >= r.output_tokens:
                    self.running.remove(r)
                    self.finish(r)
            self._grow()
        self._next()

    def _grow(self) -> None:
        """Extend each running request's blocks to its tokens; when the pool runs out, preempt the newest
        (recompute, as vLLM does): it goes back to the head of the queue."""
        for r in list(self.running):
            while r in self.running and not self.kv.allocate(r.rid, r.prompt_tokens + r.generated):
                victim = self.running.pop()
                self.kv.free(victim.rid)
                victim.prefilled = False
                self.queue.appendleft(victim)
                self.cluster.preemptions += 1
        self._publish()

    def finish(self, request: SimRequest) -> None:
        self.kv.free(request.rid)
        self._publish()
        self.lengths.observe(workload_class("chat", request.prompt_tokens), request.generated)
        self.finished += 1
        self.finished_prompt_tokens += request.prompt_tokens
        self.cluster.on_finish(request)

    def hand_over(self, key: str) -> None:
        """A handed-off request's KV (held under `key`) has reached its decode instance: let this copy go,
        which may let a request waiting for blocks in."""
        self.kv.free(key)
        self._publish()
        if self.prefilling is None and not self._step:
            self._next()

    def _publish(self) -> None:
        """Deliver this instance's new KV events to the router's index as the next batch of its stream."""
        if self._events and self.name not in self.cluster.instances:  # gone: the router forgot it
            self._events.clear()
        if self._events:
            self.seq += 1
            batch = KVEventBatch(self.name, self.seq, tuple(self._events))
            self._events.clear()
            for index in self.cluster.router_indexes:  # every router replica reads every pod's stream
                applied = index.apply(self.name, batch)
                assert applied, f"{self.name}: the index refused batch {batch.seq}"


# ---- routing and scaling interfaces --------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    instance: Instance
    pull: tuple[str, int] | None = None  # (peer, prefix tokens to fetch from it)


class RoutingPolicy(Protocol):
    """Chooses an instance among `candidates` (ready, not draining, of the roles the step needs)."""

    name: str

    def choose(self, request: SimRequest, candidates: list[Instance], cluster: Cluster) -> Choice: ...


@dataclass(frozen=True)
class InstanceObservation:
    """One instance as its /metrics shows it; the forecast only when the policy asks for one."""

    name: str
    role: str
    ready: bool
    num_blocks: int
    kv_usage: float
    waiting: int
    running: int
    pending_prefill_tokens: int
    prefill_tokens_per_second: float
    decode_step_seconds: float
    forecast: Forecast | None = None
    decode_step_cost: DecodeStepCost | None = None  # the engine's fit (kvmesh_decode_step_*_seconds)
    finished: int = 0  # the engine's counters since it started: requests finished, and their prompt tokens
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Counters:
    """What the engines' counters grew by over the period (requests finished, their seconds and tokens)."""

    finished: int = 0
    finished_seconds: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Observation:
    """What a scaling policy sees each period: every instance, the arrivals since the last period (requests sent to
    an instance, as the engines count them: a held one arrives when the router releases it), the engines' counters
    over it, and the requests the router holds now."""

    now: float
    period_seconds: float
    instances: tuple[InstanceObservation, ...]
    arrivals: int
    arrival_prompt_tokens: int
    counters: Counters
    held: int = 0  # requests the router holds now for want of a ready instance (its waiting_for_pods gauge)

    @property
    def replicas(self) -> int:
        """Instances that exist (ready or starting), which is what the policy sets."""
        return len(self.instances)

    def mean_ready_usage(self) -> float:
        ready = [i.kv_usage for i in self.instances if i.ready]
        return sum(ready) / len(ready) if ready else 0.0


class ScalingPolicy(Protocol):
    """Asked every `period_seconds`; answers how many instances of the scaled role there should be. With a
    forecast horizon, each instance's observation carries the engine's forecast over it."""

    name: str
    period_seconds: float
    forecast_horizon_seconds: float | None

    def desired(self, observation: Observation) -> int: ...


# ---- the cluster ---------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    """Everything a study reports, measured over one replay."""

    policy: str
    requests: list[SimRequest]
    busy_seconds: dict[str, float]  # per instance that ever existed
    gaps: np.ndarray  # inter-token gaps (seconds), one row per run of equal gaps: (gap, count)
    replica_seconds: float
    duration: float  # first arrival to last finish
    preemptions: int
    replicas_over_time: list[tuple[float, int]] = field(default_factory=list)
    failed: list[SimRequest] = field(default_factory=list)  # answered 503 by the router; not in `requests`

    def held(self) -> list[SimRequest]:
        """The requests the router held (served or failed), by arrival."""
        return sorted((r for r in (*self.requests, *self.failed) if r.held_seconds > 0), key=lambda r: r.arrival)

    def ttfts(self) -> np.ndarray:
        return np.array([r.ttft for r in self.requests])

    @property
    def hit_ratio(self) -> float:
        return sum(r.cached_tokens for r in self.requests) / max(sum(r.prompt_tokens for r in self.requests), 1)

    @property
    def pulled_ratio(self) -> float:
        return sum(r.pulled_tokens for r in self.requests) / max(sum(r.prompt_tokens for r in self.requests), 1)

    @property
    def mean_ttft(self) -> float:
        return float(self.ttfts().mean())

    @property
    def p99_ttft(self) -> float:
        return float(np.percentile(self.ttfts(), 99))

    @property
    def imbalance(self) -> float:
        """Max over mean busy time of the instances (1.0: perfectly even)."""
        busy = list(self.busy_seconds.values())
        return max(busy) / (sum(busy) / len(busy)) if busy and sum(busy) else 1.0

    def itl_quantile(self, q: float) -> float:
        """The q-quantile of all inter-token gaps, every output token after the first counted once."""
        if not len(self.gaps):
            return 0.0
        order = np.argsort(self.gaps[:, 0], kind="stable")
        values, weights = self.gaps[order, 0], np.cumsum(self.gaps[order, 1])
        return float(values[np.searchsorted(weights, q * weights[-1])])

    def violations(self, slo: SLO) -> int:
        return sum(r.ttft > slo.ttft_seconds or r.mean_itl > slo.itl_seconds for r in self.requests)

    def goodput(self, slo: SLO) -> float:
        """Requests per second that met the SLO (DistServe's goodput)."""
        return (len(self.requests) - self.violations(slo)) / self.duration if self.duration else 0.0


class Cluster:
    """The clock, the event queue, the instances and the router's prefix index."""

    def __init__(self, spec: ClusterSpec, policy: RoutingPolicy, scaler: ScalingPolicy | None = None,
                 scaled_role: str | None = None) -> None:
        self.spec, self.policy, self.scaler = spec, policy, scaler
        self.scaled_role = scaled_role or ("both" if spec.pools.get("both") else "prefill")
        self.now = 0.0
        self.index = PrefixIndex()
        # the indexes of the router replicas, `index` first: each is fed every instance's event batches as they are
        # published, since every replica subscribes to every pod's stream (add_router_index adds one)
        self.router_indexes: list[PrefixIndex] = [self.index]
        # called with each request as it finishes: what a router replica's counters of its own requests learn
        self.finish_listeners: list[Callable[[SimRequest], None]] = []
        self.instances: dict[str, Instance] = {}
        self.busy: dict[str, float] = {}
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._tick = itertools.count()
        self._names = itertools.count()
        self._gaps: list[tuple[float, int]] = []
        self.finished: list[SimRequest] = []
        self.failed: list[SimRequest] = []
        self.held: list[SimRequest] = []  # by arrival; each has its hold's start in `_held_since`
        self._held_since: dict[str, float] = {}
        self.preemptions = 0
        self.replica_seconds = 0.0
        self._last_count_at = 0.0
        self.replicas_over_time: list[tuple[float, int]] = []
        self._arrivals = self._arrival_tokens = 0
        self._observed_finished = 0
        for role in ROLES:
            for _ in range(spec.pools.get(role, 0)):
                self.add(role, ready_at=0.0)

    # ---- events ----------------------------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._heap, (when, next(self._tick), fn))

    def run(self, requests: Sequence[SimRequest], progress: Callable[[int], None] | None = None,
            until: float = 0.0) -> SimResult:
        """Replay `requests` (sorted by arrival) to the last finish, and at least to `until` (pools compared over one
        window pay their instances for all of it, a pool whose own traffic ends early too)."""
        decodes = any(self.spec.pools.get(role) for role in ("both", "decode"))
        for r in requests:  # a request that cannot fit alone would wait forever
            tokens = r.prompt_tokens + (r.output_tokens if decodes else 0)
            if -(-tokens // self.spec.block_size) > self.spec.num_blocks:
                raise ValueError(f"request {r.rid} needs {tokens} tokens of KV; an instance holds "
                                 f"{self.spec.num_blocks * self.spec.block_size}")
        arrivals: Iterator[SimRequest] = iter(requests)
        start = requests[0].arrival if requests else 0.0

        def arrive(request: SimRequest) -> None:
            self.route(request)
            if progress is not None:
                progress(1)
            following = next(arrivals, None)
            if following is not None:
                self.at(following.arrival, lambda: arrive(following))

        first = next(arrivals, None)
        if first is not None:
            self.at(first.arrival, lambda: arrive(first))
        if self.scaler is not None:
            self.at(start + self.scaler.period_seconds, self._scale)
        remaining = len(requests)
        while self._heap and (len(self.finished) + len(self.failed) < remaining or self._heap[0][0] <= until):
            when, _, fn = heapq.heappop(self._heap)
            self._count_replicas(when)
            self.now = when
            fn()
        if len(self.finished) + len(self.failed) < remaining:
            raise AssertionError(f"{remaining - len(self.finished) - len(self.failed)} requests never finished "
                                 "(a stuck instance)")
        for inst in self.instances.values():
            self.busy[inst.name] = inst.busy_seconds
        end = max((r.finished_at for r in self.finished), default=start)
        end = max([end, *(r.failed_at for r in self.failed)])
        name = self.scaler.name if self.scaler is not None else self.policy.name
        return SimResult(name, sorted(self.finished, key=lambda r: r.arrival), dict(self.busy),
                         np.array(self._gaps, dtype=float).reshape(-1, 2), self.replica_seconds, end - start,
                         self.preemptions, self.replicas_over_time, self.failed)

    def _count_replicas(self, until: float) -> None:
        self.replica_seconds += (until - self._last_count_at) * sum(
            i.role == self.scaled_role for i in self.instances.values())
        self._last_count_at = until

    # ---- routing ---------------------------------------------------------------------------------------------

    def candidates(self, roles: tuple[str, ...]) -> list[Instance]:
        return [i for i in self.instances.values() if i.role in roles and i.ready and not i.draining]

    def route(self, request: SimRequest) -> None:
        roles = ("both", "prefill")
        candidates = self.candidates(roles)
        if not candidates:  # starting, or at zero: the router holds it (router/app.py's PodWait)
            self.hold(request)
            return
        self._arrivals += 1  # as the engines' counters see it: a held request arrives when it is released
        self._arrival_tokens += request.prompt_tokens
        choice = self.policy.choose(request, candidates, self)
        request.pull = choice.pull
        choice.instance.enqueue(request)

    def hold(self, request: SimRequest) -> None:
        """Hold `request` until an instance is ready (`release`), for at most the spec's hold; past the hold, or
        with the cap of held requests reached, it fails as the router's 503."""
        cap = self.spec.max_held
        if cap is not None and len(self.held) >= cap:
            self.fail(request)
            return
        self.held.append(request)
        self._held_since[request.rid] = self.now
        if math.isfinite(self.spec.hold_seconds):
            self.at(self.now + self.spec.hold_seconds, lambda: self._hold_expired(request))

    def _hold_expired(self, request: SimRequest) -> None:
        if request.rid in self._held_since:
            self.held.remove(request)
            request.held_seconds += self.now - self._held_since.pop(request.rid)
            self.fail(request)

    def release(self) -> None:
        """An instance became ready: every held request goes on, in arrival order, routed as usual."""
        if not self.held or not self.candidates(("both", "prefill")):
            return
        released, self.held = self.held, []
        for request in released:
            request.held_seconds += self.now - self._held_since.pop(request.rid)
            self.route(request)

    def fail(self, request: SimRequest) -> None:
        request.failed_at = self.now
        self.failed.append(request)

    def hand_off(self, request: SimRequest, source: Instance) -> None:
        """A prefilled request moves to a decode instance (DistServe, Mooncake): the policy chooses it, its KV
        travels (what the decode instance lacks, at the link's speed), then it joins that batch. With no decode
        pool the prefill instance's first token ends it."""
        candidates = self.candidates(("decode",))
        if not candidates:
            source.finish(request)  # the decode pool is not simulated
            return
        target = self.policy.choose(request, candidates, self).instance
        request.decode_instance = target.name
        request.prefilled = True
        lacking = request.prompt_tokens - target.cached_prefix_tokens(request)
        source.kv.rename(request.rid, f"handoff:{request.rid}")

        def arrived() -> None:
            source.hand_over(f"handoff:{request.rid}")
            target.enqueue(request)

        self.at(self.now + self.spec.latency.transfer_seconds(lacking), arrived)

    def record_gaps(self, first_gap: float, first_count: int, gap: float, count: int) -> None:
        self._gaps.append((first_gap, first_count))
        if count:
            self._gaps.append((gap, count))

    def on_finish(self, request: SimRequest) -> None:
        request.finished_at = self.now
        self.finished.append(request)
        for listener in self.finish_listeners:
            listener(request)

    def add_router_index(self) -> PrefixIndex:
        """Another router replica's prefix index, fed from now on every batch the instances publish (each replica
        subscribes to every pod's event stream). Made before the first request, so it misses no event."""
        if any(i.seq for i in self.instances.values()):
            raise RuntimeError("a router index added after the instances published events would miss them")
        index = PrefixIndex()
        self.router_indexes.append(index)
        return index

    # ---- instances coming and going --------------------------------------------------------------------------

    def scaled(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == self.scaled_role and not i.draining]

    def add(self, role: str, ready_at: float | None = None) -> Instance:
        name = f"{role}-{next(self._names)}"
        ready = self.now + self.spec.startup_seconds if ready_at is None else ready_at
        inst = self.instances[name] = Instance(name, role, self, ready)
        # routing reads `ready`; the router's held requests go on then (at once for a cold start of 0: a request
        # held while no instance was ready must not wait for its hold to expire)
        self.at(max(ready, self.now), self.release)
        return inst

    def drain(self, inst: Instance) -> None:
        """Stop routing to `inst`; it leaves once its work is done (at once if it has none)."""
        inst.draining = True
        if inst.outstanding == 0:
            self.remove(inst)

    def remove(self, inst: Instance) -> None:
        if inst.name in self.instances:
            self.busy[inst.name] = inst.busy_seconds
            del self.instances[inst.name]
            for index in self.router_indexes:
                index.remove_pod(inst.name)

    def observe(self) -> Observation:
        """The scaled role's instances (starting ones too, as not ready) and the traffic since the last call."""
        period = self.scaler.period_seconds if self.scaler else 0.0
        horizon = self.scaler.forecast_horizon_seconds if self.scaler else None
        observed = tuple(
            InstanceObservation(
                i.name, i.role, i.ready, i.kv.pool.num_blocks, i.kv.stats().usage, len(i.queue),
                len(i.running) + (i.prefilling is not None), i.pending_prefill_tokens(),
                i.latency.prefill_tokens_per_second, i.latency.step_seconds(max(len(i.running), 1)),
                i.forecast(horizon) if horizon and i.ready else None, i.step_cost.cost(), i.finished,
                i.finished_prompt_tokens)
            for i in self.scaled()
        )
        done = self.finished[self._observed_finished:]
        self._observed_finished = len(self.finished)
        counters = Counters(len(done), sum(r.finished_at - r.arrival - r.held_seconds for r in done),  # the engines'
                            sum(r.prompt_tokens for r in done), sum(r.generated for r in done),
                            sum(r.cached_tokens for r in done))
        obs = Observation(self.now, period, observed, self._arrivals, self._arrival_tokens, counters, len(self.held))
        self._arrivals = self._arrival_tokens = 0
        return obs

    def _scale(self) -> None:
        assert self.scaler is not None
        desired = max(0, self.scaler.desired(self.observe()))  # 0: a pool scaled to zero (requests are held)
        current = self.scaled()
        for _ in range(desired - len(current)):
            self.add(self.scaled_role)
        # shed the instances with the least outstanding work, the ones still starting first
        for inst in sorted(current, key=lambda i: (i.ready, i.outstanding, i.name))[: max(len(current) - desired, 0)]:
            self.drain(inst)
        self.replicas_over_time.append((self.now, len(self.scaled())))
        self.at(self.now + self.scaler.period_seconds, self._scale)  # the run ends with the last request


def simulate(requests: Sequence[SimRequest], spec: ClusterSpec, policy: RoutingPolicy,
             scaler: ScalingPolicy | None = None, progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay `requests` through a fresh cluster. The requests are copied, so one list serves many runs."""
    fresh = [SimRequest(r.rid, r.arrival, r.prompt_tokens, r.output_tokens, r.hash_ids, r.block_hashes)
             for r in requests]
    return Cluster(spec, policy, scaler).run(fresh, progress)
