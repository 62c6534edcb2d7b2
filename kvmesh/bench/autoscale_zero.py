"""`kvmesh bench autoscale --scale-to-zero`: what scale to zero saves, and what its cold starts cost, over many
pools that are idle most of the time.

The trace's requests are dealt to `pools` models by a Zipf popularity (model k drawn with weight 1 / k^s, seeded):
the first few pools are busy, the tail ones see a request every few minutes. Every pool is the autoscaling
study's instance (autoscale.INSTANCE) scaled by the operator's own decision (autoscale.PredictivePolicy over
operator/scaling.py's `decide`, which applies `with_scale_to_zero` and sizes a wake with `wake_replicas`; the idle
time is operator/memory.py's IdleClock), twice: with `scaling.scaleToZero` (min 0, to 0 after the idle time)
and with min 1 instance. Every pool starts with one instance and is paid for from the trace's start to at least
its last arrival. While a pool has no instance ready its router holds requests (the cluster simulator's hold:
`hold_without_pods_seconds`, `max_held_requests`), and a request past the hold or the cap fails (the router's 503).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvmesh.bench.autoscale import BLOCK_SIZE, CACHE_TOKENS, INSTANCE, ROLE, PredictivePolicy
from kvmesh.bench.machine import machine_info
from kvmesh.bench.policies import RouterPolicy
from kvmesh.bench.sim import SLO, Cluster, ClusterSpec, SimRequest, SimResult, build_requests
from kvmesh.bench.traces import load_azure
from kvmesh.engine.protocol import DEFAULT_MAX_NUM_SEQS
from kvmesh.operator import scaling
from kvmesh.operator.crd import DEFAULT_ACTIVATION_TIMEOUT_SECONDS, MIN_IDLE_SECONDS
from kvmesh.router.config import MAX_HELD_REQUESTS

MAX_REPLICAS = 64


@dataclass(frozen=True)
class ZeroSetup:
    """One study's settings: the pools' scaling and the routers' hold."""

    idle_seconds: float = 300.0  # scaling.scaleToZero.idleSeconds
    cold_start_seconds: float = ClusterSpec.startup_seconds  # a new instance serves after this long
    hold_seconds: float = DEFAULT_ACTIVATION_TIMEOUT_SECONDS  # the routers' hold_without_pods_seconds
    max_held: int = MAX_HELD_REQUESTS  # the routers' max_held_requests
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the engines' batch: a wake's size is held / this
    horizon_seconds: float = scaling.ScalingPolicy({}, {}).horizon_seconds

    def policy(self, scale_to_zero: bool) -> scaling.ScalingPolicy:
        """The pool's spec.scaling as the operator reads it (operator/forecast.py's scaling_policy)."""
        return scaling.ScalingPolicy({ROLE: 0 if scale_to_zero else 1}, {ROLE: MAX_REPLICAS},
                                     horizon_seconds=max(self.horizon_seconds, self.cold_start_seconds),
                                     startup_seconds=self.cold_start_seconds, max_batch=self.max_num_seqs,
                                     scale_to_zero_idle_seconds=self.idle_seconds if scale_to_zero else None)

    def spec(self) -> ClusterSpec:
        return ClusterSpec({ROLE: 1}, cache_tokens=CACHE_TOKENS, block_size=BLOCK_SIZE, latency=INSTANCE,
                           startup_seconds=self.cold_start_seconds, hold_seconds=self.hold_seconds,
                           max_held=self.max_held)


def deal(requests: Sequence[SimRequest], pools: int, zipf: float, seed: int = 0) -> list[list[SimRequest]]:
    """Each request to one of `pools` models, model k (from 1) drawn with weight 1 / k^zipf: a few popular models
    and a long tail of rarely used ones, each keeping its requests' trace order."""
    rng = random.Random(seed)
    dealt = rng.choices(range(pools), weights=[1 / (k + 1) ** zipf for k in range(pools)], k=len(requests))
    out: list[list[SimRequest]] = [[] for _ in range(pools)]
    for request, pool in zip(requests, dealt, strict=True):
        out[pool].append(request)
    return out


def replay_pool(requests: Sequence[SimRequest], setup: ZeroSetup, scale_to_zero: bool, until: float,
                progress: Callable[[int], None] | None = None) -> SimResult:
    """One pool's replay (fresh copies of its requests, so one list serves both variants)."""
    fresh = [SimRequest(r.rid, r.arrival, r.prompt_tokens, r.output_tokens, r.hash_ids, r.block_hashes)
             for r in requests]
    scaler = PredictivePolicy(setup.policy(scale_to_zero), name="scale to zero" if scale_to_zero else "min 1")
    return Cluster(setup.spec(), RouterPolicy(), scaler, ROLE).run(fresh, progress, until)


def wakes(result: SimResult) -> int:
    """Times the pool went from 0 instances back to some."""
    counts = [n for _, n in result.replicas_over_time]
    return sum(a == 0 < b for a, b in itertools.pairwise(counts))


@dataclass(frozen=True)
class ZeroRow:
    variant: str
    replica_seconds: float
    served: int
    failed: int
    violations: int  # among the served
    held: int  # served or failed
    held_p50: float  # seconds held, over the held requests that were served
    held_p99: float
    ttft_p99: float
    pools_at_zero: int  # pools that reached 0 instances at least once
    wakes: int


