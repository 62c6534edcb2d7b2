"""`kvmesh bench batch`: what the Batch API's prefix order (router/batches.run_order) buys over the file's order.

One batch file, run twice through a real `kvmesh router` with a database: once with `batch_order: prefix`, once
with `batch_order: file`. Each run gets fresh simulated engines (`kvmesh sim-engine`: the real engine with its
forward pass replaced by a calibrated latency model, so its prefix cache, eviction, KV events and the router's
prefix routing are all real), so neither run inherits the other's cache. The engines' KV caches are small, so
in file order a prefix is often evicted before its next use; in prefix order its uses come together.

The workload is a real trace's multi-turn conversations, in the trace's order (which interleaves them), each
hash id a block of token ids as `kvmesh bench serve` replays it; or a synthetic one (groups of prompts sharing a
system prompt, shuffled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench.args import positive_int
from kvmesh.bench.machine import machine_info
from kvmesh.bench.scrape import metric_sum, read_metrics
from kvmesh.bench.serve import DEFAULT_VOCAB, BenchRequest, finite, shared_prefix_requests, trace_requests
from kvmesh.bench.sim_engine import PROFILES
from kvmesh.engine.protocol import DEFAULT_BLOCK_SIZE, Metric
from kvmesh.processes import free_port, spawn, stop, wait_healthy
from kvmesh.router.batches import COMPLETIONS_PATH, FILE_ORDER, FINAL_STATUSES, PREFIX_ORDER, jsonl

POLL_SECONDS = 0.2  # how often a run reads its batch: the wall time's resolution
CONVERSATION_BLOCKS = 2  # trace requests whose first two hash ids agree are turns of one conversation


# ---- the workload -------------------------------------------------------------------------------------------------


def batch_file(requests: Sequence[BenchRequest]) -> bytes:
    """The batch input file (JSONL) of `requests`, in their order: token-id prompts to /v1/completions, so prompts
    sharing a prefix share it exactly."""
    return jsonl({"custom_id": f"request-{i}", "method": "POST", "url": COMPLETIONS_PATH,
                  "body": {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True}}
                 for i, r in enumerate(requests))


def trace_conversations(path: str | None, requests: int, scan: int, min_turns: int, length_scale: float,
                        max_prompt_tokens: int, output_tokens: int, vocab: int = DEFAULT_VOCAB) -> list[BenchRequest]:
    """The first `requests` requests, in trace order, of the conversations with at least `min_turns` turns among
    the trace's first `scan` requests (a conversation: requests whose first two hash ids agree). A batch job
    re-running conversations; the trace's order interleaves them, as a file written in arrival order would."""
    from kvmesh.bench.traces import MOONCAKE_TRACE, load_mooncake

    if min_turns < 1 or requests < 1:
        raise ValueError("--requests and --min-turns must be at least 1")
    raw = load_mooncake(path or MOONCAKE_TRACE, scan)
    scaled, _ = trace_requests(path, scan, length_scale, max_model_len=max_prompt_tokens + output_tokens, vocab=vocab)
    keys = [r.hash_ids[:CONVERSATION_BLOCKS] if len(r.hash_ids) >= CONVERSATION_BLOCKS else None for r in raw]
    turns = Counter(keys)
    chosen = [BenchRequest(s.prompt, min(s.max_tokens, output_tokens), group=key[-1])
              for key, s in zip(keys, scaled, strict=True) if key is not None and turns[key] >= min_turns]
    if len(chosen) < requests:
        raise ValueError(f"the first {scan} trace requests hold only {len(chosen)} turns of conversations with at "
                         f"least {min_turns} turns; raise --trace-scan or lower --requests")
    return chosen[:requests]


