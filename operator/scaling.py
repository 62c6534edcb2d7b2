"""How many pods each role needs: a pure function of what the pool looks like now and its scaling policy.

PreServe's rule (ICSE '26): scale on the KV usage *predicted* over a horizon at least as long as a pod takes to
start, so that new capacity is ready before the cache runs out rather than after. Each engine forecasts its own
requests (docs/contracts.md, contract 3); only the operator sees the whole pool's arrivals, so it adds them here:

    demand(q) = sum over pods of usage_q x blocks  +  arrivals over the window (Poisson, at level q) x blocks/request

with blocks per request read by Little's law from what the pods hold now, and the window's peak taken as the
larger of that and the demand now (blocks held plus the queued requests'). Both are held as long as requests
are held in the pods measured now; a pool of another size holds them longer or shorter (`Holding`: the
decodes stall while a pod prefills arrivals, and more pods share the arrivals), so the demand is a function of
the pod count. The arrivals come at the rate seen plus its trend, followed only until the pods asked for now
serve (`ScalingPolicy.trend_seconds`; the trend itself is shrunk by its own fit error, forecast.rate_trend).
A role is sized to the fewest pods whose peak at level 1 - threshold sits at the target utilization: it
scales up as soon as that needs more pods (the HPA rule on the predicted peak, a start-up delay
early), and by at least one pod when P(demand > 95 % of its capacity) reaches the policy's threshold (10 % by
default). It scales down only when the same demand fits under the target with fewer pods, and then to the
highest need of the stabilization window (Kubernetes' HPA rule), where a need seen (the demand now) counts for
the whole window and a predicted one only until its horizon has passed: a peak that was forecast and did not
come is no evidence, and one that comes later is forecast again a horizon ahead. In a disaggregated pool the
prefill:decode split follows by rate matching: prefill pods for arrivals x uncached prompt tokens over the
measured prefill throughput, decode pods for KV capacity and for the generated tokens per second they make
with their step within the pool's inter-token latency objective (`decode_speed`, from the step cost each
engine fits over its own decode steps, engine/step_cost.py); the same holds for pods that do both.

Scale to zero (`ScalingPolicy.scale_to_zero_idle_seconds`) is decided for the whole pool after the roles':
a pool idle that long (no request running, waiting, arriving or held by a router) goes to 0 pods; a pool at 0
goes back, as soon as a router holds a request for want of an engine, to enough pods per role to batch every
held request (`wake_replicas`: at least max(min, 1)); otherwise no role goes below max(min, 1)
(`with_scale_to_zero`).

No I/O and no clock: the caller (the kopf timer, `kvmesh up`, the cluster simulator) passes the time and the
recent recommendations, and keeps the ones `decide` returns.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from kvmesh.engine.protocol import FORECAST_LEVELS, OVERLOAD_USAGE, DecodeStepCost

SCALED_ROLES: tuple[str, ...] = ("prefill", "decode", "both")  # the router's replicas are fixed in the spec
KV_ROLES: tuple[str, ...] = ("decode", "both")  # roles whose pods hold the pool's KV for a request's whole life
LEVEL_Q: dict[str, float] = {level: float(level[1:]) / 100 for level in FORECAST_LEVELS}  # "p90" -> 0.9


@dataclass(frozen=True)
class PodObservation:
    """One engine pod as its /metrics showed it (contract 3). Usage values are fractions of its device blocks."""

    name: str
    role: str  # prefill, decode or both
    num_blocks: int  # device KV blocks
    usage: float = 0.0  # vllm:kv_cache_usage_perc now
    forecast: Mapping[str, float] = field(default_factory=dict)  # level (p50, p90, p99) -> usage at the horizon
    overload_probability: float = 0.0  # P(usage passes 95 % within the horizon), from its own requests
    running: int = 0
    waiting: int = 0
    prefill_tokens_per_second: float = 0.0  # measured; 0: not yet
    decode_step_seconds: float = 0.0  # measured; 0: not yet
    decode_step_cost: DecodeStepCost | None = None  # fitted by the engine; None: not yet (its batch has not varied)
    # level -> the peak of its own requests' usage within the horizon (engine/forecast.py peak_quantiles); empty
    # when the engine does not say. A floor of the window's demand, never added to the arrivals (see SizedDemand)
    peak: Mapping[str, float] = field(default_factory=dict)

    def peak_quantile(self, q: float) -> float:
        """The pod's own peak within the horizon at level q (its usage now when it exports no peak)."""
        points = [(0.0, self.usage), *sorted((LEVEL_Q[k], v) for k, v in self.peak.items() if k in LEVEL_Q)]
        return max(self.usage, _interpolate(points, q)) if len(points) > 1 else self.usage

    def quantile(self, q: float) -> float:
        """The pod's usage at the horizon at probability level q, interpolated through (0, now) and its forecast
        levels; beyond the last level, the last segment's slope continues."""
        points = [(0.0, self.usage), *sorted((LEVEL_Q[k], v) for k, v in self.forecast.items() if k in LEVEL_Q)]
        if len(points) == 1:
            return self.usage
        return _interpolate(points, q)


