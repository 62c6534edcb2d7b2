"""`kvmesh bench shines`: "KV cache shines under high load", reproduced on our engine.

Fixed-length prompts (2,000 tokens) whose first part is shared (0 to 100 %, five steps), sent at concurrency 1,
4, 16 and 32 to an engine with the prefix cache on, then to one with it off; short outputs, so the sweep takes
minutes. At concurrency 1 the cache can save at most the prefill's share of a request's latency (the
single-request ceiling); under load, prefill is work that every other request waits behind, while decode steps
are shared by the whole batch, so skipping cached prefill pays more as concurrency grows. The sweep measures
whether it does, and says so with numbers either way.

Each point uses a fresh shared prefix (a new seed), sent once untimed before the timed requests when the cache
is on (the first request of a point would otherwise compute it while the others race it); each point sends
max(requests, concurrency) requests, all at once, at most `concurrency` in flight. Both engines are started here
and run side by side; each point is measured on one, then at once on the other, so only one is busy at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.bench import plots
from kvmesh.bench.args import number_list, positive_ints
from kvmesh.bench.machine import machine_info
from kvmesh.bench.serve import (
    BenchRequest,
    finite,
    random_requests,
    run_load,
    shared_prefix_requests,
    split_shared,
    summarize,
)
from kvmesh.bench.sim_engine import PROFILES
from kvmesh.processes import free_port, spawn, stop, wait_healthy

DEFAULT_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_CONCURRENCY = (1, 4, 16, 32)
REAL_KV_MIB = 3072


@dataclass(frozen=True)
class Point:
    cache: bool
    concurrency: int
    shared_fraction: float
    requests: int
    failed: int
    seconds: float
    request_throughput: float  # requests per second
    output_throughput: float  # tokens per second
    mean_latency: float  # end to end, seconds
    mean_ttft: float
    hit_ratio: float
    measured: bool = True  # False: a cache-off point measured at another fraction (`--off-once`)


@dataclass(frozen=True)
class Gain:
    """Cache on against off at one concurrency and shared fraction."""

    concurrency: int
    shared_fraction: float
    throughput: float  # on / off
    latency: float  # off / on (above 1: the cache made requests faster)


def point_requests(prompt_tokens: int, fraction: float, count: int, output_tokens: int, seed: int,
                   vocab: int) -> tuple[BenchRequest, list[BenchRequest]]:
    """A warm-up request and `count` timed ones: one shared prefix, a distinct rest each."""
    system, question = split_shared(prompt_tokens, fraction)
    batch = shared_prefix_requests(1, count + 1, system, question, output_tokens, seed, vocab, shuffle=False)
    return batch[0], batch[1:]


async def measure(url: str, cache: bool, concurrency: int, fraction: float, args: argparse.Namespace,
                  seed: int) -> Point:
    count = max(args.requests, concurrency)
    warmup, timed = point_requests(args.prompt_tokens, fraction, count, args.output_tokens, seed, args.vocab_size)
    if cache and fraction > 0:
        await run_load(url, [BenchRequest(warmup.prompt, 1)], progress=False, timeout=args.timeout)
    results, seconds = await run_load(url, timed, concurrency=concurrency, progress=False, timeout=args.timeout)
    r = summarize(results, seconds)
    return Point(cache, concurrency, fraction, r.completed, r.failed, seconds, r.request_throughput,
                 r.output_throughput, r.e2e.mean, r.ttft.mean, r.hit_ratio)


def gains(points: list[Point]) -> list[Gain]:
    off = {(p.concurrency, p.shared_fraction): p for p in points if not p.cache}
    out = []
    for p in points:
        base = off.get((p.concurrency, p.shared_fraction))
        if p.cache and base is not None:
            out.append(Gain(p.concurrency, p.shared_fraction, p.request_throughput / base.request_throughput,
                            base.mean_latency / p.mean_latency))
    return out


def grows_with_concurrency(found: list[Gain], fraction: float) -> bool:
    """Whether the throughput gain at `fraction` rises at every step up in concurrency."""
    series = [g.throughput for g in sorted(found, key=lambda g: g.concurrency) if g.shared_fraction == fraction]
    return all(b > a for a, b in itertools.pairwise(series))


def prefill_share(points: list[Point]) -> float | None:
    """The single-request ceiling: the share of a lone request's latency that is prefill (TTFT over end-to-end
    latency at concurrency 1, cache off). No cache can make such a request faster than 1 / (1 - share)."""
    lone = [p for p in points if not p.cache and p.measured and p.concurrency == 1 and p.mean_latency > 0]
    if not lone:
        return None
    return sum(p.mean_ttft for p in lone) / sum(p.mean_latency for p in lone)


def plot(points: list[Point], path: Path, title: str) -> None:
    from matplotlib.ticker import FormatStrFormatter

    plt = plots.pyplot()

    found = gains(points)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    levels = sorted({p.concurrency for p in points})
    colors = plt.get_cmap("viridis")([i / max(len(levels) - 1, 1) for i in range(len(levels))])
    for c, color in zip(levels, colors, strict=True):
        for cache, style in ((True, "-"), (False, "--")):
            series = sorted((p for p in points if p.concurrency == c and p.cache == cache),
                            key=lambda p: p.shared_fraction)
            xs = [100 * p.shared_fraction for p in series]
            label = f"c={c}, cache {'on' if cache else 'off'}"
            axes[0].plot(xs, [p.request_throughput for p in series], style, marker="o", color=color, label=label)
            axes[1].plot(xs, [p.mean_latency for p in series], style, marker="o", color=color, label=label)
        g = sorted((x for x in found if x.concurrency == c), key=lambda x: x.shared_fraction)
        axes[2].plot([100 * x.shared_fraction for x in g], [x.throughput for x in g], marker="o", color=color,
                     label=f"c={c}")
    for ax, ylabel in zip(axes, ("throughput (requests/s)", "mean latency (s)", "throughput gain (on / off)"),
                          strict=True):
        ax.set_xlabel("shared prefix (% of the prompt)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    for ax in axes[1:]:
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes[0].legend(fontsize=7, ncol=2)
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    plots.save(fig, path)


def format_results(points: list[Point]) -> str:
    found = {(g.concurrency, g.shared_fraction): g for g in gains(points)}
    lines = ["| concurrency | shared | cache | req/s | mean latency (s) | mean TTFT (s) | hit ratio | "
             "throughput gain | latency gain |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for p in sorted(points, key=lambda p: (p.concurrency, p.shared_fraction, not p.cache)):
        g = found.get((p.concurrency, p.shared_fraction)) if p.cache else None
        gain = f"{g.throughput:.2f}x | {g.latency:.2f}x" if g else " | "
        fail = (f" ({p.failed} failed)" if p.failed else "") + ("" if p.measured else " (as at 0 %)")
        lines.append(f"| {p.concurrency} | {p.shared_fraction:.0%} | {'on' if p.cache else 'off'}{fail} | "
                     f"{p.request_throughput:.3f} | {p.mean_latency:.2f} | {p.mean_ttft:.2f} | {p.hit_ratio:.1%} | "
                     f"{gain} |")
    return "\n".join(lines)


def verdict(points: list[Point]) -> str:
    found = gains(points)
    lines = []
    share = prefill_share(points)
    if share is not None:
        ceiling = 1 / (1 - share) if share < 1 else math.inf
        lines.append(f"single-request ceiling: prefill is {share:.1%} of a lone request's latency (cache off), so "
                     f"no cache can make one more than {ceiling:.1f}x faster")
    for f in sorted({g.shared_fraction for g in found if g.shared_fraction > 0}):
        series = sorted((g for g in found if g.shared_fraction == f), key=lambda g: g.concurrency)
        numbers = ", ".join(f"c={g.concurrency}: {g.throughput:.2f}x" for g in series)
        word = "grows" if grows_with_concurrency(found, f) else "does NOT grow"
        lines.append(f"shared {f:.0%}: throughput gain {word} with concurrency ({numbers})")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("shines", help="prefix cache on against off, over shared-prefix fractions and "
                                                   "concurrency: does caching pay more under load?")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--fractions", type=number_list(float, 0.0, 1.0), default=list(DEFAULT_FRACTIONS),
                   help="comma-separated shared fractions (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--concurrency", type=positive_ints, default=list(DEFAULT_CONCURRENCY),
                   help="comma-separated concurrency levels (default 1,4,16,32)")
    p.add_argument("--requests", type=int, default=8,
                   help="timed requests per point (at least the point's concurrency; default 8)")
    p.add_argument("--off-once", action="store_true",
                   help="measure cache off at the first fraction only and use it for all: without a cache the engine "
                        "computes every token, so its work does not depend on the fraction")
    p.add_argument("--model", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--sim", choices=sorted(PROFILES), help="simulated engines (kvmesh sim-engine) of this profile")
    p.add_argument("--threads", type=int, help="torch threads of the engine (default: torch's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="the engine's dtype (auto measures at start, which a loaded machine can mislead)")
    p.add_argument("--kv-cache-memory-mib", type=int,
                   help=f"KV budget of the engine (default {REAL_KV_MIB}: 32 prompts of 2,000 tokens fit the bundled "
                        "model's cache without sharing; simulated engines: their profile's)")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids stay below this")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the points here as JSON")
    p.add_argument("--plot", default="docs/img/shines.png", help="PNG of throughput, latency and gain")


def _engine_args(args: argparse.Namespace, cache: bool, port: int) -> list[str]:
    if args.sim:
        out = ["sim-engine", "--profile", args.sim]
    else:
        out = ["serve", "--dtype", args.dtype, *(["--model", args.model] if args.model else []),
               *(["--threads", str(args.threads)] if args.threads else [])]
    budget = args.kv_cache_memory_mib or (None if args.sim else REAL_KV_MIB)
    out += ["--port", str(port), "--log-level", "warning", "--max-num-seqs", str(max(64, *args.concurrency)),
            *(["--kv-cache-memory-mib", str(budget)] if budget else [])]
    return out + ([] if cache else ["--no-prefix-cache"])


def sweep(args: argparse.Namespace) -> list[Point]:
    """Both engines run side by side, and each point is measured on one right after the other: only one is busy
    at a time, and a machine whose load drifts (a shared one) moves both measurements of a point alike."""
    from tqdm import tqdm

    grid = [(c, f) for c in args.concurrency for f in args.fractions]
    plan = [(k, c, f, cache) for k, (c, f) in enumerate(grid) for cache in (True, False)
            if cache or not args.off_once or f == args.fractions[0]]
    points: list[Point] = []
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-shines-"))
    engines: dict[bool, tuple[str, subprocess.Popen[bytes], Path]] = {}
    try:
        for cache in (True, False):
            port = free_port()
            log = logs / f"engine-cache-{'on' if cache else 'off'}.log"
            engines[cache] = (f"http://127.0.0.1:{port}", spawn(_engine_args(args, cache, port), log), log)
        for url, proc, log in engines.values():
            wait_healthy(url, proc, timeout=600, log=log)
            # a fresh engine's first long prompts run several times slower (first use of its KV memory and
            # kernels): one untimed prompt each, so the first point measures the engine, not its start
            asyncio.run(run_load(url, random_requests(1, args.prompt_tokens, 2, args.seed - 1, args.vocab_size),
                                 progress=False, timeout=args.timeout))
        for k, c, f, cache in tqdm(plan, desc="points", unit="pt", file=sys.stderr):
            seed = args.seed + 1000 * k + 1  # a fresh prefix per point, the same prompts for both engines
            points.append(asyncio.run(measure(engines[cache][0], cache, c, f, args, seed)))
    finally:
        stop([proc for _, proc, _ in engines.values()])
    if args.off_once:
        points += [Point(**{**asdict(p), "shared_fraction": f, "measured": False})
                   for p in list(points) if not p.cache for f in args.fractions[1:]]
    return points


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or not args.concurrency or min(args.concurrency) < 1:
        print("kvmesh bench shines: --requests and every concurrency must be at least 1", file=sys.stderr)
        return 2
    if any(not 0 <= f <= 1 for f in args.fractions):
        print("kvmesh bench shines: fractions must be between 0 and 1", file=sys.stderr)
        return 2
    points = sweep(args)
    print(format_results(points))
    print()
    print(verdict(points))
    engine = f"sim-engine {args.sim}" if args.sim else (args.model or "SmolLM2-135M-Instruct (bundled)")
    title = (f"prefix cache on (solid) vs off (dashed): {args.prompt_tokens}-token prompts, {args.output_tokens} "
             f"output tokens, {engine}")
    if args.plot:
        plot(points, Path(args.plot), title)
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite({"settings": vars(args), "machine": machine_info(), "engine": engine,
                                           "points": [asdict(p) for p in points],
                                           "gains": [asdict(g) for g in gains(points)],
                                           "prefill_share_single_request": prefill_share(points),
                                           "verdict": verdict(points)}), indent=2))
    return 0 if all(p.failed == 0 for p in points) else 1
