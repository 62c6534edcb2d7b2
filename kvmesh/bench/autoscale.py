"""`kvmesh bench autoscale`: scaling policies on a replay of the Azure conversation trace (the project's
autoscaling target: at least 60 % fewer SLO violations than scaling on the current KV utilization, for no
more replica-seconds).

Three policies drive the same simulated pool (aggregated instances; a new one serves 60 s after it is asked
for, whatever the trace's speed-up):
- static: a fixed size, the predictive policy's mean size rounded up (the same spend, never adapted);
- reactive: the Kubernetes HPA rule on the instances' current KV usage, desired = ceil(current x usage /
  80 %), with its 10 % tolerance and 5-minute scale-down stabilization;
- kvmesh: the operator's own pure decision (operator/scaling.py: the engines' KV forecasts plus the pool's
  arrivals), fed what the operator reads in production: each engine's forecast (engine/forecast.py, computed
  by the simulated instance over its own requests) and the traffic as the operator's own estimator
  (operator/forecast.py `TrafficEstimator`) reads it from the ready instances' counters, scrape after scrape
  (`exact_arrivals` counts them exactly instead: the simulator's oracle, to measure what the estimate costs).

The target is read against the HPA rule at the same utilization target (fewer violations, replica-seconds
ratio), and at equal cost: the reactive rule also runs with lower targets (which spend more), and kvmesh is
compared with the reactive run that spent at least as much.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.bench import plots
from kvmesh.bench.args import number_list
from kvmesh.bench.machine import machine_info
from kvmesh.bench.policies import RouterPolicy
from kvmesh.bench.sim import (
    SLO,
    Cluster,
    ClusterSpec,
    LatencyModel,
    Observation,
    SimRequest,
    SimResult,
    build_requests,
)
from kvmesh.bench.traces import AZURE_CONV_TRACE, load_azure
from kvmesh.operator import forecast, scaling
from kvmesh.operator.forecast import PodMetrics, TrafficEstimator, rate_trend
from kvmesh.operator.memory import IdleClock, RouterView

ROLE = "both"
PERIOD_SECONDS = 15.0  # the HPA's sync period; the operator's timer uses the same here
# An 8B-class model on one GPU: 128 KiB of KV per token (32 layers, 8 KV heads of 128, fp16), a small cache.
INSTANCE = LatencyModel(prefill_tokens_per_second=20000.0, decode_step_seconds=0.015,
                        decode_step_per_sequence_seconds=0.0002, kv_bytes_per_token=128 * 1024)
CACHE_TOKENS = 64_000
BLOCK_SIZE = 128  # coarser than an engine's 16: the same usage to within a few per cent, 8x fewer events
STARTUP_SECONDS = ClusterSpec.startup_seconds  # the simulator's start-up delay, fixed in advance
TARGETS = number_list(float, 0.0, 0.95, low_open=True)  # target utilizations, as --hpa-targets 0.8,0.7 reads them


@dataclass
class StaticPolicy:
    replicas: int
    name: str = "static"
    period_seconds: float = PERIOD_SECONDS
    forecast_horizon_seconds: float | None = None

    def desired(self, observation: Observation) -> int:
        return self.replicas


@dataclass
class ReactivePolicy:
    """The HorizontalPodAutoscaler on the mean KV usage of the ready instances: ceil(current x usage / target),
    no change within the tolerance, and a scale-down only to the highest recommendation of the window."""

    min_replicas: int = 1
    max_replicas: int = 64
    target: float = 0.8
    tolerance: float = 0.1  # Kubernetes' default
    stabilization_seconds: float = 300.0
    name: str = "reactive (HPA on KV usage)"
    period_seconds: float = PERIOD_SECONDS
    forecast_horizon_seconds: float | None = None
    _window: deque[tuple[float, int]] = field(default_factory=deque)
    _first_seen: float | None = None

    def desired(self, observation: Observation) -> int:
        current = observation.replicas
        ratio = observation.mean_ready_usage() / self.target
        recommended = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio - 1e-9)
        recommended = min(max(recommended, self.min_replicas), self.max_replicas)
        if self._first_seen is None:
            self._first_seen = observation.now
        self._window.append((observation.now, recommended))
        while self._window[0][0] < observation.now - self.stabilization_seconds:
            self._window.popleft()
        if recommended < current:
            if observation.now - self._first_seen < self.stabilization_seconds:
                return current  # as a long-running HPA, whose window holds the current size: no early dip
            return min(current, max(r for _, r in self._window))
        return recommended


@dataclass
class PredictivePolicy:
    """The operator's decision (operator/scaling.py) over the simulated pool, as its timer makes it; with scale to
    zero in the policy, fed the router's held requests and the operator's own idle clock (operator/memory.py)."""

    policy: scaling.ScalingPolicy
    name: str = "kvmesh (forecast)"
    period_seconds: float = PERIOD_SECONDS
    trend_points: int = TrafficEstimator.trend_points  # as the operator reads the trend
    exact_arrivals: bool = False  # the simulator's exact counts instead of the operator's estimator (an oracle)
    _history: tuple[scaling.Recommendation, ...] = ()
    _traffic: TrafficEstimator = field(default_factory=TrafficEstimator)
    _seen_finished: dict[str, int] = field(default_factory=dict)  # per instance, its finished counter last seen
    _apportioned: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # seconds, output, cached
    _rates: deque[tuple[float, float]] = field(default_factory=deque)
    _per_request: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    _context: float = 0.0  # KV tokens a decoding request attends to, mean
    _idle: IdleClock = field(default_factory=IdleClock)

    @property
    def forecast_horizon_seconds(self) -> float:
        return self.policy.horizon_seconds

    def desired(self, observation: Observation) -> int:
        decision = scaling.decide(self.pool_observation(observation), self.policy, self._history)
        self._history = decision.history
        return decision.replicas[ROLE]

    def instance_counters(self, obs: Observation) -> list[tuple[str, forecast.Counters]]:
        """Each ready instance's cumulative counters as its /metrics would show them. The simulator keeps per
        instance its finished requests and their prompt tokens, and per period the pool's sums of their seconds,
        output and cached tokens: those are apportioned to the instances by the requests each finished in the
        period, so that the estimator's per-request means are the period's own."""
        ready = [i for i in obs.instances if i.ready]
        grown = {i.name: max(0, i.finished - self._seen_finished.get(i.name, 0)) for i in ready}
        total, c = sum(grown.values()), obs.counters
        out: list[tuple[str, forecast.Counters]] = []
        for i in ready:
            share = grown[i.name] / total if total else 0.0
            seconds, output, cached = self._apportioned.get(i.name, (0.0, 0.0, 0.0))
            seconds, output, cached = (seconds + share * c.finished_seconds, output + share * c.output_tokens,
                                       cached + share * c.cached_tokens)
            self._apportioned[i.name], self._seen_finished[i.name] = (seconds, output, cached), i.finished
            out.append((i.name, forecast.Counters(finished=i.finished, finished_seconds=seconds,
                                                  prompt_tokens=i.prompt_tokens, output_tokens=output,
                                                  cached_tokens=cached, in_flight=i.running + i.waiting,
                                                  timed=i.finished)))
        return out

    def pool_observation(self, obs: Observation) -> scaling.PoolObservation:
        """What the operator builds from the engines' metrics and counters (operator/handlers.py's tick). Its timer
        runs from the pool's start, as kopf's does from the pool's creation: the scrape a period before the first
        decision, at the replay's start, read every instance's counters at 0, so the first decision has a rate
        (an operator restarted in mid-traffic has none at its first tick, and holds the pool as it is)."""
        if not self.exact_arrivals:
            roles = {i.name: i.role for i in obs.instances}
            if self._traffic.last_scrape is None:
                self._traffic.update(obs.now - obs.period_seconds,
                                     [(i.name, forecast.Counters()) for i in obs.instances if i.ready], BLOCK_SIZE,
                                     roles)
            traffic = self._traffic.update(obs.now, self.instance_counters(obs), BLOCK_SIZE, roles)
            return self._observation(obs, traffic.arrival_rate, traffic.arrival_rate_slope,
                                     (traffic.blocks_per_request, traffic.request_seconds,
                                      traffic.uncached_prompt_tokens, traffic.output_tokens),
                                     traffic.decode_context_tokens)
        rate = obs.arrivals / obs.period_seconds
        self._rates.append((obs.now, rate))
        while len(self._rates) > self.trend_points:
            self._rates.popleft()
        slope = rate_trend(list(self._rates))
        c = obs.counters
        if c.finished:
            self._per_request = (math.ceil((c.prompt_tokens + c.output_tokens) / c.finished / BLOCK_SIZE),
                                 c.finished_seconds / c.finished, (c.prompt_tokens - c.cached_tokens) / c.finished,
                                 c.output_tokens / c.finished)
            self._context = (c.prompt_tokens + c.output_tokens / 2) / c.finished  # as TrafficEstimator reads it
        return self._observation(obs, rate, slope, self._per_request, self._context)

    def _observation(self, obs: Observation, rate: float, slope: float,
                     per_request: tuple[float, float, float, float], context: float) -> scaling.PoolObservation:
        blocks, seconds, uncached, output = per_request
        pods = [scaling.PodObservation(
            i.name, i.role, i.num_blocks, i.kv_usage,
            dict(i.forecast.usage_quantiles) if i.forecast else {},
            i.forecast.overload_probability if i.forecast else 0.0, i.running, i.waiting,
            i.prefill_tokens_per_second, i.decode_step_seconds, i.decode_step_cost,
            dict(i.forecast.peak_quantiles) if i.forecast else {}) for i in obs.instances if i.ready]
        counters = {i.name: forecast.Counters(finished=i.finished, prompt_tokens=i.prompt_tokens)
                    for i in obs.instances}
        scraped = [PodMetrics(p, counters[p.name], BLOCK_SIZE) for p in pods]
        idle = self._idle.update(obs.now, scraped, RouterView(obs.held))
        return scaling.PoolObservation(obs.now, pods, {ROLE: obs.replicas}, rate, slope, blocks, seconds, uncached,
                                       output, decode_context_tokens=context, held_requests=obs.held,
                                       idle_seconds=idle)


@dataclass(frozen=True)
class Row:
    policy: str
    violations: int
    violation_ratio: float
    ttft_p99: float
    itl_p99: float
    replica_seconds: float
    mean_replicas: float
    preemptions: int


def replay(requests: list[SimRequest], policy: Any, initial: int,
           progress: Callable[[int], None] | None) -> SimResult:
    spec = ClusterSpec({ROLE: initial}, cache_tokens=CACHE_TOKENS, block_size=BLOCK_SIZE, latency=INSTANCE)
    fresh = [SimRequest(r.rid, r.arrival, r.prompt_tokens, r.output_tokens, r.hash_ids, r.block_hashes)
             for r in requests]
    return Cluster(spec, RouterPolicy(), policy, ROLE).run(fresh, progress)


def row(result: SimResult, slo: SLO) -> Row:
    v = result.violations(slo)
    return Row(result.policy, v, v / len(result.requests), result.p99_ttft, result.itl_quantile(0.99),
               result.replica_seconds, result.replica_seconds / result.duration if result.duration else 0.0,
               result.preemptions)


def plot(results: list[SimResult], path: Path, title: str) -> None:
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for r in results:
        if r.replicas_over_time:
            t, n = zip(*r.replicas_over_time, strict=True)
            ax.step(t, n, where="post", label=r.policy)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("instances (incl. starting)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    plots.save(fig, path)


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("autoscale", help="static, reactive (HPA) and kvmesh's predictive scaling, simulated")
    p.add_argument("--trace", default=str(AZURE_CONV_TRACE), help="an Azure LLM inference trace (CSV)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--speedup", type=float,
                   help="divide the trace's arrival times by this (default 16; 1 with --scale-to-zero)")
    p.add_argument("--initial", type=int, default=16, help="instances at the start (what the first minutes need)")
    p.add_argument("--hpa-targets", type=TARGETS, default="0.8,0.7,0.6",
                   help="KV usage targets of the reactive runs (0.8 is the rule; lower ones spend more)")
    p.add_argument("--kvmesh-targets", type=TARGETS, default="0.8", help="target utilizations of the operator's policy")
    p.add_argument("--horizon", type=float, default=scaling.ScalingPolicy({}, {}).horizon_seconds,
                   help=f"the operator's forecast horizon, seconds (at least the {STARTUP_SECONDS:g} s start-up delay)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds (mean per request)")
    p.add_argument("--itl-objective", action="store_true",
                   help="also give kvmesh's policy the ITL SLO as its objective (spec.scaling.slo.itlSeconds) and "
                        "run it beside the policy without one")
    p.add_argument("--exact-arrivals", action="store_true",
                   help="feed kvmesh's policy the simulator's exact arrival counts instead of the operator's "
                        "estimate from the engines' counters (an oracle: what the estimate costs)")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", help="write the instances over time here (PNG)")
    from kvmesh.bench import autoscale_zero  # it builds on this module's instance and policy

    autoscale_zero.add_arguments(p)


def compare(ours: Row, reactive: list[Row]) -> tuple[Row | None, float]:
    """The reactive run that spent no fewer replica-seconds than `ours` with the fewest violations, and how many
    fewer violations `ours` had (the target: >= 60 %); None when every reactive run was cheaper."""
    costlier = [r for r in reactive if r.replica_seconds >= ours.replica_seconds]
    if not costlier:
        return None, 0.0
    best = min(costlier, key=lambda r: r.violations)
    return best, (1 - ours.violations / best.violations) if best.violations else 0.0


def versus(ours: Row, rule: Row) -> tuple[float | None, float]:
    """How many fewer violations `ours` had than `rule` (None when the rule had none: no reduction to measure)
    and `ours`' replica-seconds over the rule's: the target is >= 60 % fewer for at most 1.0x."""
    fewer = 1 - ours.violations / rule.violations if rule.violations else None
    return fewer, ours.replica_seconds / rule.replica_seconds


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:  # before the run, for both studies: a bad path must not cost the results
        plots.check_output_path(args.json, "--json")
        if not args.scale_to_zero:  # (the scale-to-zero study draws no plot)
            plots.check_output_path(args.plot, "--plot")
    except ValueError as exc:
        print(f"kvmesh bench autoscale: {exc}", file=sys.stderr)
        return 2
    if args.scale_to_zero:
        from kvmesh.bench import autoscale_zero

        return autoscale_zero.run(args, 1.0 if args.speedup is None else args.speedup)
    args.speedup = 16.0 if args.speedup is None else args.speedup
    try:
        if args.initial < 1:
            raise ValueError("--initial must be at least 1")
        if args.horizon < STARTUP_SECONDS:
            raise ValueError(f"--horizon must be at least the start-up delay ({STARTUP_SECONDS:g} s)")
        hpa_targets, kvmesh_targets = args.hpa_targets, args.kvmesh_targets
        requests = build_requests(load_azure(args.trace, args.limit, args.speedup), BLOCK_SIZE)
    except (OSError, ValueError) as exc:
        print(f"kvmesh bench autoscale: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    slo = SLO(args.ttft_slo, args.itl_slo)
    objectives = [None, args.itl_slo] if args.itl_objective else [None]
    runs = 1 + len(hpa_targets) + len(kvmesh_targets) * len(objectives)
    with tqdm(total=runs * len(requests), unit="req", desc="policies") as bar:
        ours = [replay(requests, PredictivePolicy(scaling.ScalingPolicy({ROLE: 1}, {ROLE: 64}, target_utilization=t,
                                                                        horizon_seconds=args.horizon,
                                                                        startup_seconds=STARTUP_SECONDS,
                                                                        itl_seconds=itl),
                                                  exact_arrivals=args.exact_arrivals,
                                                  name=f"kvmesh (forecast, target {t:.0%}"
                                                       + (f", ITL objective {itl:g} s)" if itl else ")")),
                       args.initial, bar.update)
                for t in kvmesh_targets for itl in objectives]
        kvmesh_targets = [t for t in kvmesh_targets for _ in objectives]
        reactive = [replay(requests, ReactivePolicy(target=t, name=f"reactive (HPA on KV usage, target {t:.0%})"),
                           args.initial, bar.update) for t in hpa_targets]
        size = math.ceil(ours[0].replica_seconds / ours[0].duration)
        static = replay(requests, StaticPolicy(size, name=f"static ({size})"), size, bar.update)
    results = [static, *reactive, *ours]
    rows = [row(r, slo) for r in results]
    print(f"\n{len(requests)} requests, arrivals sped up {args.speedup:g}x, {args.initial} instances at the start; "
          f"SLO: TTFT <= {slo.ttft_seconds} s and mean ITL <= {slo.itl_seconds} s; instances start in "
          f"{STARTUP_SECONDS:g} s; kvmesh's horizon {args.horizon:g} s\n")
    print("| policy | SLO violations | share | TTFT p99 (s) | ITL p99 (s) | replica-seconds | mean instances | "
          "preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.policy} | {r.violations} | {r.violation_ratio:.1%} | {r.ttft_p99:.2f} | {r.itl_p99:.3f} | "
              f"{r.replica_seconds:,.0f} | {r.mean_replicas:.2f} | {r.preemptions} |")
    verdicts: dict[str, dict[str, Any]] = {}
    rules = dict(zip(hpa_targets, rows[1 : 1 + len(reactive)], strict=True))
    for target, mine in zip(kvmesh_targets, rows[1 + len(reactive):], strict=True):
        if target in rules:
            fewer, cost = versus(mine, rules[target])
            share = "no reduction to measure" if fewer is None else f"{fewer:.1%} fewer violations"
            print(f"\n{mine.policy}: {share} against {rules[target].policy} "
                  f"({mine.violations} against {rules[target].violations}) for {cost:.3f}x its replica-seconds "
                  f"(target: >= 60 % fewer for <= 1.000x)")
            verdicts[f"{mine.policy} vs the rule"] = {"against": rules[target].policy, "fewer_violations": fewer,
                                                      "replica_seconds_ratio": cost}
        against, fewer = compare(mine, rows[1 : 1 + len(reactive)])
        if against is None:
            print(f"\n{mine.policy}: every reactive run spent fewer replica-seconds; no comparison at equal cost")
        else:
            print(f"\n{mine.policy}: {fewer:.0%} fewer violations than {against.policy}, which spent "
                  f"{against.replica_seconds / mine.replica_seconds:.2f}x its replica-seconds (target: >= 60 % fewer)")
        verdicts[mine.policy] = {"against": against.policy if against else None, "fewer_violations": fewer}
    if args.plot:
        plot(results, Path(args.plot), f"Instances over time, Azure conversation trace x{args.speedup:g}")
    if args.json:
        body: dict[str, Any] = {"machine": machine_info(), "trace": args.trace, "requests": len(requests),
                                "speedup": args.speedup, "initial": args.initial, "horizon": args.horizon,
                                "slo": vars(slo), "rows": [vars(r) for r in rows], "verdicts": verdicts,
                                "seconds": time.perf_counter() - started}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    return 0