@dataclass(frozen=True)
class PoolObservation:
    """What the pool looks like at time `now` (seconds on any clock the caller keeps)."""

    now: float
    pods: Sequence[PodObservation]  # the role pods that answered; starting pods are counted in `replicas`
    replicas: Mapping[str, int]  # current desired replicas per role (including pods still starting)
    arrival_rate: float = 0.0  # requests per second into the pool (router metrics or the request log)
    arrival_rate_slope: float = 0.0  # its trend, requests per second per second (a ramp seen in the log)
    blocks_per_request: float = 0.0  # device blocks a request holds at its peak (prompt + output), mean
    request_seconds: float = 0.0  # how long a request holds its blocks, mean; 0: unknown (then: the horizon)
    uncached_prompt_tokens: float = 0.0  # prompt tokens a request computes (prompt minus cached), mean
    output_tokens: float = 0.0  # generated tokens per request, mean
    prefill_tokens_per_second: float = 0.0  # one pod's measured prefill speed; 0: take the pods' own
    decode_context_tokens: float = 0.0  # KV tokens a decoding request attends to, mean over its output tokens
    # the squared coefficient of variation of blocks per request (Var / mean^2): the arrivals' blocks are a
    # compound Poisson sum, whose variance is count x E[B^2] = count x mean^2 x (1 + cv2)
    blocks_per_request_cv2: float = 1.0
    held_requests: int = 0  # requests the routers hold for lack of a ready engine (summed over router pods)
    idle_seconds: float = 0.0  # how long no request has run, waited or arrived in the pool (nor been held)
    # per role, Ready pods whose /metrics did not answer: their load is unknown, so the role may not shrink
    unobserved: Mapping[str, int] = field(default_factory=dict)

    def role_pods(self, role: str) -> list[PodObservation]:
        return [p for p in self.pods if p.role == role]


def serving_floor(low: int, high: int, scales_to_zero: bool) -> int:
    """The fewest pods a role keeps while its pool serves, and starts with: its min, and with scale to zero at
    least one (min 0 is then only for an idle pool)."""
    return min(max(low, 1), high) if scales_to_zero else low


