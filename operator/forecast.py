"""What the scaler observes, read from the engines' /metrics (docs/contracts.md, contract 3).

Each engine exports its own KV forecast; the operator re-derives none of it. What no pod knows is the pool's
traffic: the operator estimates the arrival rate, its trend, and the mean request (blocks held, time held,
uncached prompt and output tokens) from the engines' counters between two scrapes. Arrivals are counted by
conservation, pod by pod: requests ended (every finish reason: an aborted request arrived too) plus the growth
of those running or waiting, over the pods seen at both scrapes, plus everything a pod counted that was not
seen before (a scale-up's pod, a restarted one). A pod that left takes its last interval with it. In a
disaggregated pool every request passes a prefill pod and a decode pod: it is counted once, on the KV roles.

Pure: `parse_pod` reads one exposition text, `TrafficEstimator` turns successive pool totals into rates, and
`Scaler` feeds both to `scaling.decide` tick after tick (for the operator's timer and for `kvmesh up`).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_NUM_SEQS,
    Metric,
    RouterMetric,
    VllmMetric,
    read_decode_step_cost,
    read_engine_metrics,
)
from kvmesh.operator.crd import Pool
from kvmesh.operator.desired import engine_settings
from kvmesh.operator.scaling import Decision, PodObservation, PoolObservation, Recommendation, ScalingPolicy, decide

_GAUGES = {
    VllmMetric.KV_USAGE: "usage",
    VllmMetric.RUNNING: "running",
    VllmMetric.WAITING: "waiting",
    Metric.FORECAST_OVERLOAD: "overload_probability",
    Metric.PREFILL_THROUGHPUT: "prefill_tokens_per_second",
    Metric.DECODE_STEP_SECONDS: "decode_step_seconds",
}
_COUNTERS = {  # name as exposed -> Counters field
    f"{VllmMetric.E2E}_count": "timed",
    f"{VllmMetric.E2E}_sum": "finished_seconds",
    f"{VllmMetric.PROMPT_TOKENS}_total": "prompt_tokens",
    f"{VllmMetric.GENERATION_TOKENS}_total": "output_tokens",
    f"{VllmMetric.PREFIX_HITS}_total": "cached_tokens",
}


# Requests ended, by finish reason (stop, length, abort, error): labelled, so not among read_engine_metrics' values.
_REQUESTS_SAMPLE = re.compile(rf"^{Metric.REQUESTS}_total(?:{{[^}}]*}})?[ \t]+(\S+)", re.MULTILINE)


def requests_ended(text: str) -> float | None:
    """Requests an engine ended, summed over every finish reason (kvmesh_requests_total); None when it exports
    none. vllm:e2e_request_latency_seconds counts only those that stopped or hit their length: an aborted or
    failed request (a client that gave up under overload) arrived all the same, and must not vanish from the
    arrival count."""
    found = [float(v) for v in _REQUESTS_SAMPLE.findall(text)]
    found = [v for v in found if math.isfinite(v)]
    return sum(found) if found else None


@dataclass(frozen=True)
class Counters:
    """A pod's (or the pool's) cumulative counters and its requests in flight. `finished` counts every request
    that ended (any finish reason), `timed` those whose end-to-end time is in `finished_seconds` (stop, length);
    `timed` 0 with `finished_seconds` set means both count the same requests."""

    finished: float = 0.0
    finished_seconds: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    cached_tokens: float = 0.0
    in_flight: float = 0.0
    timed: float = 0.0

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[float, ...]:
        return (self.finished, self.finished_seconds, self.prompt_tokens, self.output_tokens, self.cached_tokens,
                self.in_flight, self.timed)

    def fell_below(self, earlier: Counters) -> bool:
        """Whether a cumulative counter fell since `earlier`: the engine restarted (in flight is a gauge)."""
        now, then = self.astuple(), earlier.astuple()
        return any(a < b for i, (a, b) in enumerate(zip(now, then, strict=True)) if i != 5)

    @property
    def seconds_per_request(self) -> float:
        """Mean end-to-end seconds of the requests timed; 0: none."""
        timed = self.timed or self.finished
        return self.finished_seconds / timed if timed > 0 else 0.0


@dataclass(frozen=True)
class PodMetrics:
    observation: PodObservation
    counters: Counters
    block_size: int
    kv_format: str = DEFAULT_KV_CACHE_DTYPE  # how it stores KV blocks: a warm-up copies only between pods alike
    weights: str = ""  # the weights its KV is computed with (weights_fingerprint; "": its engine does not say)


def parse_pod(name: str, role: str, text: str) -> PodMetrics:
    """One engine's /metrics text as the scaler's observation and the counters the traffic estimate needs."""
    m = read_engine_metrics(text)
    values = {field: m.values[exposed] for exposed, field in _GAUGES.items() if exposed in m.values}
    counters = {field: m.values[exposed] for exposed, field in _COUNTERS.items() if exposed in m.values}
    ended = requests_ended(text)  # an engine older than the counter: the timed ones are all it says
    counters["finished"] = ended if ended is not None else counters.get("timed", 0.0)
    running, waiting = int(values.pop("running", 0)), int(values.pop("waiting", 0))
    observation = PodObservation(name=name, role=role, num_blocks=m.num_blocks or 0, forecast=m.forecast_usage,
                                 peak=m.forecast_peak,
                                 running=running, waiting=waiting, decode_step_cost=read_decode_step_cost(m.values),
                                 **values)
    return PodMetrics(observation, Counters(**counters, in_flight=running + waiting),
                      m.block_size or DEFAULT_BLOCK_SIZE, m.kv_format or m.cache_dtype or DEFAULT_KV_CACHE_DTYPE,
                      m.weights_fingerprint or "")


def parse_router_held(text: str) -> int:
    """Requests one router pod holds for want of a ready engine, from its /metrics text (0 when it exports none:
    a router older than the gauge holds nothing)."""
    return int(read_engine_metrics(text).values.get(RouterMetric.REQUESTS_WAITING_FOR_PODS, 0))


@dataclass(frozen=True)
class Traffic:
    """The pool's recent traffic, as PoolObservation wants it."""

    arrival_rate: float = 0.0
    arrival_rate_slope: float = 0.0
    blocks_per_request: float = 0.0
    request_seconds: float = 0.0
    uncached_prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    decode_context_tokens: float = 0.0  # a decoding request's KV tokens, mean over its outputs: prompt + output / 2


