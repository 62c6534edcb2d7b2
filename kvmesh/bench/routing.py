"""`kvmesh bench cluster`: the routing study on the Mooncake conversation trace (its targets: docs/benchmarks.md).

Mooncake's setting (FAST '25, Fig. 5): 16 prefill instances with 3 M-token caches, the prefill speed set so that
random routing's mean TTFT is about 20 s. Every policy replays the same trace through the same simulator; kvmesh's
is the router's own picker and prefix index (policies.RouterPolicy). The baselines include what production
prefix-aware routers do (prefix + load + KV, without kvmesh's TTFT scorer and pulls) and kvmesh without pulls.
Reported per policy: the token hit ratio against the unbounded-cache ideal, with and without tokens pulled from
peers, mean and p99 TTFT, and the imbalance of busy time, with kvmesh's mean TTFT as a ratio to each baseline's;
a TTFT CDF as a PNG.

`--router-replicas N ...` adds kvmesh run as N independent router replicas (policies.RouterReplicasPolicy: each
its own scrapes, counters and provisional entries), against one replica of the same model; `--spread-arrivals W`
spreads each instant's arrivals over the W seconds after it (the Mooncake trace's timestamps come in 3 s buckets,
about 10 requests at each instant).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvmesh.bench import plots
from kvmesh.bench.machine import machine_info
from kvmesh.bench.policies import (
    LeastRequestPolicy,
    OraclePolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RouterPolicy,
    RouterReplicasPolicy,
)
from kvmesh.bench.sim import ClusterSpec, RoutingPolicy, SimRequest, SimResult, build_requests, simulate
from kvmesh.bench.traces import MOONCAKE_TRACE, ideal_hit_ratio, load_mooncake
from kvmesh.router.config import RouterConfig
from kvmesh.router.picker import PickerConfig

RANDOM_TTFT_SECONDS = 20.0  # the load of the reference setting: random routing's mean TTFT (Mooncake's 19.65 s)
PREFIX_ONLY = PickerConfig(prefix_weight=1.0, kv_weight=0.0, load_weight=0.001, ttft_weight=0.0,
                           balance_factor=1e9)  # the longest prefix wins; load only breaks ties; no guard
# what production prefix-aware routers do (llm-d's and AIBrix's prefix + load scorers): the router's prefix, KV and
# load scorers and its load guard, without kvmesh's TTFT scorer and without pulls
PREFIX_LOAD = PickerConfig(ttft_weight=0.0)
PREFIX_LOAD_NAME = "prefix+load (llm-d/AIBrix-like)"


def policies(seed: int, picker: PickerConfig) -> list[RoutingPolicy]:
    """The study's policies, kvmesh's last. `picker` is kvmesh's configuration (the router's defaults unless
    the command was given weights)."""
    return [
        RandomPolicy(seed),
        RoundRobinPolicy(),
        LeastRequestPolicy(seed),
        OraclePolicy(seed),
        RouterPolicy(PREFIX_ONLY, name="prefix-only, no load guard", pulls=False),
        RouterPolicy(PREFIX_LOAD, name=PREFIX_LOAD_NAME, pulls=False),
        RouterPolicy(picker, name="kvmesh, pulls off", pulls=False),
        RouterPolicy(picker),
    ]


@dataclass(frozen=True)
class Row:
    """One policy's numbers, and kvmesh's mean TTFT as a speed-up over it."""

    policy: str
    hit_ratio: float  # pulled tokens count as hits (contract 0)
    of_ideal: float
    pulled_ratio: float
    local_of_ideal: float  # the hit ratio without pulled tokens, as a share of the ideal
    mean_ttft: float
    p99_ttft: float
    imbalance: float
    kvmesh_speedup: float  # this policy's mean TTFT over kvmesh's


@dataclass(frozen=True)
class ReplicaRow:
    """kvmesh run as `replicas` router replicas, and its mean TTFT as a ratio to one replica's."""

    replicas: int
    hit_ratio: float
    mean_ttft: float
    p99_ttft: float
    imbalance: float
    ttft_ratio: float  # this mean TTFT over one replica's


def calibrate(requests: Sequence[SimRequest], spec: ClusterSpec, target: float = RANDOM_TTFT_SECONDS,
              seed: int = 0, tolerance: float = 0.02) -> float:
    """The prefill speed (tokens/s) at which random routing's mean TTFT is `target` seconds, by bisection on
    the speed (TTFT falls as the speed rises)."""
    def ttft(speed: float) -> float:
        return simulate(requests, _with_speed(spec, speed), RandomPolicy(seed)).mean_ttft

    # start where the instances would be fully busy if nothing were cached, and widen upwards
    duration = max(requests[-1].arrival - requests[0].arrival, 1.0)
    low = high = sum(r.prompt_tokens for r in requests) / duration / sum(spec.pools.values())
    while ttft(high) > target:
        low, high = high, high * 1.25
    for _ in range(30):
        mid = (low + high) / 2
        got = ttft(mid)
        if abs(got - target) <= tolerance * target:
            return round(mid)
        low, high = (mid, high) if got > target else (low, mid)
    return round((low + high) / 2)