@dataclass(frozen=True)
class ScalingPolicy:
    """The pool's `spec.scaling` and `spec.replicas`, as numbers (operator/crd.py parses the spec into this)."""

    min_replicas: Mapping[str, int]
    max_replicas: Mapping[str, int]
    target_utilization: float = 0.8  # the KV (and compute) utilization a role is sized for
    horizon_seconds: float = 60.0  # at least the pod start-up delay
    overload_threshold: float = 0.10  # scale up when P(usage > 95 % within the horizon) reaches this
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    startup_seconds: float | None = None  # how long a new pod takes to serve; None: the horizon
    itl_seconds: float | None = None  # the inter-token latency objective decode pods are sized for; None: none
    max_batch: int | None = None  # sequences an engine batches in a step (its max_num_seqs); None: no cap
    # scale every role to 0 after this long idle, and back up when a router holds a request; None: never to 0
    scale_to_zero_idle_seconds: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= OVERLOAD_USAGE:
            raise ValueError(f"target_utilization must be in (0, {OVERLOAD_USAGE}], got {self.target_utilization}")
        if not 0 < self.overload_threshold < 1:
            raise ValueError(f"overload_threshold must be in (0, 1), got {self.overload_threshold}")
        if self.horizon_seconds <= 0:
            raise ValueError("horizon_seconds must be positive")
        if self.itl_seconds is not None and not self.itl_seconds > 0:
            raise ValueError(f"itl_seconds must be positive, got {self.itl_seconds}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.scale_to_zero_idle_seconds is not None and not self.scale_to_zero_idle_seconds > 0:
            raise ValueError(f"scale_to_zero_idle_seconds must be positive, got {self.scale_to_zero_idle_seconds}")
        if self.startup_seconds is not None and not 0 <= self.startup_seconds <= self.horizon_seconds:
            raise ValueError(f"startup_seconds must be in [0, horizon_seconds], got {self.startup_seconds}")
        for role, low in self.min_replicas.items():
            if not 0 <= low <= self.max_replicas.get(role, low):
                raise ValueError(f"{role}: need 0 <= min <= max replicas, got {low}..{self.max_replicas.get(role)}")

    @property
    def trend_seconds(self) -> float:
        """How far ahead the arrival rate's trend is followed: until the pods asked for now serve. What the rate
        does after that, a later decision sees and asks for a start-up delay ahead again; following a trend
        fitted over a minute or two further than that extrapolates a burst past its top (a linear trend never
        turns), which costs replica-seconds and buys no lead time. The rest of the horizon is still covered,
        at the rate reached."""
        return self.horizon_seconds if self.startup_seconds is None else self.startup_seconds

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in SCALED_ROLES if r in self.max_replicas)

    def serving_floor(self, role: str) -> int:
        """The fewest pods a role keeps while the pool serves (`serving_floor`)."""
        return serving_floor(self.min_replicas.get(role, 0), self.max_replicas.get(role, 1),
                             self.scale_to_zero_idle_seconds is not None)


@dataclass(frozen=True)
class Recommendation:
    """One role's unstabilized pod counts at one time: what `decide` keeps for the stabilization windows."""

    at: float
    role: str
    replicas: int  # for the peak predicted within the horizon
    observed: int  # for what the pool holds and queues now, and the arrivals' compute at the rate seen now


@dataclass(frozen=True)
class RoleDecision:
    replicas: int  # what to set (bounded, stabilized)
    recommended: int  # what this observation alone asks for
    reason: str  # one of REASONS
    predicted_usage: float  # demand at the policy's level over the role's current capacity (may exceed 1)
    overload_probability: float  # P(usage > 95 %) within the horizon at the current size


@dataclass(frozen=True)
class Decision:
    at: float
    roles: dict[str, RoleDecision]
    history: tuple[Recommendation, ...]  # pass back to the next `decide` (oldest first)

    @property
    def replicas(self) -> dict[str, int]:
        return {role: d.replicas for role, d in self.roles.items()}

    def changed(self, current: Mapping[str, int]) -> dict[str, int]:
        """The roles whose replicas differ from `current`."""
        return {role: n for role, n in self.replicas.items() if current.get(role) != n}

    def describe(self, role: str, current: Mapping[str, int]) -> str:
        """One role's change as the operator's Events and `kvmesh up` say it."""
        d = self.roles[role]
        return (f"{role}: {current.get(role)} -> {d.replicas} replicas ({d.reason}; predicted KV "
                f"{d.predicted_usage:.0%}, P(>95%) {d.overload_probability:.0%})")


REASONS: tuple[str, ...] = (
    "ScaleUpPredictedOverload",  # P(usage > 95 % within the horizon) reached the threshold
    "ScaleUpPredictedAboveTarget",  # the predicted peak within the horizon needs more pods at target utilization
    "ScaleUpPrefillRate",  # arrivals' prefill work exceeds what the role computes at target utilization
    "ScaleUpInterTokenLatency",  # generated tokens per second exceed what the role makes within the ITL objective
    "ScaleDownUnderTarget",  # fewer pods fit the predicted peak, and every need the window holds (see decide_role)
    "HoldStabilizing",  # fewer pods would do, but not yet for the whole stabilization window
    "HoldWithinTarget",  # no change needed
    "HoldNoMetrics",  # no pod of the role answered: keep what there is
    "HoldMissingMetrics",  # fewer would do, but a Ready pod did not answer its scrape: its load is unknown
    "ScaleUpHeldRequests",  # routers hold requests for want of a ready engine: pods enough to batch them
    "BoundedByMin",
    "BoundedByMax",
    "ScaleFromZero",  # every role was at 0 and a router holds a request: each to max(min, 1) at once
    "ScaleToZero",  # no request in the pool for scale_to_zero_idle_seconds and none held: every role to 0
    "HoldAtZero",  # every role is at 0 and no request is held
)