KV_ROLE_NAMES = ("decode", "both")  # the roles a request ends on exactly once (scaling.KV_ROLES)
FORGET_AFTER_UPDATES = 40  # a pod unseen for this many scrapes is forgotten (it left)


@dataclass
class TrafficEstimator:
    """Rates from successive scrapes of the pool's pods, counted pod by pod. A pod seen at the last scrape adds
    what its counters grew by; one not seen then (a scale-up's pod, or a pod that restarted: its counters fell)
    adds all it counted, since all of it arrived after it started; one seen earlier but not at the last scrape
    (a missed scrape) adds what grew since it was last seen. A pod that left is dropped with its last interval.
    Skipping every interval in which the set of pods changed, as an earlier version did, froze the rate through
    a scale-up, which always adds a pod. Arrivals are counted on the KV roles (decode, both) only: a
    disaggregated pool's request also ends on a prefill pod (max_tokens 1), and counting both doubled the rate;
    the uncached prompt is read where prompts are computed (the prefill pods, when there are any), the rest of
    the request (output, time held, blocks) where the KV is held. The trend is `rate_trend` over the last
    `trend_points` rates."""

    trend_points: int = 6
    _last: float | None = None  # the time of the last scrape
    _known: dict[str, tuple[int, Counters]] = field(default_factory=dict)  # pod -> (update seen, counters)
    _updates: int = 0
    _rates: deque[tuple[float, float]] = field(default_factory=deque)
    _traffic: Traffic = field(default_factory=Traffic)

    @property
    def last_scrape(self) -> float | None:
        """When counters were last read; None before the first scrape (which gives no rate yet)."""
        return self._last

    def update(self, now: float, pods: Iterable[tuple[str, Counters]], block_size: int,
               roles: Mapping[str, str] | None = None) -> Traffic:
        """The traffic as of `now` from each answering pod's counters; `roles` (pod -> role, default both) says
        which pods count arrivals (`KV_ROLE_NAMES`) and which compute prompts (prefill)."""
        last, known = self._last, self._known
        if last is not None and now <= last:  # no time passed: nothing to read (the counters wait for the next)
            return self._traffic
        pods, roles = list(pods), roles or {}
        self._updates += 1
        grew: dict[str, Counters] = {}
        for name, counters in pods:
            before = known.get(name)
            grew[name] = counters if before is None or counters.fell_below(before[1]) else counters - before[1]
            known[name] = (self._updates, counters)
        for name in [n for n, (seen, _) in known.items() if seen < self._updates - FORGET_AFTER_UPDATES]:
            del known[name]
        self._last = now
        if last is None:  # the first scrape: counters with no earlier value say nothing of a rate
            return self._traffic
        dt = now - last
        kv = [d for name, d in grew.items() if roles.get(name, "both") in KV_ROLE_NAMES] or list(grew.values())
        prefill = [d for name, d in grew.items() if roles.get(name, "both") == "prefill"]
        d = sum(kv, Counters())
        rate = max(0.0, d.finished + d.in_flight) / dt
        self._rates.append((now, rate))
        while len(self._rates) > self.trend_points:
            self._rates.popleft()
        previous = self._traffic
        if d.finished > 0:
            prompt, output = d.prompt_tokens / d.finished, d.output_tokens / d.finished
            computed = sum(prefill, Counters())
            if computed.finished <= 0:
                computed = d
            uncached = max(0.0, (computed.prompt_tokens - computed.cached_tokens) / computed.finished)
            per_request = Traffic(blocks_per_request=math.ceil((prompt + output) / block_size),
                                  request_seconds=d.seconds_per_request or previous.request_seconds,
                                  uncached_prompt_tokens=uncached, output_tokens=output,
                                  decode_context_tokens=prompt + output / 2)
        else:
            per_request = previous
        self._traffic = Traffic(rate, rate_trend(list(self._rates)), per_request.blocks_per_request,
                                per_request.request_seconds, per_request.uncached_prompt_tokens,
                                per_request.output_tokens, per_request.decode_context_tokens)
        return self._traffic