def _with_speed(spec: ClusterSpec, speed: float) -> ClusterSpec:
    return replace(spec, latency=replace(spec.latency, prefill_tokens_per_second=speed))


def study(requests: Sequence[SimRequest], spec: ClusterSpec, runs: Sequence[RoutingPolicy], ideal: float,
          progress: Callable[[int], None] | None = None) -> tuple[list[Row], list[SimResult]]:
    """Replay `requests` once per policy; the last policy is kvmesh, the reference of the speed-ups."""
    results = [simulate(requests, spec, policy, progress=progress) for policy in runs]
    ours = results[-1].mean_ttft
    def of_ideal(ratio: float) -> float:
        return ratio / ideal if ideal else 0.0

    rows = [Row(r.policy, r.hit_ratio, of_ideal(r.hit_ratio), r.pulled_ratio, of_ideal(r.hit_ratio - r.pulled_ratio),
                r.mean_ttft, r.p99_ttft, r.imbalance, r.mean_ttft / ours if ours else 0.0) for r in results]
    return rows, results


def spread_arrivals(requests: Sequence[SimRequest], window: float, seed: int = 0) -> list[SimRequest]:
    """The same requests with each arrival moved to a uniformly random (seeded) time within the `window` seconds
    after it, by arrival: undoes a trace's rounding of timestamps to buckets of `window` seconds, which turned each
    bucket's arrivals into a burst at one instant."""
    rng = random.Random(seed)
    moved = [SimRequest(r.rid, r.arrival + rng.uniform(0, window), r.prompt_tokens, r.output_tokens, r.hash_ids,
                        r.block_hashes) for r in requests]
    return sorted(moved, key=lambda r: r.arrival)


def replica_study(requests: Sequence[SimRequest], spec: ClusterSpec, counts: Sequence[int], picker: PickerConfig,
                  seed: int = 0, progress: Callable[[int], None] | None = None) -> list[ReplicaRow]:
    """kvmesh as each number of router replicas in `counts` (one replica first: the reference of the ratios)."""
    results = [simulate(requests, spec, RouterReplicasPolicy(n, seed, RouterPolicy(picker)), progress=progress)
               for n in counts]
    one = results[0].mean_ttft
    return [ReplicaRow(n, r.hit_ratio, r.mean_ttft, r.p99_ttft, r.imbalance, r.mean_ttft / one if one else 0.0)
            for n, r in zip(counts, results, strict=True)]


def replica_table(rows: Sequence[ReplicaRow]) -> str:
    lines = ["| router replicas | token hit ratio | mean TTFT (s) | p99 TTFT (s) | imbalance | "
             "mean TTFT vs 1 replica |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.replicas} | {r.hit_ratio:.1%} | {r.mean_ttft:.2f} | {r.p99_ttft:.2f} | {r.imbalance:.2f} | "
                     f"{r.ttft_ratio:.2f}x |")
    return "\n".join(lines)


def table(rows: Sequence[Row], ideal: float) -> str:
    lines = [f"| policy | token hit ratio | of ideal ({ideal:.1%}) | pulled | of ideal without pulled | "
             "mean TTFT (s) | p99 TTFT (s) | imbalance | kvmesh faster by |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.policy} | {r.hit_ratio:.1%} | {r.of_ideal:.0%} | {r.pulled_ratio:.1%} | "
                     f"{r.local_of_ideal:.0%} | {r.mean_ttft:.2f} | {r.p99_ttft:.2f} | {r.imbalance:.2f} | "
                     f"{r.kvmesh_speedup:.2f}x |")
    return "\n".join(lines)


def verdicts(rows: Sequence[Row]) -> dict[str, bool]:
    """The routing targets, checked on kvmesh's row against the baselines' rows of the same run. The hit ratio is
    checked twice: pulled tokens count as cached for TTFT, but they were computed elsewhere and crossed the network,
    so the target is also checked on the instances' own hits."""
    by = {r.policy: r for r in rows}
    ours = rows[-1]
    return {
        "hit ratio within 90 % of ideal, pulled tokens counted as hits": ours.of_ideal >= 0.9,
        "hit ratio within 90 % of ideal, pulled tokens not counted": ours.local_of_ideal >= 0.9,
        "imbalance <= 1.1": ours.imbalance <= 1.1,
        "mean TTFT >= 6.4x better than random": by["random"].kvmesh_speedup >= 6.4,
        "mean TTFT >= 1.72x better than least-request": by["least-request"].kvmesh_speedup >= 1.72,
        "better than the oracle": by["oracle (queued work)"].kvmesh_speedup > 1.0,
    }