def _interpolate(points: list[tuple[float, float]], q: float) -> float:
    """Piecewise-linear through (level, value) points sorted by level, extended by the last segment past them."""
    pairs = list(itertools.pairwise(points))
    for i, ((q0, v0), (q1, v1)) in enumerate(pairs):
        if q <= q1 or i == len(pairs) - 1:
            return v0 if q1 == q0 else v0 + (v1 - v0) * (q - q0) / (q1 - q0)
    return points[-1][1]


def projected_rate(obs: PoolObservation, seconds: float, trend_seconds: float = math.inf) -> float:
    """The arrival rate `seconds` from now (or ago, when negative), the trend followed for at most
    `trend_seconds` of them ahead (never negative)."""
    return max(0.0, obs.arrival_rate + obs.arrival_rate_slope * min(seconds, trend_seconds))


@dataclass(frozen=True)
class Arrivals:
    """The pool's new requests still held at the end of a window: those that arrive in its last `held_seconds`
    (Little's law), at the rate projected for then, each holding `blocks_per_request` on average, with sizes
    spread by `size_cv2` (their squared coefficient of variation)."""

    rate: float
    held_seconds: float
    blocks_per_request: float
    size_cv2: float = 1.0

    def blocks(self, q: float) -> float:
        """Their blocks at probability level q: a compound Poisson sum's normal spread around its mean. A count
        of mean m of sizes B has variance m x E[B^2] = m x E[B]^2 x (1 + cv2), not the m x E[B]^2 of a Poisson
        count times the mean size: with the Azure trace's sizes (cv 0.8) that spread passed its p90 in 16 % of
        windows."""
        mean = self.held_seconds * self.rate
        if self.blocks_per_request <= 0 or mean == 0:
            return 0.0
        z = NormalDist().inv_cdf(min(max(q, 1e-6), 1 - 1e-6))
        spread = math.sqrt(mean * (1 + max(0.0, self.size_cv2)))
        return max(0.0, mean + z * spread) * self.blocks_per_request


def arrivals(obs: PoolObservation, window_seconds: float, trend_seconds: float = math.inf) -> Arrivals:
    """The arrivals held at the end of the window: those of its last min(window, request duration) seconds (the
    whole window when the duration is unknown), at the rate projected for their middle."""
    held = window_seconds if obs.request_seconds <= 0 else min(window_seconds, obs.request_seconds)
    return Arrivals(projected_rate(obs, window_seconds - held / 2, trend_seconds), held, obs.blocks_per_request,
                    obs.blocks_per_request_cv2)


def role_demand(pods: Sequence[PodObservation], new: Arrivals | None, q: float) -> float:
    """Blocks the role's requests hold at the horizon at level q: the pods' forecasts (summing the same level of
    each is the comonotone bound, which errs toward scaling) plus the pool's arrivals (KV roles; None for the
    others)."""
    own = sum(p.quantile(q) * p.num_blocks for p in pods)
    return own + (new.blocks(q) if new is not None else 0.0)


def demand_now(pods: Sequence[PodObservation], obs: PoolObservation, role: str) -> float:
    """Blocks the role holds now plus, for the KV roles, what its queued requests will take once admitted: the
    window's first point (the horizon's is `role_demand`), so a pool already past its target is never read as
    fitting because the arrivals' estimate lags a ramp."""
    queued = sum(p.waiting for p in pods) * obs.blocks_per_request if role in KV_ROLES else 0.0
    return sum(p.usage * p.num_blocks for p in pods) + queued


def little_calibrated(obs: PoolObservation, held: float) -> PoolObservation:
    """`obs` with the blocks per request that Little's law reads from the pool now: blocks held = the rate at
    which the requests in flight arrived (the trend's rate half a request's time ago) x blocks per request x
    seconds held. The logged figure is a request's peak blocks over its end-to-end time, queueing included; a
    request holds fewer on average (its output grows, it holds nothing while queued), so the logged product
    overstates the arrivals' demand. Pods that hold nothing yet leave the logged figure in place. The figure sizes
    the arrivals only: the requests queued now are counted at the logged size (`demand_now`), since with the rate
    near zero while a few requests are still in flight the quotient reads each as holding thousands of blocks (a
    pool of three small requests was asked 9 pods)."""
    if held <= 0 or obs.request_seconds <= 0 or obs.blocks_per_request <= 0:
        return obs
    arrived_at = projected_rate(obs, -obs.request_seconds / 2)
    if arrived_at <= 0:
        return obs
    return replace(obs, blocks_per_request=held / (arrived_at * obs.request_seconds))