def rate_trend(points: Sequence[tuple[float, float]]) -> float:
    """The arrival rate's trend from (time, rate) points: their least-squares slope b, shrunk by its own standard
    error se to b x max(0, 1 - se^2 / b^2); 0 below three points.

    Why shrink: a slope read from a few bursty rates is mostly noise, and the scaler multiplies it by a minute
    or more. For a true slope beta read as b with variance se^2, the factor c that minimizes E[(c b - beta)^2] is
    beta^2 / (beta^2 + se^2); E[b^2] = beta^2 + se^2, so b^2 - se^2 estimates the numerator and b^2 the
    denominator, hence the factor (positive part). A steady
    ramp (small residuals) keeps nearly all of its slope, a rate that jumps and turns back (large residuals
    about the line: 30, 45, 38 requests/s) keeps none of it, so a burst that has already turned is not
    projected onward. It uses only the fit's own residuals: no constant to tune per trace."""
    n = len(points)
    if n < 3:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_r = sum(r for _, r in points) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if not sxx:
        return 0.0
    slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / sxx
    residuals = sum((r - mean_r - slope * (t - mean_t)) ** 2 for t, r in points)
    variance = residuals / (n - 2) / sxx  # the slope's squared standard error
    return slope * max(0.0, 1 - variance / slope**2) if slope else 0.0


def scaling_policy(pool: Pool) -> ScalingPolicy:
    """The pool's scaling spec as the pure scaler's policy (the operator's timer uses the same)."""
    s = pool.spec["scaling"]
    bounds = {role: pool.bounds(role) for role in pool.roles}
    return ScalingPolicy(min_replicas={r: b[0] for r, b in bounds.items()},
                         max_replicas={r: b[1] for r, b in bounds.items()},
                         target_utilization=s["targetUtilization"], horizon_seconds=s["horizonSeconds"],
                         overload_threshold=s["overloadProbability"],
                         scale_up_stabilization_seconds=s["scaleUpStabilizationSeconds"],
                         scale_down_stabilization_seconds=s["scaleDownStabilizationSeconds"],
                         startup_seconds=s["podStartupSeconds"], itl_seconds=s["slo"].get("itlSeconds"),
                         max_batch=int(engine_settings(pool).get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)),
                         scale_to_zero_idle_seconds=(s["scaleToZero"]["idleSeconds"] if "scaleToZero" in s
                                                     else None))


@dataclass
class Scaler:
    """Successive scaling decisions for one pool from its engines' metrics texts; keeps what `decide` needs
    between calls (the traffic estimate and the recent recommendations)."""

    pool: Pool
    traffic: TrafficEstimator = field(default_factory=TrafficEstimator)
    history: tuple[Recommendation, ...] = ()

    def observe(self, now: float, metrics: list[PodMetrics], replicas: Mapping[str, int], held_requests: int = 0,
                idle_seconds: float = 0.0, unobserved: Mapping[str, int] | None = None) -> Decision:
        """The next decision; `held_requests` (summed over the routers) and `idle_seconds` (memory.IdleClock) feed
        scale to zero; `unobserved`: per role, Ready pods that did not answer (no scale-down for their role)."""
        traffic = self.traffic.update(now, [(m.observation.name, m.counters) for m in metrics],
                                      self.pool.spec["engine"]["blockSize"],
                                      {m.observation.name: m.observation.role for m in metrics})
        observation = PoolObservation(
            now=now, pods=[m.observation for m in metrics], replicas=replicas, arrival_rate=traffic.arrival_rate,
            arrival_rate_slope=traffic.arrival_rate_slope, blocks_per_request=traffic.blocks_per_request,
            request_seconds=traffic.request_seconds, uncached_prompt_tokens=traffic.uncached_prompt_tokens,
            output_tokens=traffic.output_tokens, decode_context_tokens=traffic.decode_context_tokens,
            held_requests=held_requests, idle_seconds=idle_seconds, unobserved=dict(unobserved or {}))
        decision = decide(observation, scaling_policy(self.pool), self.history)
        self.history = decision.history
        return decision