def ideal_cached_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens one unbounded prefix cache serves, whatever the order: every full block whose prefix was
    seen before, short of the prompt's last token (as the engine counts `cached_tokens`). No run can pass it."""
    seen: set[tuple[int, ...]] = set()
    cached = 0
    for prompt in prompts:
        usable = (len(prompt) - 1) // block_size
        hit = 0
        while hit < usable and tuple(prompt[: (hit + 1) * block_size]) in seen:
            hit += 1
        cached += hit * block_size
        seen.update(tuple(prompt[: (b + 1) * block_size]) for b in range(len(prompt) // block_size))
    return cached


# ---- the pool and one run -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPlan:
    """The simulated pool each run gets fresh: engines, their KV cache, and the router's batch concurrency."""

    engines: int = 2
    kv_cache_blocks: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    profile: str = "cpu-smollm"
    concurrency: int = 8  # the router's batch_concurrency: a batch's requests in flight at once
    max_num_seqs: int = 16

    def __post_init__(self) -> None:
        if min(self.engines, self.kv_cache_blocks, self.block_size, self.concurrency, self.max_num_seqs) < 1:
            raise ValueError("engines, KV blocks, block size, concurrency and max-num-seqs must be at least 1")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; one of {', '.join(sorted(PROFILES))}")

    @property
    def max_model_len(self) -> int:
        """What one engine's cache holds: a longer request could never run."""
        return min(self.kv_cache_blocks * self.block_size, PROFILES[self.profile].max_model_len)

    def engine_args(self, port: int) -> list[str]:
        return ["sim-engine", "--profile", self.profile, "--port", str(port), "--kv-cache-blocks",
                str(self.kv_cache_blocks), "--block-size", str(self.block_size), "--max-model-len",
                str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs), "--log-level", "warning"]


@dataclass(frozen=True)
class OrderRun:
    """One run of the batch: its wall time (create to completed, as the client saw it) and the batch's usage."""

    order: str
    seconds: float
    requests: int
    completed: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    engine_computed_tokens: tuple[int, ...] = ()  # tokens each engine's model ran (prompt and output)
    errors: tuple[tuple[str, int], ...] = ()  # the error file's messages and how often, the most frequent first

    @property
    def engine_balance(self) -> float:
        """The busiest engine's computed tokens over the mean: 1 when the work was spread evenly. Prefix order
        sends a prefix's requests together, and the router sends them where the prefix is cached."""
        work = self.engine_computed_tokens
        return max(work) * len(work) / sum(work) if work and sum(work) else 1.0

    @property
    def requests_per_second(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "requests_per_second": self.requests_per_second, "hit_ratio": self.hit_ratio,
                "engine_balance": self.engine_balance}


def run_batch(url: str, content: bytes, requests: int, order: str, timeout: float, progress: bool) -> OrderRun:
    """Upload `content`, create a batch, and read it until it ends; its usage, or RuntimeError if it did not
    complete (with the batch's errors) and TimeoutError after `timeout` s (the batch is cancelled then)."""
    import httpx
    from tqdm import tqdm

    with httpx.Client(base_url=url, timeout=60) as client:
        upload = client.post("/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"})
        upload.raise_for_status()
        start = time.monotonic()
        batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": COMPLETIONS_PATH,
                                                 "completion_window": "24h"}).raise_for_status().json()
        bar = tqdm(total=requests, desc=f"{order} order", unit="req", disable=not progress, file=sys.stderr)
        while batch["status"] not in FINAL_STATUSES:
            if time.monotonic() - start > timeout:
                client.post(f"/v1/batches/{batch['id']}/cancel")
                bar.close()
                raise TimeoutError(f"the {order}-order batch did not end in {timeout:.0f} s")
            time.sleep(POLL_SECONDS)
            batch = client.get(f"/v1/batches/{batch['id']}").raise_for_status().json()
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
        seconds = time.monotonic() - start
        bar.close()
        if batch["status"] != "completed":
            raise RuntimeError(f"the {order}-order batch ended {batch['status']}: {batch.get('errors')}")
        errors: Counter[str] = Counter()
        if batch.get("error_file_id"):
            error_lines = client.get(f"/v1/files/{batch['error_file_id']}/content").raise_for_status().text
            errors.update(f"{e['error']['code']}: {e['error']['message']}"[:200]
                          for e in map(json.loads, error_lines.splitlines()))
    counts, usage = batch["request_counts"], batch["usage"]
    return OrderRun(order, seconds, counts["total"], counts["completed"], counts["failed"], usage["input_tokens"],
                    usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"],
                    errors=tuple(errors.most_common(3)))


def measure_order(plan: PoolPlan, content: bytes, requests: int, order: str, workdir: Path, timeout: float = 1800.0,
                  progress: bool = True) -> OrderRun:
    """Fresh engines and a router with `batch_order: order` and a SQLite database, one batch of `content` through
    them, then everything stopped: each run starts from empty caches."""
    import yaml

    folder = Path(tempfile.mkdtemp(prefix=f"{order}-", dir=workdir))
    procs = []
    try:
        pods = []
        for i in range(plan.engines):
            engine_port, log = free_port(), folder / f"engine-{i}.log"
            procs.append(spawn(plan.engine_args(engine_port), log))
            pods.append((f"http://127.0.0.1:{engine_port}", procs[-1], log))
        port = free_port()
        config = folder / "router.yaml"
        config.write_text(yaml.safe_dump({"router": {
            "port": port, "pods": [url for url, _, _ in pods], "block_size": plan.block_size,
            "database_url": f"sqlite:///{folder / 'pool.db'}", "batch_order": order,
            "batch_concurrency": plan.concurrency}}))
        router_log = folder / "router.log"
        procs.append(spawn(["router", "--config", str(config), "--log-level", "warning"], router_log))
        for url, proc, log in pods:
            wait_healthy(url, proc, timeout=120, log=log)
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, procs[-1], timeout=120, log=router_log)
        run = run_batch(router_url, content, requests, order, timeout, progress)
        return dataclasses.replace(run, engine_computed_tokens=tuple(computed_tokens(url) for url, _, _ in pods))
    finally:
        stop(procs)