def prefill_speed(pods: Sequence[PodObservation], obs: PoolObservation) -> float:
    """One pod's prefill tokens per second: the pool-level figure, else the pods' measured mean; 0: unknown."""
    measured = [p.prefill_tokens_per_second for p in pods if p.prefill_tokens_per_second > 0]
    return obs.prefill_tokens_per_second or (sum(measured) / len(measured) if measured else 0.0)


@dataclass(frozen=True)
class Holding:
    """How much longer (> 1) or shorter (< 1) a request holds its blocks in a pool of n pods taking r requests/s
    than in the pods measured now at the rate their held requests arrived. A pod computes one thing at a time
    (or shares its step between prefill and decode): the share of its time spent on arrivals' prefills,
    rho = r / n x uncached prompt tokens / prefill speed, stalls its decodes, so a decoding request is held
    1 / (1 - rho) times the bare decode time. In a saturated pool rho is high and requests are held long;
    sizing the next pool with that holding time over-asks, and sizing a smaller one with a light pool's
    under-asks. Both shares are capped at 95 % (past it the rate matching asks for pods anyway)."""

    work_seconds: float  # one pod's time per request's prefill; 0: unmeasured (no correction)
    rho_now: float  # the share measured now

    def factor(self, replicas: int, rate: float) -> float:
        if self.work_seconds <= 0:
            return 1.0
        rho = min(OVERLOAD_USAGE, rate * self.work_seconds / max(replicas, 1))
        return (1 - self.rho_now) / (1 - rho)


NO_HOLDING_CORRECTION = Holding(0.0, 0.0)


def holding(pods: Sequence[PodObservation], obs: PoolObservation) -> Holding:
    """The pool's `Holding`, computed once per decision (no correction while the prefill speed is unknown)."""
    speed = prefill_speed(pods, obs)
    if speed <= 0 or obs.uncached_prompt_tokens <= 0 or not pods:
        return NO_HOLDING_CORRECTION
    work = obs.uncached_prompt_tokens / speed
    measured_at = projected_rate(obs, -obs.request_seconds / 2)  # as little_calibrated: when the held arrived
    return Holding(work, min(OVERLOAD_USAGE, measured_at * work / len(pods)))


@dataclass(frozen=True)
class SizedDemand:
    """A role's peak demand in blocks as a function of its pod count: the demand now and at the horizon, as the
    pods serving now hold requests, each times the holding factor at that size (KV roles only: a prefill pod
    holds a request only while it computes it)."""

    holding: Holding
    now: float  # demand_now
    now_rate: float  # the arrival rate seen now
    ahead: float  # role_demand at the horizon, at the policy's level
    horizon_rate: float  # the arrival rate the horizon's demand comes from

    def seen(self, replicas: int) -> float:
        """The demand now alone (what is held and queued, at the rate seen now)."""
        return self.now * self.holding.factor(replicas, self.now_rate)

    def __call__(self, replicas: int) -> float:
        return max(self.seen(replicas), self.ahead * self.holding.factor(replicas, self.horizon_rate))


def fewest_pods(demand: Callable[[int], float], room: float) -> int:
    """The fewest pods n whose demand(n) fits in n x room blocks, for a demand that never rises with n (a
    bigger pool holds each request no longer): doubling, then bisection."""
    first = demand(1)
    if not math.isfinite(first) or room <= 0:
        raise ValueError(f"need a finite demand and room for it, got {first} blocks, {room} per pod")
    if first <= 0:
        return 0

    def fits(n: int) -> bool:
        return demand(n) <= n * room + 1e-9

    hi = 1
    while not fits(hi):
        hi *= 2
    lo = hi // 2  # 0, or a size that does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def overload_probability(pods: Sequence[PodObservation], new: Arrivals | None, capacity: float) -> float:
    """P(demand passes 95 % of `capacity`): the level q at which the demand curve crosses it (bisection; the
    curve rises with q), and no less than the pods' own probabilities weighted by their blocks."""
    own = sum(p.overload_probability * p.num_blocks for p in pods) / max(1, sum(p.num_blocks for p in pods))
    limit = OVERLOAD_USAGE * capacity
    if role_demand(pods, new, 1 - 1e-4) <= limit:
        return own
    if role_demand(pods, new, 1e-4) > limit:
        return 1.0
    lo, hi = 1e-4, 1 - 1e-4
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if role_demand(pods, new, mid) <= limit else (lo, mid)
    return max(own, 1 - lo)


