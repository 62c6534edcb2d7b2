"""`kvmesh bench eviction`: block hit ratio of the eviction policies on the Mooncake conversation trace.

The engine's own KV manager (engine/kv/blocks.py) replays the trace with no model and no tensors: each trace
hash id is one block, written as a one-token block whose token is the id (the ids are chained, so the
manager's chained hashes keep exactly the trace's prefix structure). Requests run one at a time at their
arrival times (the policy's clock): look up the cached prefix, take blocks, register the full ones, free
them under the request's workload class. As in the engine, only full 512-token blocks short of the prompt's
last token can hit. The hit ratio is hit blocks over all the trace's blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from kvmesh.bench.args import positive_ints
from kvmesh.bench.machine import machine_info
from kvmesh.bench.plots import check_output_path
from kvmesh.bench.traces import MOONCAKE_BLOCK_TOKENS, MOONCAKE_TRACE, TraceRequest, load_mooncake
from kvmesh.engine.kv.blocks import KVCacheManager
from kvmesh.engine.kv.policy import OpeningCounter, make_policy
from kvmesh.engine.protocol import eviction_class, workload_class

DEFAULT_SIZES = (5859, 10_000, 50_000)
POLICY_NAMES = ("lru", "reuse")
END_TOKEN = (1 << 32) - 1  # the one token each replayed request computes; never a trace id


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    num_blocks: int
    hit_blocks: int
    total_blocks: int
    evictions: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def replay(requests: Sequence[TraceRequest], num_blocks: int, policy: str,
           block_tokens: int = MOONCAKE_BLOCK_TOKENS, progress: bool = False) -> ReplayResult:
    """Replay `requests` (with hash ids) through a KV manager of `num_blocks` blocks under `policy`."""
    now = 0.0
    kv = KVCacheManager(num_blocks, 1, policy=make_policy(policy, clock=lambda: now))
    openings = OpeningCounter()
    hit = total = 0
    start = time.perf_counter()
    for i, r in enumerate(tqdm(requests, desc=f"{policy} {num_blocks}", disable=not progress, file=sys.stderr)):
        if not r.hash_ids:
            raise ValueError("the eviction bench needs a trace with block ids (Mooncake format)")
        now = r.arrival
        full = r.input_tokens // block_tokens
        usable = (r.input_tokens - 1) // block_tokens  # the engine computes at least the prompt's last token
        tokens = [*r.hash_ids[:full], END_TOKEN]
        seq = str(i)
        found = kv.find_prefix(seq, tokens)
        hit += min(len(found.blocks), usable)
        total += len(r.hash_ids)
        workload = eviction_class(workload_class("chat", r.input_tokens), openings.seen(r.hash_ids, block_tokens))
        if not kv.allocate(seq, len(tokens), found):
            raise ValueError(f"request {i} needs {len(tokens)} blocks; the cache has {num_blocks}")
        kv.commit(seq, tokens, full)
        kv.free(seq, workload)
    return ReplayResult(policy, num_blocks, hit, total, kv.pool.evictions, time.perf_counter() - start)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("eviction", help="LRU vs reuse-probability eviction on the Mooncake trace")
    p.add_argument("--trace", default=str(MOONCAKE_TRACE), help="a Mooncake-format JSONL trace")
    p.add_argument("--sizes", type=positive_ints, default=list(DEFAULT_SIZES),
                   help="cache sizes in blocks, comma-separated")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", help="write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    """Markdown table on stdout, progress on stderr, JSON with --json."""
    try:
        check_output_path(args.json, "--json")  # before the run: a bad path must not cost its results
        sizes = args.sizes
        requests = load_mooncake(args.trace, limit=args.limit)
        results = [replay(requests, n, policy, progress=True) for n in sizes for policy in POLICY_NAMES]
    except ValueError as exc:
        print(f"kvmesh bench eviction: {exc}", file=sys.stderr)
        return 2
    by = {(r.policy, r.num_blocks): r for r in results}
    print(f"Mooncake conversation trace: {len(requests)} requests, {results[0].total_blocks} blocks of "
          f"{MOONCAKE_BLOCK_TOKENS} tokens\n")
    print("| cache (blocks) | LRU hit ratio | reuse hit ratio | reuse / LRU | evictions LRU / reuse |")
    print("|---:|---:|---:|---:|---:|")
    for n in sizes:
        lru, reuse = by["lru", n], by["reuse", n]
        ratio = reuse.hit_ratio / lru.hit_ratio if lru.hit_ratio else float("nan")
        print(f"| {n:,} | {lru.hit_ratio:.2%} | {reuse.hit_ratio:.2%} | {ratio:.3f} | "
              f"{lru.evictions:,} / {reuse.evictions:,} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "bench": "eviction",
            "trace": str(args.trace),
            "requests": len(requests),
            "machine": machine_info(),
            "results": [{**asdict(r), "hit_ratio": r.hit_ratio} for r in results],
        }, indent=2))
    return 0