def plot_cdf(results: Sequence[SimResult], path: Path, title: str) -> None:
    import numpy as np

    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:
        ttfts = np.sort(result.ttfts())
        ax.plot(np.maximum(ttfts, 1e-2), np.arange(1, len(ttfts) + 1) / len(ttfts), label=result.policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    plots.save(fig, path)


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("cluster", help="routing policies on the Mooncake trace, in the cluster simulator")
    p.add_argument("--trace", default=str(MOONCAKE_TRACE), help="a Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--cache-tokens", type=int, default=3_000_000, help="KV cache per instance, in tokens")
    p.add_argument("--prefill-speed", type=float,
                   help="prefill tokens/s per instance; default: calibrated so random's mean TTFT is 20 s")
    p.add_argument("--weight", action="append", default=[], metavar="NAME=VALUE",
                   help="a picker setting for kvmesh's policy, as in the router config's `weights` (repeatable)")
    p.add_argument("--router-replicas", type=int, nargs="+", metavar="N",
                   help="also run kvmesh as N independent router replicas (each its own scrapes, counters and "
                        "provisional entries; requests dealt at random), against 1 replica of the same model")
    p.add_argument("--spread-arrivals", type=float, metavar="SECONDS",
                   help="move each arrival to a random time within SECONDS after it (the Mooncake trace's "
                        "timestamps come in 3 s buckets); the prefill speed is calibrated on the trace as recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", help="write the TTFT CDF here (PNG)")


def picker_from_flags(weights: Sequence[str]) -> PickerConfig:
    """PickerConfig from NAME=VALUE flags, exactly as the router builds it from its config's `weights`."""
    values: dict[str, float] = {}
    for item in weights:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--weight {item!r}: expected NAME=VALUE")
        try:
            values[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--weight {item!r}: {value!r} is not a number") from None
    try:
        return PickerConfig(**values)
    except TypeError:
        raise ValueError(f"unknown picker setting in {sorted(values)}; see router/picker.py PickerConfig") from None


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        plots.check_output_path(args.json, "--json")  # before the run: a bad path must not cost its results
        plots.check_output_path(args.plot, "--plot")
        if args.instances < 1:
            raise ValueError("--instances must be at least 1")
        if args.router_replicas is not None and min(args.router_replicas) < 1:
            raise ValueError(f"--router-replicas must be at least 1, got {min(args.router_replicas)}")
        if args.spread_arrivals is not None and not args.spread_arrivals >= 0:
            raise ValueError(f"--spread-arrivals must be 0 or more seconds, got {args.spread_arrivals}")
        picker = picker_from_flags(args.weight)
        trace = load_mooncake(args.trace, args.limit)
        spec = ClusterSpec({"prefill": args.instances}, cache_tokens=args.cache_tokens)
        requests = build_requests(trace)
    except (OSError, ValueError) as exc:
        print(f"kvmesh bench cluster: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    speed = args.prefill_speed
    if speed is None:
        print(f"calibrating the prefill speed so that random's mean TTFT is {RANDOM_TTFT_SECONDS:.0f} s "
              f"{'on the trace as recorded ' if args.spread_arrivals is not None else ''}...", file=sys.stderr)
        speed = calibrate(requests, spec, seed=args.seed)  # as recorded: spread or not, the same hardware
    if args.spread_arrivals is not None:
        requests = spread_arrivals(requests, args.spread_arrivals, args.seed)
    spec = _with_speed(spec, speed)
    ideal = ideal_hit_ratio(trace)
    runs = policies(args.seed, picker)
    with tqdm(total=len(requests) * len(runs), unit="req", desc="policies") as bar:
        rows, results = study(requests, spec, runs, ideal, bar.update)
    replica_rows: list[ReplicaRow] = []
    if args.router_replicas is not None:
        counts = sorted({1, *args.router_replicas})
        with tqdm(total=len(requests) * len(counts), unit="req", desc="router replicas") as bar:
            replica_rows = replica_study(requests, spec, counts, picker, args.seed, bar.update)
    spread = "" if args.spread_arrivals is None else f"; arrivals spread over {args.spread_arrivals:g} s"
    print(f"\n{len(requests)} requests, {args.instances} instances x {args.cache_tokens:,} cached tokens, "
          f"prefill {speed:,.0f} tokens/s; unbounded-cache hit ratio {ideal:.1%}{spread}\n")
    print(table(rows, ideal))
    checks = verdicts(rows)
    for name, ok in checks.items():
        print(f"  {'met    ' if ok else 'NOT met'}  {name}")
    scrape_interval = RouterConfig().scrape_interval_seconds
    if replica_rows:
        print(f"\nkvmesh as independent router replicas, each scraping every {scrape_interval:g} s and counting only "
              "its own requests between scrapes (1 replica reads scraped numbers too, unlike the kvmesh row above):\n")
        print(replica_table(replica_rows))
    if args.plot:
        plot_cdf(results, Path(args.plot), f"TTFT, Mooncake trace, {args.instances} instances")
    if args.json:
        body: dict[str, Any] = {
            "machine": machine_info(), "trace": args.trace, "requests": len(requests), "instances": args.instances,
            "cache_tokens": args.cache_tokens, "prefill_tokens_per_second": speed, "ideal_hit_ratio": ideal,
            "picker": vars(picker), "rows": [vars(r) for r in rows], "targets": checks,
            "seconds": time.perf_counter() - started,
        }
        if args.spread_arrivals is not None:
            body["spread_arrivals_seconds"] = args.spread_arrivals
        if replica_rows:
            body["router_replicas"] = {"scrape_interval_seconds": scrape_interval,
                                       "rows": [vars(r) for r in replica_rows]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    return 0