def decode_speed(pods: Sequence[PodObservation], obs: PoolObservation, step_seconds: float,
                 max_batch: int | None = None) -> float:
    """One pod's generated tokens per second when its decode step may take `step_seconds`: the largest batch
    (up to `max_batch`, the engines' max_num_seqs) whose fitted step (each sequence attending to the pool's mean
    decode context) fits, over that step's time, averaged over the pods that fitted a cost. 0 when none has, or
    when one sequence alone takes longer."""
    costs = [p.decode_step_cost for p in pods if p.decode_step_cost is not None]
    context = obs.decode_context_tokens
    if not costs or any(c.seconds(1, context) > step_seconds for c in costs):
        return 0.0
    batches = [c.largest_batch(step_seconds, context) for c in costs]
    if max_batch is not None:
        batches = [min(b, max_batch) for b in batches]
    return sum(b / c.seconds(b, b * context) for b, c in zip(batches, costs, strict=True)) / len(costs)


MAX_SEARCHED_PODS = 1 << 16  # past this many pods the ITL objective is taken as out of reach


def itl_replicas(pods: Sequence[PodObservation], obs: PoolObservation, policy: ScalingPolicy,
                 prefill_load: float) -> int:
    """The fewest pods whose generation meets the inter-token latency objective at target utilization; 0 without
    an objective, a fitted step cost or generation to size, or when no pod count meets it (one sequence's step
    is over the objective). At n pods each spends rho = prefill_load / n of its time on prompts (pods that do
    both; decode pods none), and its decodes stall meanwhile, so its step may take itl x (1 - rho): it batches
    the most sequences that fit, up to the engines' max_num_seqs (`decode_speed`), and generating its share of
    the tokens takes (arrivals x output tokens / n) / that speed of its time. n fits when both shares sum to the
    target."""
    generation = obs.arrival_rate * obs.output_tokens  # tokens per second the pool must generate
    if policy.itl_seconds is None or generation <= 0:
        return 0
    if decode_speed(pods, obs, policy.itl_seconds) <= 0:
        return 0

    def fits(n: int) -> bool:
        rho = prefill_load / n
        speed = decode_speed(pods, obs, policy.itl_seconds * (1 - rho), policy.max_batch) if rho < 1 else 0.0
        return speed > 0 and rho + generation / n / speed <= policy.target_utilization + 1e-9

    hi = 1
    while not fits(hi):
        if hi >= MAX_SEARCHED_PODS:
            return 0
        hi *= 2
    lo = hi // 2  # 0, or a size that does not fit (the shares fall as pods are added)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _rate_replicas(role: str, pods: Sequence[PodObservation], obs: PoolObservation,
                   policy: ScalingPolicy) -> tuple[int, int]:
    """Pods needed for the arrivals' compute at target utilization (rate matching): (for their prompts at the
    measured prefill speed, for prompts and generation within the ITL objective, `itl_replicas`); 0 when not
    measurable."""
    prefill_tps = prefill_speed(pods, obs)
    prefill_load = obs.arrival_rate * obs.uncached_prompt_tokens / prefill_tps if prefill_tps > 0 else 0.0
    for_prompts = math.ceil(prefill_load / policy.target_utilization - 1e-9) if role != "decode" else 0
    for_tokens = itl_replicas(pods, obs, policy, prefill_load if role == "both" else 0.0) if role in KV_ROLES else 0
    return for_prompts, for_tokens