def summarize(variant: str, results: Sequence[SimResult], slo: SLO) -> ZeroRow:
    served = [r for res in results for r in res.requests]
    held = [r for res in results for r in res.held()]
    held_served = np.array([r.held_seconds for r in held if math.isnan(r.failed_at)])
    ttfts = np.array([r.ttft for r in served]) if served else np.zeros(1)
    return ZeroRow(variant, sum(r.replica_seconds for r in results), len(served),
                   sum(len(r.failed) for r in results), sum(r.violations(slo) for r in results), len(held),
                   float(np.percentile(held_served, 50)) if len(held_served) else 0.0,
                   float(np.percentile(held_served, 99)) if len(held_served) else 0.0,
                   float(np.percentile(ttfts, 99)),
                   sum(any(n == 0 for _, n in r.replicas_over_time) for r in results),
                   sum(wakes(r) for r in results))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale-to-zero", action="store_true",
                   help="instead: many pools, most idle, each scaled by kvmesh with scale to zero and with min 1")
    p.add_argument("--pools", type=int, default=16, help="with --scale-to-zero: pools (models) the trace is dealt to")
    p.add_argument("--zipf", type=float, default=1.5,
                   help="with --scale-to-zero: popularity exponent (model k gets weight 1 / k^s)")
    p.add_argument("--idle-seconds", type=float, default=ZeroSetup.idle_seconds,
                   help="with --scale-to-zero: scaling.scaleToZero.idleSeconds")
    p.add_argument("--cold-start-seconds", type=float, default=ZeroSetup.cold_start_seconds,
                   help="with --scale-to-zero: how long a new instance takes to serve (the pool's podStartupSeconds)")
    p.add_argument("--hold-seconds", type=float, default=ZeroSetup.hold_seconds,
                   help="with --scale-to-zero: how long a router holds a request while no instance is ready "
                        "(activationTimeoutSeconds)")
    p.add_argument("--max-held", type=int, default=ZeroSetup.max_held,
                   help="with --scale-to-zero: requests a router holds at once at most (max_held_requests)")
    p.add_argument("--max-num-seqs", type=int, default=ZeroSetup.max_num_seqs,
                   help="with --scale-to-zero: the engines' batch, which sizes a wake (held / max_num_seqs)")


def run(args: argparse.Namespace, speedup: float) -> int:
    from tqdm import tqdm

    try:
        if args.pools < 1:
            raise ValueError("--pools must be at least 1")
        if args.idle_seconds < MIN_IDLE_SECONDS:
            raise ValueError(f"--idle-seconds must be at least {MIN_IDLE_SECONDS} (the CRD's minimum)")
        setup = ZeroSetup(args.idle_seconds, args.cold_start_seconds, args.hold_seconds, args.max_held,
                          args.max_num_seqs, args.horizon)
        setup.policy(True)
        setup.spec()
        requests = build_requests(load_azure(args.trace, args.limit, speedup), BLOCK_SIZE)
    except (OSError, ValueError) as exc:
        print(f"kvmesh bench autoscale: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    slo = SLO(args.ttft_slo, args.itl_slo)
    pools = deal(requests, args.pools, args.zipf)
    until = requests[-1].arrival if requests else 0.0
    results: dict[str, list[SimResult]] = {}
    with tqdm(total=2 * len(requests), unit="req", desc="pools") as bar:
        for variant, zero in (("min 1 instance", False), ("scale to zero", True)):
            results[variant] = [replay_pool(p, setup, zero, until, bar.update) for p in pools]
    rows = [summarize(variant, res, slo) for variant, res in results.items()]
    print(f"\n{len(requests)} requests dealt to {args.pools} pools (Zipf {args.zipf:g}: "
          f"{', '.join(str(len(p)) for p in pools)}), arrivals sped up {speedup:g}x over {until:,.0f} s; "
          f"idle {setup.idle_seconds:g} s, cold start {setup.cold_start_seconds:g} s, hold {setup.hold_seconds:g} s "
          f"(at most {setup.max_held}), wake = held / {setup.max_num_seqs}; "
          f"SLO: TTFT <= {slo.ttft_seconds} s and mean ITL <= {slo.itl_seconds} s\n")
    print("| pools scaled by kvmesh with | replica-seconds | requests held | held p50 (s) | held p99 (s) | "
          "TTFT p99 (s) | failed (503) | SLO violations (served) | pools at 0 | wakes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.variant} | {r.replica_seconds:,.0f} | {r.held} | {r.held_p50:.1f} | {r.held_p99:.1f} | "
              f"{r.ttft_p99:.2f} | {r.failed} | {r.violations} | {r.pools_at_zero} | {r.wakes} |")
    base, zero = rows
    if base.replica_seconds:
        print(f"\nscale to zero: {1 - zero.replica_seconds / base.replica_seconds:.1%} fewer replica-seconds; "
              f"{zero.held} requests held for a cold start, {zero.failed} failed")
    elapsed = time.perf_counter() - started
    print(f"({elapsed:.0f} s of wall time)")
    if args.json:
        per_pool = {variant: [{"requests": len(p), "replica_seconds": r.replica_seconds, "held": len(r.held()),
                               "failed": len(r.failed), "wakes": wakes(r)} for p, r in zip(pools, res, strict=True)]
                    for variant, res in results.items()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "bench": "autoscale --scale-to-zero", "trace": args.trace, "requests": len(requests),
            "speedup": speedup, "pools": args.pools, "zipf": args.zipf, "setup": asdict(setup),
            "slo": asdict(slo), "rows": [asdict(r) for r in rows], "per_pool": per_pool,
            "seconds": elapsed, "machine": machine_info()}, indent=2) + "\n")
    return 0
