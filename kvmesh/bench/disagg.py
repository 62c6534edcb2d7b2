"""`kvmesh bench disagg`: when disaggregation pays. Aggregated against disaggregated pools of the same size.

Two synthetic mixes, Poisson arrivals: 8k-in/1k-out (prefill-heavy) and 1k-in/8k-out (decode-heavy). An
aggregated instance runs a prefill before its decodes' next step (so every arriving prompt stalls the tokens
of everything it decodes); a disaggregated pool splits the same instances into prefill and decode, and pays a
KV transfer per request. At each offered rate: the share of requests within both SLOs (TTFT, and mean
inter-token latency), ITL p99 over all tokens, TTFT p99; goodput as DistServe defines it, the highest rate of
the grid at which at least 90 % of requests meet both. Several prefill:decode splits are tried.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench.machine import machine_info
from kvmesh.bench.policies import RouterPolicy
from kvmesh.bench.sim import SLO, ClusterSpec, LatencyModel, SimRequest, build_requests, simulate
from kvmesh.bench.traces import TraceRequest

CACHE_TOKENS = 1_500_000  # a 70B fp16 model on 8 x 80 GB leaves about this much KV per instance

MIXES: dict[str, tuple[int, int]] = {"8k-in/1k-out": (8192, 1024), "1k-in/8k-out": (1024, 8192)}
# Rates (requests/s for the 8-instance pool) around where the aggregated pool runs out, and how long arrivals
# last: several request lifetimes (about 45 s for 8k/1k, 400 s for 1k/8k), so the replay reaches steady state.
RATES: dict[str, tuple[float, ...]] = {"8k-in/1k-out": (3.0, 4.0, 4.5, 5.0), "1k-in/8k-out": (1.0, 1.5, 2.0, 2.5, 3.0)}
ARRIVAL_SECONDS: dict[str, float] = {"8k-in/1k-out": 300.0, "1k-in/8k-out": 1200.0}
ATTAINMENT = 0.9  # DistServe: goodput is the highest rate at which this share of requests meets the SLOs


@dataclass(frozen=True)
class PoolRun:
    mix: str
    pool: str  # "aggregated" or "P:D" (prefill:decode instances)
    rate: float  # offered requests/s (scaled to the pool's size)
    attainment: float  # share of requests within both SLOs
    itl_p99: float
    ttft_p99: float
    mean_itl: float


def poisson_mix(prompt: int, output: int, rate: float, count: int, seed: int) -> list[SimRequest]:
    """`count` requests of fixed lengths arriving as a Poisson process of `rate` per second (nothing shared)."""
    rng = random.Random(seed)
    t = 0.0
    rows = []
    for _ in range(count):
        t += rng.expovariate(rate)
        rows.append(TraceRequest(t, prompt, output))
    return build_requests(rows)


def pools(instances: int) -> dict[str, dict[str, int]]:
    """The aggregated pool and the disaggregated splits tried, all with `instances` instances."""
    splits = sorted({max(1, min(instances - 1, round(instances * f))) for f in (0.125, 0.25, 0.5, 0.75)})
    return {"aggregated": {"both": instances}, **{f"{p}:{instances - p}": {"prefill": p, "decode": instances - p}
                                                  for p in splits}}


def run_pool(mix: str, roles: dict[str, int], rate: float, slo: SLO, seed: int) -> PoolRun:
    spec = ClusterSpec(roles, cache_tokens=CACHE_TOKENS, latency=LatencyModel())
    prompt, output = MIXES[mix]
    result = simulate(poisson_mix(prompt, output, rate, round(rate * ARRIVAL_SECONDS[mix]), seed), spec,
                      RouterPolicy())
    within = 1 - result.violations(slo) / len(result.requests)
    mean_itl = sum(r.mean_itl for r in result.requests) / len(result.requests)
    name = "aggregated" if "both" in roles else f"{roles['prefill']}:{roles['decode']}"
    return PoolRun(mix, name, rate, within, result.itl_quantile(0.99), result.p99_ttft, mean_itl)


def goodput(runs: list[PoolRun]) -> float:
    """The highest rate whose replay kept at least 90 % of requests within the SLOs (0 if none did)."""
    return max((r.rate for r in runs if r.attainment >= ATTAINMENT), default=0.0)


def add_parser(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("disagg", help="aggregated vs disaggregated pools in the cluster simulator")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--ttft-slo", type=float, default=5.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds (mean per request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.instances < 2:
        print("kvmesh bench disagg: need --instances >= 2", file=sys.stderr)
        return 2
    slo = SLO(args.ttft_slo, args.itl_slo)
    scale = args.instances / 8
    layouts = pools(args.instances)
    runs: list[PoolRun] = []
    with tqdm(total=len(layouts) * sum(map(len, RATES.values())), unit="replay", desc="pools x rates") as bar:
        for mix, rates in RATES.items():
            for roles in layouts.values():
                for rate in rates:
                    runs.append(run_pool(mix, roles, rate * scale, slo, args.seed))
                    bar.update(1)
    print(f"\n{args.instances} instances; SLO: TTFT <= {slo.ttft_seconds} s and mean ITL <= {slo.itl_seconds} s; "
          f"goodput: the highest rate with {ATTAINMENT:.0%} of requests within both\n")
    print("| mix | pool (prefill:decode) | rate (req/s) | within SLO | ITL p99 (s) | TTFT p99 (s) | mean ITL (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r.mix} | {r.pool} | {r.rate:.2f} | {r.attainment:.0%} | {r.itl_p99:.3f} | {r.ttft_p99:.2f} | "
              f"{r.mean_itl:.3f} |")
    goodputs = {f"{mix} {pool}": goodput([r for r in runs if r.mix == mix and r.pool == pool])
                for mix in MIXES for pool in dict.fromkeys(r.pool for r in runs)}
    print("\n| mix and pool | goodput (req/s) |\n|---|---:|")
    for name, value in goodputs.items():
        print(f"| {name} | {value:.2f} |")
    if args.json:
        body: dict[str, Any] = {"machine": machine_info(), "instances": args.instances, "slo": vars(slo),
                                "latency": vars(LatencyModel()), "cache_tokens": CACHE_TOKENS,
                                "runs": [vars(r) for r in runs], "goodput": goodputs}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    return 0