def decide_role(role: str, obs: PoolObservation, policy: ScalingPolicy,
                history: Sequence[Recommendation]) -> tuple[RoleDecision, Recommendation]:
    """One role's decision; see the module's docstring."""
    current = max(0, obs.replicas.get(role, policy.min_replicas.get(role, 0)))
    low, high = policy.min_replicas.get(role, 0), policy.max_replicas.get(role, current)
    pods = obs.role_pods(role)
    q = 1 - policy.overload_threshold
    if not pods or not any(p.num_blocks for p in pods):
        recommended, reason, predicted, p_over = current, "HoldNoMetrics", 0.0, 0.0
        observed = current
    else:
        per_pod = sum(p.num_blocks for p in pods) / len(pods)
        new: Arrivals | None = None  # the pool's arrivals: held by the KV roles only
        held = NO_HOLDING_CORRECTION  # and only they hold a request longer in a busier pod
        held_now = demand_now(pods, obs, role)  # queued requests at the logged size: see little_calibrated
        if role in KV_ROLES:
            obs = little_calibrated(obs, held_now)
            new, held = arrivals(obs, policy.horizon_seconds, policy.trend_seconds), holding(pods, obs)
        # The pods' own peak within the horizon (requests that grow and end inside it) is a point of the window
        # too; it is a floor beside the demand now, not added to the horizon's arrivals: the own peak is mostly
        # now, when the arrivals have not come yet
        own_peak = sum(p.peak_quantile(q) * p.num_blocks for p in pods)
        demand = SizedDemand(held, max(held_now, own_peak), obs.arrival_rate, role_demand(pods, new, q),
                             new.rate if new else obs.arrival_rate)
        capacity = max(current, 1) * per_pod
        predicted = demand(current) / capacity
        # P(over 95 %) of the demand as held at the current size: the same test against a rescaled capacity
        held_as = capacity / held.factor(current, demand.horizon_rate)
        p_over = overload_probability(pods, new, held_as) if current else 1.0
        for_target = fewest_pods(demand, policy.target_utilization * per_pod)
        for_prompts, for_tokens = _rate_replicas(role, pods, obs, policy)
        for_rate = max(for_prompts, for_tokens)
        observed = max(for_rate, fewest_pods(demand.seen, policy.target_utilization * per_pod))
        if p_over >= policy.overload_threshold:
            recommended, reason = max(for_target, for_rate, current + 1), "ScaleUpPredictedOverload"
        elif for_target > current:
            recommended, reason = max(for_target, for_rate), "ScaleUpPredictedAboveTarget"
        elif for_rate > current:
            recommended = for_rate
            reason = "ScaleUpPrefillRate" if for_prompts >= for_tokens else "ScaleUpInterTokenLatency"
        elif max(for_target, for_rate) < current:
            recommended, reason = max(for_target, for_rate, 1), "ScaleDownUnderTarget"
        else:
            recommended, reason = current, "HoldWithinTarget"
    if (floor := held_floor(obs, policy, role)) > recommended:  # requests the routers hold wait for pods now
        recommended, observed = floor, max(observed, floor)
        reason = "ScaleUpHeldRequests" if floor > current else "HoldWithinTarget" if floor == current else reason
    if obs.unobserved.get(role, 0) > 0 and recommended < current:
        # The HPA's rule for pods without metrics: they may be loaded, so no scale-down. Their demand is missing
        # from the sum while the capacity counts them: a pool whose busy pods time out their scrapes looks idle.
        # The window remembers the size held, not the understated need.
        recommended, reason = current, "HoldMissingMetrics"
        observed = max(observed, current)
    now = Recommendation(obs.now, role, recommended, observed)

    def window(seconds: float, kept: Callable[[Recommendation], int] = lambda r: r.replicas) -> list[int]:
        return [kept(r) for r in history if r.role == role and r.at >= obs.now - seconds]

    replicas = recommended
    if recommended < current:  # the highest need in the scale-down window wins
        down = policy.scale_down_stabilization_seconds
        seen_since = min((r.at for r in history if r.role == role), default=obs.now)
        if seen_since > obs.now - down:
            replicas = current  # the window is not yet covered (a new pool, a restarted operator): wait
        else:  # what was seen, for the whole window; what was predicted, until its horizon has passed
            held = [*window(down, lambda r: r.observed), *window(min(down, policy.horizon_seconds))]
            replicas = min(current, max([recommended, *held]))
        if replicas > recommended:
            reason = "HoldStabilizing"
    elif recommended > current and policy.scale_up_stabilization_seconds > 0:  # and the lowest in the up window
        replicas = max(current, min([recommended, *window(policy.scale_up_stabilization_seconds)]))
    replicas = max(replicas, floor)  # held requests wait for no window, as a pool at 0 wakes at once
    if replicas < low:
        replicas, reason = low, ("BoundedByMin" if recommended < low else reason)
    elif replicas > high:
        replicas, reason = high, "BoundedByMax"
    return RoleDecision(replicas, recommended, reason, predicted, p_over), now


