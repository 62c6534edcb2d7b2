"""What the scaler observes, read from the engines' /metrics (DESIGN.md contract 3).

Each engine exports its own KV forecast; the operator re-derives none of it. What no pod knows is the pool's
traffic: the operator estimates the arrival rate, its trend, and the mean request (blocks held, time held,
uncached prompt and output tokens) from the engines' counters between two scrapes. Arrivals are counted by
conservation: requests finished plus the growth of those running or waiting.

Pure: `parse_pod` reads one exposition text, `TrafficEstimator` turns successive pool totals into rates, and
`Scaler` feeds both to `scaling.decide` tick after tick (for the operator's timer and for `kvmesh up`).
"""

from __future__ import annotations

import math
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
    f"{VllmMetric.E2E}_count": "finished",
    f"{VllmMetric.E2E}_sum": "finished_seconds",
    f"{VllmMetric.PROMPT_TOKENS}_total": "prompt_tokens",
    f"{VllmMetric.GENERATION_TOKENS}_total": "output_tokens",
    f"{VllmMetric.PREFIX_HITS}_total": "cached_tokens",
}


@dataclass(frozen=True)
class Counters:
    """A pod's (or the pool's) cumulative counters and its requests in flight."""

    finished: float = 0.0
    finished_seconds: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    cached_tokens: float = 0.0
    in_flight: float = 0.0

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[float, ...]:
        return (self.finished, self.finished_seconds, self.prompt_tokens, self.output_tokens, self.cached_tokens,
                self.in_flight)


@dataclass(frozen=True)
class PodMetrics:
    observation: PodObservation
    counters: Counters
    block_size: int
    kv_format: str = DEFAULT_KV_CACHE_DTYPE  # how it stores KV blocks: a warm-up copies only between pods alike


def parse_pod(name: str, role: str, text: str) -> PodMetrics:
    """One engine's /metrics text as the scaler's observation and the counters the traffic estimate needs."""
    m = read_engine_metrics(text)
    values = {field: m.values[exposed] for exposed, field in _GAUGES.items() if exposed in m.values}
    counters = {field: m.values[exposed] for exposed, field in _COUNTERS.items() if exposed in m.values}
    running, waiting = int(values.pop("running", 0)), int(values.pop("waiting", 0))
    observation = PodObservation(name=name, role=role, num_blocks=m.num_blocks or 0, forecast=m.forecast_usage,
                                 running=running, waiting=waiting, decode_step_cost=read_decode_step_cost(m.values),
                                 **values)
    return PodMetrics(observation, Counters(**counters, in_flight=running + waiting),
                      m.block_size or DEFAULT_BLOCK_SIZE, m.kv_format or m.cache_dtype or DEFAULT_KV_CACHE_DTYPE)


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


@dataclass
class TrafficEstimator:
    """Rates from successive pool totals. A pod that restarts (its counters fall) or leaves makes a total fall:
    that interval is skipped rather than read as negative traffic. The trend is `rate_trend` over the last
    `trend_points` rates."""

    trend_points: int = 6
    _last: tuple[float, frozenset[str], Counters] | None = None
    _rates: deque[tuple[float, float]] = field(default_factory=deque)
    _traffic: Traffic = field(default_factory=Traffic)

    def update(self, now: float, pods: Iterable[tuple[str, Counters]], block_size: int) -> Traffic:
        pods = list(pods)
        names = frozenset(name for name, _ in pods)
        total = sum((c for _, c in pods), Counters())
        last, self._last = self._last, (now, names, total)
        if last is None or last[1] != names or now <= last[0]:
            return self._traffic
        dt = now - last[0]
        d = Counters(*(a - b for a, b in zip(total.astuple(), last[2].astuple(), strict=True)))
        if min(d.finished, d.prompt_tokens, d.output_tokens, d.cached_tokens) < 0:
            return self._traffic
        arrived = max(0.0, d.finished + d.in_flight)
        rate = arrived / dt
        self._rates.append((now, rate))
        while len(self._rates) > self.trend_points:
            self._rates.popleft()
        previous = self._traffic
        if d.finished > 0:
            prompt, output = d.prompt_tokens / d.finished, d.output_tokens / d.finished
            per_request = Traffic(blocks_per_request=math.ceil((prompt + output) / block_size),
                                  request_seconds=d.finished_seconds / d.finished,
                                  uncached_prompt_tokens=max(0.0, prompt - d.cached_tokens / d.finished),
                                  output_tokens=output, decode_context_tokens=prompt + output / 2)
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
                idle_seconds: float = 0.0) -> Decision:
        """The next decision; `held_requests` (summed over the routers) and `idle_seconds` (memory.IdleClock) feed
        scale to zero."""
        traffic = self.traffic.update(now, [(m.observation.name, m.counters) for m in metrics],
                                      self.pool.spec["engine"]["blockSize"])
        observation = PoolObservation(
            now=now, pods=[m.observation for m in metrics], replicas=replicas, arrival_rate=traffic.arrival_rate,
            arrival_rate_slope=traffic.arrival_rate_slope, blocks_per_request=traffic.blocks_per_request,
            request_seconds=traffic.request_seconds, uncached_prompt_tokens=traffic.uncached_prompt_tokens,
            output_tokens=traffic.output_tokens, decode_context_tokens=traffic.decode_context_tokens,
            held_requests=held_requests, idle_seconds=idle_seconds)
        decision = decide(observation, scaling_policy(self.pool), self.history)
        self.history = decision.history
        return decision