def computed_tokens(engine_url: str) -> int:
    """The tokens an engine's model ran, from its /metrics."""
    import httpx

    with httpx.Client(timeout=10) as client:
        return round(metric_sum(read_metrics(client, engine_url), f"{Metric.COMPUTED_TOKENS}_total"))


# ---- the comparison -----------------------------------------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    """a / b; infinite when only b is zero, 1 when both are (the same), so the JSON says what happened."""
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def median_run(runs: Sequence[OrderRun]) -> OrderRun:
    """Each measure's median over runs of one order (the workload's counts are the same in every run)."""
    first = runs[0]
    per_engine = tuple(round(statistics.median(w)) for w in zip(*(r.engine_computed_tokens for r in runs),
                                                                 strict=True))
    return OrderRun(first.order, statistics.median(r.seconds for r in runs), first.requests,
                    min(r.completed for r in runs), max(r.failed for r in runs), first.prompt_tokens,
                    round(statistics.median(r.cached_tokens for r in runs)), first.output_tokens, per_engine)


@dataclass(frozen=True)
class Comparison:
    """Every run of one batch file in each order, and what prefix order changes (medians, prefix over file)."""

    prefix_runs: tuple[OrderRun, ...]
    file_runs: tuple[OrderRun, ...]
    ideal_cached_tokens: int  # the ceiling: one unbounded cache

    @property
    def prefix(self) -> OrderRun:
        return median_run(self.prefix_runs)

    @property
    def file(self) -> OrderRun:
        return median_run(self.file_runs)

    def ratios(self) -> dict[str, float]:
        p, f = self.prefix, self.file
        return {"seconds": ratio(p.seconds, f.seconds), "requests_per_second": ratio(p.requests_per_second,
                                                                                     f.requests_per_second),
                "cached_tokens": ratio(p.cached_tokens, f.cached_tokens), "hit_ratio": ratio(p.hit_ratio,
                                                                                              f.hit_ratio)}

    def as_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix.as_json(), "file": self.file.as_json(),
                "runs": [r.as_json() for r in (*self.prefix_runs, *self.file_runs)],
                "ideal_cached_tokens": self.ideal_cached_tokens, "ratios_prefix_over_file": self.ratios()}


def compare(plan: PoolPlan, requests: Sequence[BenchRequest], repeats: int = 1, timeout: float = 1800.0,
            progress: bool = True) -> Comparison:
    """The batch of `requests` in prefix order, then in file order, `repeats` times, each run on a fresh pool
    (alternating, so a machine whose load drifts moves both orders alike)."""
    content = batch_file(requests)
    runs: dict[str, list[OrderRun]] = {PREFIX_ORDER: [], FILE_ORDER: []}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-batch-") as workdir:
        for _ in range(repeats):
            for order, done in runs.items():
                run = measure_order(plan, content, len(requests), order, Path(workdir), timeout, progress)
                if run.completed != len(requests):
                    raise RuntimeError(f"the {order}-order batch answered {run.completed} of {len(requests)} "
                                       f"requests ({run.failed} failed: "
                                       f"{'; '.join(f'{n} x {e}' for e, n in run.errors)})")
                done.append(run)
    ideal = ideal_cached_tokens([r.prompt for r in requests], plan.block_size)
    return Comparison(tuple(runs[PREFIX_ORDER]), tuple(runs[FILE_ORDER]), ideal)


def _row(label: str, run: OrderRun) -> str:
    return (f"| {label} | {run.seconds:.1f} | {run.requests_per_second:.2f} | {run.prompt_tokens} | "
            f"{run.cached_tokens} | {run.hit_ratio:.1%} | {run.engine_balance:.2f} |")