def decide(obs: PoolObservation, policy: ScalingPolicy, history: Sequence[Recommendation] = ()) -> Decision:
    """The replicas of every scaled role, and the recommendations to keep for the next call (those inside the
    stabilization windows, and the newest one before them). A role scales down only once the recommendations
    cover its whole window, so a new pool or a restarted operator (empty history) waits a window first."""
    roles: dict[str, RoleDecision] = {}
    start = obs.now - max(policy.scale_down_stabilization_seconds, policy.scale_up_stabilization_seconds)
    new_history: list[Recommendation] = []
    for role in policy.roles:
        roles[role], recommendation = decide_role(role, obs, policy, history)
        mine = [r for r in history if r.role == role]
        before = [r for r in mine if r.at < start][-1:]  # the newest one before the window: proof it is covered
        new_history += [*before, *(r for r in mine if r.at >= start), recommendation]
    if policy.scale_to_zero_idle_seconds is not None:
        roles = with_scale_to_zero(obs, policy, roles)
    return Decision(obs.now, roles, tuple(new_history))


def with_scale_to_zero(obs: PoolObservation, policy: ScalingPolicy,
                       roles: Mapping[str, RoleDecision]) -> dict[str, RoleDecision]:
    """The roles' decisions under scale to zero, for the whole pool at once (a pool with a role at 0 serves
    nothing): from 0, requests a router holds start every role now with pods enough to batch them (no
    stabilization: they wait for the pods); an idle pool (nothing running, waiting, arriving or held for the
    policy's `scale_to_zero_idle_seconds`) goes to 0; a pool at 0 with nothing held stays there; otherwise each
    role keeps at least max(min, 1) pods."""
    at_zero = all(obs.replicas.get(role, 0) == 0 for role in roles)
    if at_zero and obs.held_requests > 0:
        return {role: replace(d, replicas=wake_replicas(obs.held_requests, policy, role), reason="ScaleFromZero")
                for role, d in roles.items()}
    idle_after = policy.scale_to_zero_idle_seconds
    assert idle_after is not None, "a pool that scales to zero has an idle time"
    if at_zero or (obs.held_requests == 0 and obs.idle_seconds >= idle_after):
        return {role: replace(d, replicas=0, reason="HoldAtZero" if at_zero else "ScaleToZero")
                for role, d in roles.items()}
    return {role: d if d.replicas >= policy.serving_floor(role) else
            replace(d, replicas=policy.serving_floor(role), reason="BoundedByMin") for role, d in roles.items()}


def held_floor(obs: PoolObservation, policy: ScalingPolicy, role: str) -> int:
    """The fewest pods a role needs for the requests the routers hold now (0 when none are held): they are held
    because no engine is ready (a crashed or restarting pod, a pool at 0), and they are released together, so the
    role needs pods enough to batch them (`wake_replicas`), whatever the engines' metrics say (none may answer)."""
    return wake_replicas(obs.held_requests, policy, role) if obs.held_requests > 0 else 0


def wake_replicas(held: int, policy: ScalingPolicy, role: str) -> int:
    """Pods a role starts from zero with: enough to batch every held request at once (the router releases them
    together when the first pod is ready), at least max(min, 1), at most max."""
    batch = policy.max_batch or held
    return min(max(policy.serving_floor(role), math.ceil(held / batch)), policy.max_replicas.get(role, 1))


def scale_in_order(pods: Mapping[str, tuple[float, int]], unscraped: Iterable[str] = ()) -> dict[str, int]:
    """Pod-deletion costs for a role that shrinks (Kubernetes removes the lowest first), from each pod's (worth:
    the tokens the pool would compute again without it, its cache's hits and its work in flight, as
    scale_in.pod_worth counts them; requests in flight): the pod worth least goes first, and among equals the one
    with the fewest streams to drain. `unscraped` pods (no metrics this tick) rank above all of them: their load
    is unknown."""
    ranked = sorted(pods, key=lambda name: (pods[name][0], pods[name][1], name))
    costs = {name: rank for rank, name in enumerate(ranked)}
    for name in sorted(set(unscraped) - set(costs)):
        costs[name] = len(ranked)
    return costs
