"""`kvmesh bench queue`: FCFS against the cache-aware (longest cached prefix first) queue, on a simulated clock.

The engine's own scheduler and KV manager run a shared-prefix workload; only the model is replaced by a cost
model (a step takes `step_seconds + token_seconds` per computed token), so the result depends on the
scheduling decisions alone, is the same on every machine and takes seconds. Requests open with one of
`groups` long shared prefixes, then a unique tail; they arrive as a Poisson process faster than FCFS can
serve with a thrashing cache, and the cache holds only a few groups' prefixes at a time, so the order of
admission decides how much is recomputed. Each request decodes `output_tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvmesh.bench.machine import machine_info
from kvmesh.bench.stats import percentile
from kvmesh.engine.config import QUEUE_POLICIES
from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler


@dataclass(frozen=True)
class Workload:
    requests: int = 600
    groups: int = 8
    prefix_tokens: int = 1024
    tail_tokens: int = 64
    output_tokens: int = 8
    rate: float = 9.0  # arrivals per second
    seed: int = 0


@dataclass(frozen=True)
class Machine:
    """The simulated engine: a cost per step and per computed token, and its limits."""

    num_blocks: int = 400
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    step_seconds: float = 0.005
    token_seconds: float = 1e-4


@dataclass(frozen=True)
class QueueResult:
    policy: str
    ttft_mean: float
    ttft_p99: float
    wait_max: float  # seconds from arrival to first admission, worst request
    extra_wait_max: float  # worst (this policy's wait - FCFS's wait) for the same request; 0 for FCFS
    cached_fraction: float  # prompt tokens served from the cache
    makespan: float


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt: tuple[int, ...]


def make_workload(w: Workload) -> list[Arrival]:
    rng = random.Random(w.seed)
    t, out = 0.0, []
    for i in range(w.requests):
        t += rng.expovariate(w.rate)
        group = rng.randrange(w.groups)
        prefix = range(1 + group * w.prefix_tokens, 1 + (group + 1) * w.prefix_tokens)
        tail = range(10**7 + i * w.tail_tokens, 10**7 + (i + 1) * w.tail_tokens)
        out.append(Arrival(t, (*prefix, *tail)))
    return out


def simulate(arrivals: Sequence[Arrival], policy: str, max_queue_delay: float, m: Machine = Machine(),
             output_tokens: int = 8, progress: bool = False) -> tuple[list[Request], float]:
    """Run the scheduler on a simulated clock; returns the finished requests and the makespan."""
    now = 0.0
    kv = KVCacheManager(m.num_blocks, m.block_size)
    scheduler = Scheduler(kv, m.max_num_seqs, m.max_num_batched_tokens, policy, max_queue_delay, clock=lambda: now)
    requests = [Request(f"r{i}", list(a.prompt), SamplingParams(max_tokens=output_tokens), arrival_time=a.time)
                for i, a in enumerate(arrivals)]
    done: list[Request] = []
    i = 0
    bar = tqdm(total=len(requests), desc=policy, disable=not progress, file=sys.stderr)
    while len(done) < len(requests):
        while i < len(requests) and requests[i].arrival_time <= now:
            scheduler.add(requests[i])
            i += 1
        if not scheduler.has_work():
            now = requests[i].arrival_time
            continue
        out = scheduler.schedule()
        if out.unservable:
            raise ValueError("a request does not fit the simulated KV cache: raise num_blocks")
        now += m.step_seconds + m.token_seconds * out.num_tokens
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            kv.commit(r.request_id, r.token_ids, r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:  # the step sampled a token for it
                r.first_token_time = r.first_token_time if r.first_token_time is not None else now
                r.output_ids.append(1)
                if r.num_generated >= output_tokens:
                    scheduler.remove(r)
                    done.append(r)
                    bar.update()
    bar.close()
    return requests, now


def compare(w: Workload = Workload(), m: Machine = Machine(), max_queue_delay: float = 2.0,
            progress: bool = False) -> list[QueueResult]:
    """Both policies on the same arrivals; the prefix queue's extra wait is measured against FCFS's."""
    arrivals = make_workload(w)
    waits: dict[str, list[float]] = {}
    results = []
    for policy in QUEUE_POLICIES:
        requests, makespan = simulate(arrivals, policy, max_queue_delay, m, w.output_tokens, progress)
        ttft = [r.first_token_time - r.arrival_time for r in requests]  # type: ignore[operator]
        waits[policy] = [r.first_scheduled_time - r.arrival_time for r in requests]  # type: ignore[operator]
        extra = max(a - b for a, b in zip(waits[policy], waits["fcfs"], strict=True))
        prompt = sum(len(r.prompt_ids) for r in requests)
        results.append(QueueResult(policy, sum(ttft) / len(ttft), percentile(ttft, 0.99), max(waits[policy]),
                                   max(extra, 0.0), sum(r.cached_tokens for r in requests) / prompt, makespan))
    return results


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("queue", help="FCFS vs longest-cached-prefix queue on a simulated clock")
    p.add_argument("--requests", type=int, default=Workload.requests)
    p.add_argument("--rate", type=float, default=Workload.rate, help="arrivals per second")
    p.add_argument("--groups", type=int, default=Workload.groups, help="distinct shared prefixes")
    p.add_argument("--max-queue-delay", type=float, default=2.0, help="the prefix queue's aging bound (s)")
    p.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    """Markdown table on stdout, progress on stderr, JSON with --json."""
    if args.requests < 1 or args.rate <= 0 or args.groups < 1 or args.max_queue_delay < 0:
        print("kvmesh bench queue: --requests, --rate, --groups must be positive, --max-queue-delay >= 0",
              file=sys.stderr)
        return 2
    w = Workload(requests=args.requests, rate=args.rate, groups=args.groups)
    results = compare(w, Machine(), args.max_queue_delay, progress=True)
    fcfs = results[0]
    print(f"{w.requests} requests at {w.rate}/s, {w.groups} shared prefixes of {w.prefix_tokens} tokens; "
          f"aging bound {args.max_queue_delay} s; simulated clock\n")
    print("| queue | TTFT mean (s) | TTFT p99 (s) | worst wait (s) | worst wait beyond FCFS (s) | cached "
          "| vs FCFS mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.policy} | {r.ttft_mean:.2f} | {r.ttft_p99:.2f} | {r.wait_max:.2f} | {r.extra_wait_max:.2f} | "
              f"{r.cached_fraction:.1%} | {r.ttft_mean / fcfs.ttft_mean:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "bench": "queue", "workload": asdict(w), "machine_model": asdict(Machine()),
            "max_queue_delay": args.max_queue_delay, "machine": machine_info(),
            "results": [asdict(r) for r in results],
        }, indent=2))
    return 0