def format_comparison(c: Comparison) -> str:
    ratios = c.ratios()
    lines = ["| batch_order | wall s | req/s | prompt tokens | cached tokens | hit ratio | busiest engine / mean |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    if len(c.prefix_runs) > 1:
        lines += [_row(f"{run.order} (run {i + 1})", run) for runs in (c.prefix_runs, c.file_runs)
                  for i, run in enumerate(runs)]
        lines += [_row(f"**{run.order}, median**", run) for run in (c.prefix, c.file)]
    else:
        lines += [_row(run.order, run) for run in (c.prefix, c.file)]
    lines.append(f"| prefix / file | {ratios['seconds']:.2f}x | {ratios['requests_per_second']:.2f}x | | "
                 f"{ratios['cached_tokens']:.2f}x | {ratios['hit_ratio']:.2f}x | |")
    ceiling = c.ideal_cached_tokens / c.prefix.prompt_tokens if c.prefix.prompt_tokens else 0.0
    lines.append(f"\nceiling (one unbounded cache): {c.ideal_cached_tokens} cached tokens, hit ratio {ceiling:.1%}")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------------------------


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("batch", help="the Batch API's prefix order against file order, on fresh "
                                                  "simulated pools behind a real router: wall time and cache hits")
    p.add_argument("--workload", choices=["trace", "synthetic"], default="trace",
                   help="trace (default): a Mooncake trace's multi-turn conversations in trace order; synthetic: "
                        "groups of prompts sharing a system prompt, shuffled")
    p.add_argument("--requests", type=positive_int, default=150, help="requests in the batch (default 150)")
    p.add_argument("--trace", help="trace: a Mooncake-format JSONL file (default: the Mooncake conversation trace)")
    p.add_argument("--trace-scan", type=positive_int, default=1000,
                   help="trace: conversations are found among this many first requests (default 1000)")
    p.add_argument("--min-turns", type=positive_int, default=3, help="trace: turns a conversation needs (default 3)")
    p.add_argument("--length-scale", type=float, default=1 / 32,
                   help="trace: scale its 512-token blocks by this (default 1/32: 16 tokens, one engine block)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=2048,
                   help="trace: longer prompts keep their leading blocks (default 2048)")
    p.add_argument("--groups", type=positive_int, default=24, help="synthetic: system prompts (default 24)")
    p.add_argument("--system-tokens", type=positive_int, default=384, help="synthetic: system prompt length")
    p.add_argument("--question-tokens", type=positive_int, default=32, help="synthetic: question length")
    p.add_argument("--output-tokens", type=positive_int, default=8,
                   help="tokens each request generates, at most (default 8: ordering changes prefill, not decode)")
    p.add_argument("--engines", type=positive_int, default=PoolPlan.engines, help="simulated engines (default 2)")
    p.add_argument("--kv-cache-blocks", type=positive_int, default=PoolPlan.kv_cache_blocks,
                   help=f"KV blocks of each engine (default {PoolPlan.kv_cache_blocks}: small, so order matters)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=PoolPlan.profile,
                   help="the simulated engines' latency model (default cpu-smollm)")
    p.add_argument("--concurrency", type=positive_int, default=PoolPlan.concurrency,
                   help="the router's batch_concurrency (default 8)")
    p.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB, help="token ids stay below this")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of each order, alternating; the table shows each and the medians (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write both runs, the ratios, the settings and the machine here")


def build_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The batch's requests in file order, and a line saying what they are."""
    if args.workload == "synthetic":
        per_group = math.ceil(args.requests / args.groups)
        requests = shared_prefix_requests(args.groups, per_group, args.system_tokens, args.question_tokens,
                                          args.output_tokens, args.seed, args.vocab_size)[: args.requests]
        return requests, (f"synthetic: {len(requests)} requests, {args.groups} groups of {args.system_tokens} "
                          f"system + {args.question_tokens} question tokens, shuffled")
    if not 0 < args.length_scale <= 1:
        raise ValueError(f"--length-scale must be in (0, 1], not {args.length_scale}")
    requests = trace_conversations(args.trace, args.requests, args.trace_scan, args.min_turns, args.length_scale,
                                   args.max_prompt_tokens, args.output_tokens, args.vocab_size)
    mean = sum(len(r.prompt) for r in requests) / len(requests)
    conversations = len({r.group for r in requests})
    return requests, (f"trace: {len(requests)} turns of {conversations} conversations (at least {args.min_turns} "
                      f"turns in the first {args.trace_scan} requests), trace order, length scale "
                      f"{args.length_scale:g}, mean prompt {mean:.0f} tokens")


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        plan = PoolPlan(args.engines, args.kv_cache_blocks, profile=args.profile, concurrency=args.concurrency)
        requests, what = build_requests(args)
        longest = max(len(r.prompt) + r.max_tokens for r in requests)
        if longest > plan.max_model_len:
            raise ValueError(f"a request needs {longest} tokens but an engine's cache holds {plan.max_model_len}: "
                             "raise --kv-cache-blocks or lower --max-prompt-tokens")
        print(f"kvmesh bench batch: {what}; {plan.engines} {plan.profile} engines of {plan.kv_cache_blocks} KV "
              f"blocks, batch_concurrency {plan.concurrency}", file=sys.stderr)
        comparison = compare(plan, requests, args.repeats, args.timeout)
    except ValueError as exc:
        print(f"kvmesh bench batch: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"kvmesh bench batch: {exc}", file=sys.stderr)
        return 1
    print(format_comparison(comparison))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite({"workload": what, "settings": vars(args), "pool": asdict(plan),
                                           "machine": machine_info(),
                                           **comparison.as_json()}), indent=2))
    return 0
